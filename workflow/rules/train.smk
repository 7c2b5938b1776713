rule train:
    """Masked RLVR from one size's base model with one method and seed (DeepSpeed)."""
    input:
        model=base_ref("{size}"),
        prompts=[data_path(d) for d in EXP.train_datasets],
    output:
        ref=f"{train_dir('{size}', '{method}', '{seed}')}/model.json",
        metrics=f"{train_dir('{size}', '{method}', '{seed}')}/metrics.parquet",
        # the checkpoints saved every train.save_every steps, for the curves over steps
        **({"checkpoints": directory(f"{train_dir('{size}', '{method}', '{seed}')}/checkpoints")}
           if CURVES else {}),
    params:
        config=CONFIG_FILE,
        out_dir=lambda w: train_dir(w.size, w.method, w.seed),
        # resume checkpoints: not an output, so Snakemake never deletes them; the job removes
        # them once its outputs are written
        resume_dir=lambda w: PATHS.resume_dir(w.size, w.method, w.seed),
        # the result keys of what stages.train reads (stages.keys.train_result_config): an
        # operational edit (memory share, checkpoint cadence, label, GPUs) reruns nothing
        job_hash=job_hash("train"),
    log:
        f"{RESULTS}/logs/train/{{size}}/{{method}}/{{seed}}.log",
    threads: job_threads("train")
    # a long training continues across resubmissions, each from its last checkpoint: as many as
    # the cost plan counts (common.smk's TRAIN_RETRIES; None: the profile's `retries`)
    retries: TRAIN_RETRIES
    resources:
        **job_resources("train"),
        # The launch layout is a resource, not a param: Snakemake reruns a job whose params
        # changed, and moving a training to other GPUs, processes or CPUs changes how it runs,
        # not its results (stages.keys; a resume state moves through a universal checkpoint).
        # GPUs of the whole job; one worker per GPU, or the config's CPU processes
        # (train_processes), on each node
        launch_gpus=lambda w: CFG.models[w.size].gpus.train,
        workers_per_node=lambda w: CFG.models[w.size].train_processes_per_node(),
        # torch threads of each worker: the node's CPUs (resources.train.cpus) shared by its
        # workers; from the config, never from --cores, which only says how many jobs run at once
        worker_threads=lambda w: max(1, job_request("train", w).cpus
                                     // CFG.models[w.size].train_processes_per_node()),
    shell:
        # stages.launch checks each node's GPUs and starts the workers with torchrun: on this node,
        # or (train_nodes > 1, in SLURM) one torchrun agent per node through srun
        "{resources.stage_python} -m stages.launch --gpus {resources.launch_gpus} --nodes {resources.nodes}"
        " --procs-per-node {resources.workers_per_node} --"
        " {resources.stage_python} -m stages.train --config {params.config} --size {wildcards.size}"
        " --method {wildcards.method} --seed {wildcards.seed} --model {input.model}"
        " --prompts {input.prompts} --out-dir {params.out_dir} --resume-dir {params.resume_dir}"
        " --threads {resources.worker_threads} 2>&1 | tee {log}"
