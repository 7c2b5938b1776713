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
        py=PY,
        config=CONFIG_FILE,
        out_dir=lambda w: token_stats_dir(w.size),
        config_hash=lambda w: config_hash(
            "rollout", "token_stats", "methods", "experiment/methods", f"models/{w.size}", "seed"
        ),
    log:
        f"{RESULTS}/logs/token_stats/{{size}}.log",
    threads: job_threads("token_stats")
    resources:
        **job_resources("token_stats"),
    shell:
        "{params.py} -m stages.token_stats --config {params.config} --size {wildcards.size}"
        " --model {input.model} --rollouts {input.rollouts} --out-dir {params.out_dir}"
        " --threads {threads} 2>&1 | tee {log}"
