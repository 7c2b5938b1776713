from stages.evaluate import config_keys as evaluate_config_keys


rule evaluate:
    """Sample n responses per benchmark problem from one model, grade them, report pass@k."""
    input:
        model=eval_model,
        data=lambda w: data_path(w.bench),
    output:
        samples=f"{eval_dir('{size}', '{method}', '{seed}', '{bench}')}/samples.parquet",
        metrics=f"{eval_dir('{size}', '{method}', '{seed}', '{bench}')}/metrics.parquet",
    params:
        py=PY,
        config=CONFIG_FILE,
        out_dir=lambda w: eval_dir(w.size, w.method, w.seed, w.bench),
        config_hash=lambda w: config_hash(*evaluate_config_keys(w.size, w.bench)),
    log:
        f"{RESULTS}/logs/evaluate/{{size}}/{{method}}/{{seed}}/{{bench}}.log",
    threads: job_threads("evaluate")
    resources:
        **job_resources("evaluate"),
    shell:
        "{params.py} -m stages.evaluate --config {params.config} --size {wildcards.size}"
        " --method {wildcards.method} --seed {wildcards.seed} --bench {wildcards.bench}"
        " --model {input.model} --data {input.data} --out-dir {params.out_dir}"
        " --threads {threads} 2>&1 | tee {log}"
