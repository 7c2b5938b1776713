rule train:
    """Masked RLVR from one size's base model with one method and seed (DeepSpeed)."""
    input:
        model=base_ref("{size}"),
        prompts=[data_path(d) for d in EXP.train_datasets],
    output:
        ref=f"{train_dir('{size}', '{method}', '{seed}')}/model.json",
        metrics=f"{train_dir('{size}', '{method}', '{seed}')}/metrics.parquet",
    params:
        py=PY,
        config=CONFIG_FILE,
        gpus=lambda w: CFG.models[w.size].gpus.train,
        out_dir=lambda w: train_dir(w.size, w.method, w.seed),
        # resume checkpoints: not an output, so Snakemake never deletes them; the job removes
        # them once its outputs are written
        resume_dir=lambda w: f"{RESULTS}/resume/size={w.size}/method={w.method}/seed={w.seed}",
        # exactly what stages.train reads (stages.train.config_keys)
        config_hash=lambda w: config_hash(
            "train", f"methods/{w.method}", f"models/{w.size}", "seed", "token_stats/chunk_positions",
            "token_stats/chunk_vocab", "evaluate/grade_timeout_s", "experiment/train_datasets",
            *(f"datasets/{d}/max_response_tokens" for d in EXP.train_datasets),
        ),
    log:
        f"{RESULTS}/logs/train/{{size}}/{{method}}/{{seed}}.log",
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    shell:
        # stages.launch checks the GPUs and starts one worker per GPU (torchrun) when gpus > 1
        "{params.py} -m stages.launch --gpus {params.gpus} --"
        " {params.py} -m stages.train --config {params.config} --size {wildcards.size}"
        " --method {wildcards.method} --seed {wildcards.seed} --model {input.model}"
        " --prompts {input.prompts} --out-dir {params.out_dir} --resume-dir {params.resume_dir}"
        " --threads {threads} 2>&1 | tee {log}"
