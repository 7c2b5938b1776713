from stages.keys import rollout_config_keys


rule rollout:
    """Sample n responses per training prompt from one size's base model and grade them."""
    input:
        model=base_ref("{size}"),
        prompts=[data_path(d) for d in EXP.train_datasets],
    output:
        rollout_path("{size}"),
    params:
        py=PY,
        config=CONFIG_FILE,
        # exactly what stages.rollout reads (stages.rollout.config_keys)
        config_hash=lambda w: config_hash(*rollout_config_keys(CFG, w.size)),
    log:
        f"{RESULTS}/logs/rollout/{{size}}.log",
    threads: job_threads("rollout")
    resources:
        **job_resources("rollout"),
    shell:
        "{params.py} -m stages.rollout --config {params.config} --size {wildcards.size}"
        " --model {input.model} --prompts {input.prompts} --out {output} --threads {threads}"
        " 2>&1 | tee {log}"
