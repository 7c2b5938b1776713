rule prepare_data:
    """One dataset (SFT data, RL prompts or a benchmark) as normalised Parquet."""
    output:
        data_path("{dataset}"),
    params:
        py=PY,
        config=CONFIG_FILE,
        config_hash=lambda w: config_hash(
            f"datasets/{w.dataset}", f"templates/{CFG.datasets[w.dataset].template}", "seed"
        ),
    log:
        f"{RESULTS}/logs/prepare_data/{{dataset}}.log",
    threads: job_threads("prepare_data")
    resources:
        **job_resources("prepare_data"),
    shell:
        "{params.py} -m stages.prepare_data --config {params.config} --dataset {wildcards.dataset}"
        " --out {output} 2>&1 | tee {log}"
