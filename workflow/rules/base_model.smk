rule base_model:
    """Train a scratch model by SFT (or check a hub model's locked snapshot) and write its base.json."""
    input:
        unpack(base_model_inputs),
    output:
        ref=base_ref("{size}"),
        summary=f"{model_dir('{size}')}/summary.json",
    params:
        config=CONFIG_FILE,
        out_dir=lambda w: model_dir(w.size),
        data=lambda w, input: (
            f"--sft-data {input.sft} --eval-data {input.eval}" if "sft" in input.keys() else ""
        ),
        job_hash=job_hash("base_model"),
    log:
        f"{RESULTS}/logs/base_model/{{size}}.log",
    threads: job_threads("base_model")
    resources:
        **job_resources("base_model"),
    shell:
        "{resources.stage_python} -m stages.base_model --config {params.config} --size {wildcards.size}"
        " {params.data} --out-dir {params.out_dir} --threads {resources.cpus_per_task} 2>&1 | tee {log}"
