rule overlap:
    """The top-entropy positions of the base model's rollouts under the base and a trained model:
    their overlap |A ∩ B| / |A| (the 80/20 paper's Table 1)."""
    input:
        model=f"{train_dir('{size}', '{method}', '{seed}')}/model.json",
        rollouts=rollout_path("{size}"),
        tokens=f"{token_stats_dir('{size}')}/tokens.parquet",
    output:
        overlap_path("{size}", "{method}", "{seed}"),
    params:
        config=CONFIG_FILE,
        job_hash=job_hash("overlap"),
    log:
        f"{RESULTS}/logs/overlap/{{size}}/{{method}}/{{seed}}.log",
    threads: job_threads("token_stats")
    resources:
        **job_resources("token_stats", planned="overlap"),
    shell:
        "{resources.stage_python} -m stages.overlap --config {params.config} --size {wildcards.size}"
        " --method {wildcards.method} --seed {wildcards.seed} --model {input.model}"
        " --rollouts {input.rollouts} --tokens {input.tokens} --out {output}"
        " --threads {resources.cpus_per_task} 2>&1 | tee {log}"
