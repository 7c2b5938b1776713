rule token_stats:
    """Per-token entropy, Renyi-2, JSD deviation and log-prob of the rollouts; selector picks; the
    readings of ICT's reference and their picks' profile (readings.parquet); figures."""
    input:
        model=base_ref("{size}"),
        rollouts=rollout_path("{size}"),
    output:
        tokens=f"{token_stats_dir('{size}')}/tokens.parquet",
        summary=f"{token_stats_dir('{size}')}/summary.parquet",
        summary_json=f"{token_stats_dir('{size}')}/summary.json",
        readings=f"{token_stats_dir('{size}')}/readings.parquet",
        hist=f"{token_stats_dir('{size}')}/entropy_hist.png",
        top=f"{token_stats_dir('{size}')}/top_tokens.png",
        page=f"{token_stats_dir('{size}')}/tokens.html",
    params:
        config=CONFIG_FILE,
        out_dir=lambda w: token_stats_dir(w.size),
        # of the methods, only the parameters of the selectors it reports: adding a method reruns
        # it only when that changes them (stages.keys.token_stats_config_hash)
        job_hash=job_hash("token_stats"),
    log:
        f"{RESULTS}/logs/token_stats/{{size}}.log",
    threads: job_threads("token_stats")
    resources:
        **job_resources("token_stats"),
    shell:
        "{resources.stage_python} -m stages.token_stats --config {params.config} --size {wildcards.size}"
        " --model {input.model} --rollouts {input.rollouts} --out-dir {params.out_dir}"
        " --threads {resources.cpus_per_task} 2>&1 | tee {log}"
