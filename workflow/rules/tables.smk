report: "../report/workflow.rst"

from stages.tables import output_names as table_output_names


rule tables:
    """Main, ICT-gain, base-gain, token-statistics and ablation tables (Markdown, LaTeX, CSV, HTML) and figures."""
    input:
        metrics=[f"{d}/metrics.parquet" for d in eval_dirs()],
        samples=[f"{d}/samples.parquet" for d in eval_dirs()],
        train=[f"{d}/metrics.parquet" for d in train_dirs()],
        token_summaries=[f"{token_stats_dir(s)}/summary.parquet" for s in EXP.sizes],
        tokens=[f"{token_stats_dir(s)}/tokens.parquet" for s in EXP.sizes],
        readings=[f"{token_stats_dir(s)}/readings.parquet" for s in EXP.sizes],
        step_metrics=[f"{d}/metrics.parquet" for d in eval_step_dirs()],
        step_samples=[f"{d}/samples.parquet" for d in eval_step_dirs()],
        overlap=overlap_paths(),
    output:
        [report_item(tables_dir(), n) for n in table_output_names(CFG)["tables"]]
        + [report_item(figures_dir(), n) for n in table_output_names(CFG)["figures"]],
    params:
        config=CONFIG_FILE,
        # the folders of the inputs and outputs (each stage writes into a folder it is given)
        eval_dirs=lambda w, input: [os.path.dirname(f) for f in input.metrics],
        train_dirs=lambda w, input: [os.path.dirname(f) for f in input.train],
        token_dirs=lambda w, input: [os.path.dirname(f) for f in input.token_summaries],
        step_dirs=lambda w, input: [os.path.dirname(f) for f in input.step_metrics],
        overlap_dirs=lambda w, input: [os.path.dirname(f) for f in input.overlap],
        tables_dir=lambda w, output: os.path.dirname(output[0]),
        figures_dir=lambda w, output: os.path.dirname(output[-1]),
        job_hash=job_hash("tables"),
    log:
        f"{RESULTS}/logs/tables/tables.log",
    threads: job_threads("tables")
    resources:
        **job_resources("tables"),
    shell:
        "{resources.stage_python} -m stages.tables --config {params.config} --eval {params.eval_dirs}"
        " --train {params.train_dirs} --token-stats {params.token_dirs}"
        " --eval-steps {params.step_dirs} --overlap {params.overlap_dirs}"
        " --tables-dir {params.tables_dir} --figures-dir {params.figures_dir} 2>&1 | tee {log}"
