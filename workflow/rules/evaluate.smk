rule evaluate:
    """Sample n responses per benchmark problem from one model, grade them, report pass@k: one job
    per model (size x method x seed) for every benchmark, so the model is loaded once; each
    benchmark keeps its own output folder, and its samples are those a job of its own would draw."""
    input:
        model=eval_model,
        data=[data_path(bench) for bench in EXP.benchmarks],
    output:
        samples=expand(f"{eval_dir('{{size}}', '{{method}}', '{{seed}}', '{bench}')}/samples.parquet",
                       bench=EXP.benchmarks),
        metrics=expand(f"{eval_dir('{{size}}', '{{method}}', '{{seed}}', '{bench}')}/metrics.parquet",
                       bench=EXP.benchmarks),
    params:
        config=CONFIG_FILE,
        benches=" ".join(EXP.benchmarks),
        out_dirs=lambda w: " ".join(eval_dir(w.size, w.method, w.seed, b) for b in EXP.benchmarks),
        job_hash=job_hash("evaluate"),
    log:
        f"{RESULTS}/logs/evaluate/{{size}}/{{method}}/{{seed}}.log",
    threads: job_threads("evaluate")
    resources:
        **job_resources("evaluate"),
    shell:
        "{resources.stage_python} -m stages.evaluate --config {params.config} --size {wildcards.size}"
        " --method {wildcards.method} --seed {wildcards.seed} --model {input.model}"
        " --bench {params.benches} --data {input.data} --out-dir {params.out_dirs}"
        " --threads {resources.cpus_per_task} 2>&1 | tee {log}"
