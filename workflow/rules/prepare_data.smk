rule prepare_data:
    """One dataset (SFT data, RL prompts or a benchmark) as normalised Parquet."""
    output:
        data_path("{dataset}"),
    params:
        config=CONFIG_FILE,
        job_hash=job_hash("prepare_data"),
    log:
        f"{RESULTS}/logs/prepare_data/{{dataset}}.log",
    threads: job_threads("prepare_data")
    resources:
        **job_resources("prepare_data"),
    shell:
        "{resources.stage_python} -m stages.prepare_data --config {params.config} --dataset {wildcards.dataset}"
        " --out {output} 2>&1 | tee {log}"
