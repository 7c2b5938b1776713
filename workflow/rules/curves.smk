from stages.keys import checkpoint_name


rule evaluate_checkpoint:
    """Evaluate the checkpoint one training saved after `step` rollout steps (the curves over
    steps), as rule evaluate does a final model: one job for all its benchmarks."""
    input:
        checkpoints=f"{train_dir('{size}', '{method}', '{seed}')}/checkpoints",
        data=[data_path(bench) for bench in curve_benchmarks()],
    output:
        samples=expand(f"{eval_steps_dir('{{size}}', '{{method}}', '{{seed}}', '{{step}}', '{bench}')}/samples.parquet",
                       bench=curve_benchmarks()),
        metrics=expand(f"{eval_steps_dir('{{size}}', '{{method}}', '{{seed}}', '{{step}}', '{bench}')}/metrics.parquet",
                       bench=curve_benchmarks()),
    params:
        config=CONFIG_FILE,
        model=lambda w: f"{train_dir(w.size, w.method, w.seed)}/{checkpoint_name(int(w.step))}/model.json",
        benches=" ".join(curve_benchmarks()),
        out_dirs=lambda w: " ".join(eval_steps_dir(w.size, w.method, w.seed, w.step, b)
                                    for b in curve_benchmarks()),
        job_hash=job_hash("evaluate_checkpoint"),
    log:
        f"{RESULTS}/logs/evaluate_checkpoint/{{size}}/{{method}}/{{seed}}/{{step}}.log",
    threads: job_threads("evaluate")
    resources:
        **job_resources("evaluate", planned="evaluate_checkpoint"),
    shell:
        "{resources.stage_python} -m stages.evaluate --config {params.config} --size {wildcards.size}"
        " --method {wildcards.method} --seed {wildcards.seed} --model {params.model}"
        " --bench {params.benches} --data {input.data} --out-dir {params.out_dirs}"
        " --threads {resources.cpus_per_task} 2>&1 | tee {log}"
