# Shared by every rule: the validated config, path builders and per-job parameter hashes.
import sys

import yaml

from stages.config import ConfigError, digest, validate

# --configfile replaces the embedded default rather than being merged into it.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


CONFIG_SOURCE = ", ".join(map(str, workflow.overwrite_configfiles or ["config/config.yaml"]))
try:
    CFG = validate(config, CONFIG_SOURCE)
except ConfigError as err:
    sys.exit(f"error: {err}")

RESULTS = f"results/{CFG.run}"
# The interpreter running Snakemake runs the stages too, so an un-activated venv still works.
PY = sys.executable
EXP = CFG.experiment
SCRATCH_SIZES = [s for s in EXP.sizes if CFG.models[s].source == "scratch"]


def resolved_config():
    """The validated config (defaults filled in) as one file the stages read; named by its hash."""
    resolved = CFG.model_dump(mode="json")
    path = f"{RESULTS}/config/{digest(resolved)}.yaml"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            yaml.safe_dump(resolved, fh, sort_keys=False)
        os.replace(tmp, path)
    return path


CONFIG_FILE = resolved_config()


# ----- paths (hive-style, so each folder reads as one table) ---------------------------------
def data_path(dataset):
    return f"{RESULTS}/data/dataset={dataset}/problems.parquet"


def model_dir(size):
    return f"{RESULTS}/models/size={size}"


def base_ref(size):
    return f"{model_dir(size)}/base.json"


def rollout_path(size):
    return f"{RESULTS}/rollouts/size={size}/rollouts.parquet"


def token_stats_dir(size):
    return f"{RESULTS}/token_stats/size={size}"


def train_dir(size, method, seed):
    """Training of one size x method x seed: model.json (reference to final/), final/, metrics.parquet."""
    return f"{RESULTS}/train/size={size}/method={method}/seed={seed}"


def eval_dir(size, method, seed, bench):
    """Evaluation of one model on one benchmark; method "base" is the untrained base model."""
    return f"{RESULTS}/eval/size={size}/method={method}/seed={seed}/bench={bench}"


def tables_dir():
    return f"{RESULTS}/tables"


def figures_dir():
    return f"{RESULTS}/figures"


def final_targets():
    """The targets of the default run: the last artifacts of the stages that exist."""
    return (
        [data_path(d) for d in CFG.used_datasets()]
        + [base_ref(s) for s in EXP.sizes]
        + [f"{token_stats_dir(s)}/summary.parquet" for s in EXP.sizes]
    )


# A job reruns when the parts of the config it reads change, and only then.
def config_hash(*keys):
    return CFG.section_hash(*keys)


# ----- inputs that depend on the config ------------------------------------------------------
def base_model_inputs(wildcards):
    """Scratch models train on the SFT data and are scored on training prompts; hub models need nothing."""
    if CFG.models[wildcards.size].source != "scratch":
        return {}
    return {"sft": data_path(EXP.sft_dataset), "eval": data_path(EXP.train_dataset)}
