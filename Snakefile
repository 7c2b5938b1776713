# ict-rlvr: token-selective RLVR, from data to tables.
#   snakemake --cores 2                                    the embedded default (CPU, minutes)
#   snakemake --profile slurm --configfile config/paper.yaml   the paper reproduction
# The rules live in workflow/rules/, one file per stage; the science lives in stages/.

include: "workflow/rules/common.smk"

# names from the config, so that "size=tiny-s" never matches a longer path
wildcard_constraints:
    dataset="|".join(map(re.escape, CFG.datasets)),
    size="|".join(map(re.escape, CFG.models)),
    method="|".join(map(re.escape, ["base", *CFG.methods])),
    bench="|".join(map(re.escape, CFG.datasets)),
    seed=r"\d+",
    step=r"\d+",

include: "workflow/rules/prepare_data.smk"
include: "workflow/rules/base_model.smk"
include: "workflow/rules/rollout.smk"
include: "workflow/rules/token_stats.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/curves.smk"
include: "workflow/rules/overlap.smk"
include: "workflow/rules/tables.smk"


rule all:
    default_target: True
    input:
        final_targets(),
