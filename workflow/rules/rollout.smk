rule rollout:
    """Sample n responses per training prompt from one size's base model and grade them."""
    input:
        model=base_ref("{size}"),
        prompts=[data_path(d) for d in EXP.train_datasets],
    output:
        rollout_path("{size}"),
    params:
        config=CONFIG_FILE,
        # exactly what stages.rollout reads (stages.keys.rollout_config_keys)
        job_hash=job_hash("rollout"),
    log:
        f"{RESULTS}/logs/rollout/{{size}}.log",
    threads: job_threads("rollout")
    resources:
        **job_resources("rollout"),
    shell:
        "{resources.stage_python} -m stages.rollout --config {params.config} --size {wildcards.size}"
        " --model {input.model} --prompts {input.prompts} --out {output} --threads {resources.cpus_per_task}"
        " 2>&1 | tee {log}"
