# Shared by every rule: the validated config, path builders, per-job result hashes, and the
# guard of finished trainings.
import sys

import yaml
from snakemake_interface_executor_plugins.settings import ExecMode

from stages import reruns
from stages.core.common import hub, numerics
from stages.config import ConfigError, Gpus, source_of, validate
from stages.keys import checkpoint_steps, job_hash_of, save_signal_option
from stages.keys import curve_benchmarks as keys_curve_benchmarks
from stages.paths import RunPaths

# --configfile replaces the embedded default rather than being merged into it.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


CONFIG_FILES = [str(f) for f in workflow.overwrite_configfiles or ["config/config.yaml"]]
CONFIG_SOURCE = source_of(CONFIG_FILES)  # errors name every file: "config/paper.yaml + pilot.yaml"
# The main Snakemake process, not a job's own parse (a SLURM job re-parses this file on its node).
MAIN = workflow.exec_mode == ExecMode.DEFAULT
try:
    # the user's consent to replace finished trainings is given on the command line, not in
    # the config (stages.reruns)
    CONSENT = reruns.parse_consent(config.pop(reruns.CONSENT_KEY, None), "--config")
    CFG = validate(config, CONFIG_SOURCE)
    # The hub commits of the run (python -m stages.fetch wrote the lock before this parse): each
    # becomes models.<size>.hub.commit or datasets.<name>.source.commit, a result key, so moving
    # the lock (--refresh) reruns exactly the jobs that read what moved, and nothing else does.
    HUB_LOCK = hub.lock_path(CFG)
    CFG = hub.apply_lock(CFG, hub.read_lock(HUB_LOCK), HUB_LOCK)
except (ConfigError, hub.ArtifactError) as err:
    sys.exit(f"error: {err}")
# Hub repositories without a commit yet: a dry run lists the jobs that will read them; a real run
# stops before any job (onstart) and says to fetch.
UNLOCKED = hub.unlocked(CFG)
FETCH_HINT = (f"python -m stages.fetch --configfile {' '.join(CONFIG_FILES)}  (where the hub is reachable, "
              "before snakemake)")
if UNLOCKED and workflow.exec_mode == ExecMode.DEFAULT:
    print(f"note: {len({u.key for u in UNLOCKED})} hub repositories not fetched yet ({HUB_LOCK} lacks "
          f"{', '.join(sorted({u.key for u in UNLOCKED}))}): {FETCH_HINT}", file=sys.stderr)
# Every job, local or through sbatch, inherits the run's caches and the hub's offline switches
# (each stage sets them again itself: stages.cli); the parse below reads only local files.
os.environ.update(hub.job_environment(CFG))

# The memory plan (python -m stages.plan): every GPU job must fit models.<size>.gpu_memory_gb
# before anything is scheduled (no check where no size sets it).
from stages.plan import check_plan

try:
    _PLAN = check_plan(CFG)
except ConfigError as err:  # an unknown hub model names models.<size>.hub.model_id
    sys.exit(f"error: {err}")
if _PLAN:
    sys.exit("error: invalid config\n  " + "\n  ".join(f"{CONFIG_SOURCE}: {p}" for p in _PLAN))

# The cost plan (python -m stages.plan --cost): the attempts of the longest GPU training, each at
# most the partition's limit, become the training rule's `retries` (workflow/rules/train.smk);
# None leaves the profile's. A size whose dimensions are unknown gets no estimate.
from stages.core.plans.cost import site_max_minutes
from stages.cost import attempt_runtime, planned_requests, train_retries
from stages.cost import runtime_limit as cost_runtime_limit

_COST_LIMIT = cost_runtime_limit(CFG)[0]  # scontrol and sacctmgr, asked once
try:
    TRAIN_RETRIES = train_retries(CFG, _COST_LIMIT)
except ConfigError as err:
    print(f"warning: no cost plan, so the profile's retries apply to training: {err}", file=sys.stderr)
    TRAIN_RETRIES = None
# Walltimes from the plan (cost.walltime_margin): each GPU job's request, by (rule, size, method);
# a job the plan does not estimate asks for its configured resources.<rule>.runtime.
try:
    PLANNED_RUNTIMES = planned_requests(CFG, _COST_LIMIT)
except ConfigError as err:
    print(f"warning: no cost plan, so GPU jobs ask for their configured runtimes: {err}",
          file=sys.stderr)
    PLANNED_RUNTIMES = {}

# The code paths of CPU jobs (numerics.cpu_isa): into the environment every job inherits, locally
# and through sbatch, before any job's libraries start (stages.core.common.numerics).
for var in numerics.PINNED:
    os.environ.pop(var, None)
os.environ.update(numerics.settings(CFG.numerics.cpu_isa))

RESULTS = f"results/{CFG.run}"
PATHS = RunPaths(RESULTS)
# The interpreter of the stages: $ICT_RLVR_STAGE_PYTHON (a GPU cluster's GPU environment,
# scripts/setup.sh --gpu), else the one running Snakemake, so an un-activated venv still works.
# A resource, not a param: where a job runs is no reason to rerun it (docs/results.md).
STAGE_PYTHON = os.environ.get("ICT_RLVR_STAGE_PYTHON") or sys.executable
EXP = CFG.experiment
SCRATCH_SIZES = [s for s in EXP.sizes if CFG.models[s].source == "scratch"]

# The validated config, defaults filled in, as the one file every job reads. Its path never
# changes, so it is no reason to rerun a job; what is (the parts of the config a job reads) is
# each rule's `job_hash` parameter. Written by the main process of a real run only (onstart
# below), so that a dry run, or a job's own parse, never changes it under a running job.
CONFIG_FILE = PATHS.resolved_config()


def write_resolved_config():
    """Write CONFIG_FILE where its content changed (atomically)."""
    text = yaml.safe_dump(CFG.model_dump(mode="json"), sort_keys=False)
    if not os.path.exists(CONFIG_FILE) or open(CONFIG_FILE).read() != text:
        os.makedirs(RESULTS, exist_ok=True)
        tmp = f"{CONFIG_FILE}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, CONFIG_FILE)


# The finished trainings the config now gives another result (stages.reruns): listed by every
# run, dry or real; a real run stops before replacing one unless the user consented.
REPLACED = reruns.replaced_trainings(CFG, PATHS) if MAIN else {}
if REPLACED:
    reruns.announce(REPLACED, PATHS)


def check_hub_snapshots():
    """Before any job of a real run, in Snakemake's own process: every hub source locked, and
    every locked file in the snapshot store at its size (the fetch hashed them all; stages.fetch
    --verify hashes them again)."""
    if UNLOCKED:
        sys.exit(f"error: not fetched: {', '.join(f'{u.key} ({u.where})' for u in UNLOCKED)}; "
                 f"run {FETCH_HINT}")
    lock = hub.read_lock(HUB_LOCK)
    try:
        for key in {u.key for u in hub.all_uses(CFG)}:
            entry = lock["repositories"][key]
            hub.check_snapshot(entry, hub.snapshot_dir(hub.store(CFG), entry["repo_type"],
                                                       entry["repo_id"], entry["commit"]), HUB_LOCK)
    except hub.ArtifactError as err:
        fetched_into = lock.get("store")
        where = ("" if not fetched_into or fetched_into == str(hub.store(CFG).resolve()) else
                 f" (the fetch wrote the snapshots into {fetched_into}; this run reads "
                 f"{hub.store(CFG)}: set hub.cache_dir, or $ICT_RLVR_CACHE_DIR, to one of them)")
        sys.exit(f"error: {err}{where}")


onstart:
    # after the DAG is built, before any job starts: a real run (or --touch) only
    reruns.ANNOUNCE_AT_EXIT.clear()
    check_hub_snapshots()
    if workflow.touch:
        reruns.guard_touch(workflow, CFG)
    else:
        reruns.guard_run(workflow, PATHS, REPLACED, CONSENT)
    write_resolved_config()


# ----- paths (hive-style, so each folder reads as one table; stages.paths) ---------------------
data_path = PATHS.data
model_dir = PATHS.model_dir
base_ref = PATHS.base_ref
rollout_path = PATHS.rollouts
token_stats_dir = PATHS.token_stats_dir
train_dir = PATHS.train_dir
eval_dir = PATHS.eval_dir
eval_steps_dir = PATHS.eval_steps_dir
overlap_path = PATHS.overlap


# the curves over steps: some method saves checkpoints (train.save_every, or its own train keys)
CURVES = any(CFG.train_for(m, s).save_every for m in EXP.methods for s in EXP.sizes)


def tables_dir():
    return f"{RESULTS}/tables"


def figures_dir():
    return f"{RESULTS}/figures"


def final_targets():
    """The targets of the default run: every table and figure, and so every job of the grid
    before them (all of them, so that a deleted or newly added table brings the tables job back)."""
    from stages.tables import output_names

    names = output_names(CFG)
    return [f"{tables_dir()}/{n}" for n in names["tables"]] + [f"{figures_dir()}/{n}" for n in names["figures"]]


# A job reruns when the result keys of the parts of the config it reads, or its stage's version,
# change, and only then (stages.keys: operational keys such as memory shares, checkpoint cadence,
# labels and a job's GPUs are left out). Every rule's one parameter that is no path.
def job_hash(rule):
    """A rule's `job_hash` parameter (stages.keys.job_hash_of)."""
    return lambda wildcards: job_hash_of(CFG, rule, dict(wildcards.items()))


# ----- what each job asks the scheduler for ---------------------------------------------------
# Resource names are those of snakemake-executor-plugin-slurm; the local executor ignores all but
# the threads. Site settings come from the environment (the variables sbatch itself reads, and one
# for the GPU partition), so neither the config nor the profile names a site.
GPU_RULES = set(Gpus.model_fields)
SITE_ENV = {"slurm_account": "SBATCH_ACCOUNT", "qos": "SBATCH_QOS"}
# A GPU type and a node feature for the jobs with GPUs (the site's names: `sinfo -o "%G %f"`)
GPU_MODEL = os.environ.get("ICT_GPU_MODEL") or None
GPU_CONSTRAINT = os.environ.get("ICT_GPU_CONSTRAINT") or None


def job_request(rule, wildcards):
    """The config's CPUs, memory and walltime for one job of `rule` (per size where it has one)."""
    return CFG.resources.of(rule, getattr(wildcards, "size", None))


def job_gpus(rule, wildcards):
    """GPUs of one job: models.<size>.gpus.<rule>; 0 for rules that never use a GPU."""
    return getattr(CFG.models[wildcards.size].gpus, rule) if rule in GPU_RULES else 0


def job_partition(rule, wildcards):
    """$ICT_GPU_PARTITION for jobs with GPUs (when set), else $SBATCH_PARTITION; None: site default."""
    gpu_partition = os.environ.get("ICT_GPU_PARTITION")
    if gpu_partition and job_gpus(rule, wildcards):
        return gpu_partition
    return os.environ.get("SBATCH_PARTITION") or None


def job_runtime_limit(rule, wildcards):
    """The longest walltime a job of `rule` may ask for, minutes: resources.max_runtime, else the
    lower of the MaxTime of the partition it goes to (`scontrol show partition`) and the MaxWall
    of the QOS in $SBATCH_QOS (`sacctmgr show qos`, which needs slurmdbd), each asked once; None
    where both are unlimited or SLURM is not installed. A partition set with --set-resources is
    not seen here."""
    if CFG.resources.max_runtime is not None:
        return CFG.resources.max_runtime
    partition = job_partition(rule, wildcards)
    if partition not in _PARTITION_LIMITS:
        _PARTITION_LIMITS[partition] = site_max_minutes(partition, os.environ.get("SBATCH_QOS") or None)[0]
    return _PARTITION_LIMITS[partition]


_PARTITION_LIMITS = {}


def job_runtime(rule, wildcards, attempt, planned=None):
    """Walltime of one attempt, minutes (stages.cost.attempt_runtime): a training's request on
    every attempt (it resumes, and has as many attempts as the cost plan counts: TRAIN_RETRIES),
    another job's request x attempt; capped at the partition's limit. The request is the plan's
    (PLANNED_RUNTIMES, under the rule's name in the plan: `planned`) where it estimates the job,
    else resources.<rule>.runtime."""
    key = (planned or rule, wildcards.get("size"), wildcards.get("method"))
    request = PLANNED_RUNTIMES.get(key) or job_request(rule, wildcards).runtime
    return attempt_runtime(rule, request, attempt, job_runtime_limit(rule, wildcards))


def job_threads(rule):
    """`threads:` of a rule: its CPUs from the config, which Snakemake caps at --cores locally to
    schedule it. A stage's own threads are resources.cpus_per_task, the config's uncapped: --cores
    says how many jobs run at once, never a job's numbers."""
    return lambda wildcards: job_request(rule, wildcards).cpus


def job_nodes(rule, wildcards):
    """Nodes of one job: models.<size>.train_nodes for training; every other job runs on one."""
    return CFG.models[wildcards.size].train_nodes if rule == "train" else 1


def job_gpus_per_node(rule, wildcards):
    """GPUs of one job on each of its nodes (the config checks that they add up)."""
    return job_gpus(rule, wildcards) // job_nodes(rule, wildcards)


def job_resources(rule, planned=None):
    """`resources:` of a rule, used as `resources: **job_resources("train")`; `planned` names the
    rule in the cost plan where it shares another rule's request (evaluate_checkpoint, overlap).

    One node: one task, and `gpu` (sbatch --gpus, the job's total); the job starts its workers
    itself (stages.launch, torchrun). Several nodes (a size's train_nodes > 1), in the plugin's
    terms for a job that starts its own tasks: `mpi` (the command then runs once in the batch
    script, on the first node, and stages.launch runs `srun`), `nodes`, `tasks` = nodes (the
    plugin refuses tasks_per_node = 1; N tasks on N nodes is one per node), and the GPUs of each
    node as `gres` (--gres=gpu:<per node>): `gpu` is a job total that SLURM may split unevenly over
    the nodes, and the plugin refuses both. `tasks_per_gpu: 0` keeps the plugin from turning
    `tasks` into --ntasks-per-gpu. `cpus_per_task` and `mem_mb` are then per node: the CPUs and
    memory of all of a node's workers. Resources that are None are left out of the job."""
    def multi(wildcards):
        return job_nodes(rule, wildcards) > 1

    def gpus_per_node(wildcards):
        return job_gpus_per_node(rule, wildcards)

    resources = {
        # the interpreter of the stage (STAGE_PYTHON): how a job runs, not what it computes
        "stage_python": STAGE_PYTHON,
        "cpus_per_task": job_threads(rule),
        "mem_mb": lambda wildcards: job_request(rule, wildcards).mem_mb,
        "runtime": lambda wildcards, attempt: job_runtime(rule, wildcards, attempt, planned),
        "gpu": lambda wildcards: None if multi(wildcards) else job_gpus(rule, wildcards),
        # a GPU type: --gpus=<model>:<n> for a job on one node (the plugin's gpu_model), and in
        # the gres of a job on several (gpu:<model>:<per node>), which must not ask twice
        "gpu_model": lambda wildcards: GPU_MODEL
        if GPU_MODEL and not multi(wildcards) and job_gpus(rule, wildcards) else None,
        "gres": lambda wildcards: ":".join(["gpu", *([GPU_MODEL] if GPU_MODEL else []),
                                            str(gpus_per_node(wildcards))])
        if multi(wildcards) and gpus_per_node(wildcards) else None,
        "constraint": lambda wildcards: GPU_CONSTRAINT
        if GPU_CONSTRAINT and job_gpus(rule, wildcards) else None,
        "nodes": lambda wildcards: job_nodes(rule, wildcards),
        "mpi": lambda wildcards: "srun" if multi(wildcards) else None,
        "tasks": lambda wildcards: job_nodes(rule, wildcards) if multi(wildcards) else None,
        "tasks_per_gpu": lambda wildcards: 0 if multi(wildcards) and gpus_per_node(wildcards) else None,
        "slurm_partition": lambda wildcards: job_partition(rule, wildcards),
        # training: SIGURG train.save_before_limit_minutes before the time limit, on which the
        # trainer saves a resume state and exits to be resubmitted (stages.core.training.resume); a
        # --set-resources train:slurm_extra=... replaces it
        "slurm_extra": lambda wildcards: save_signal_option(
            CFG.train_for(wildcards.method, wildcards.size)) if rule == "train" else None,
    }
    resources.update({key: os.environ[var] for key, var in SITE_ENV.items() if os.environ.get(var)})
    return resources


# ----- inputs that depend on the config ------------------------------------------------------
def base_model_inputs(wildcards):
    """Scratch models train on the SFT data and are scored on training prompts; hub models need nothing."""
    if CFG.models[wildcards.size].source != "scratch":
        return {}
    return {"sft": data_path(EXP.sft_dataset), "eval": data_path(EXP.train_datasets[0])}


def eval_model(wildcards):
    """The model an evaluation samples from: the base model, or one size x method x seed's training."""
    if wildcards.method == "base":
        return base_ref(wildcards.size)
    return f"{train_dir(wildcards.size, wildcards.method, wildcards.seed)}/model.json"


def eval_dirs():
    """Every evaluation of the grid: size x (base model and each method) x seed x benchmark."""
    return [
        eval_dir(size, method, seed, bench)
        for size in EXP.sizes
        for method in ["base", *EXP.methods]
        for seed in EXP.seeds
        for bench in EXP.benchmarks
    ]


def train_dirs():
    """Every training of the grid: size x method x seed."""
    return [train_dir(size, method, seed) for size in EXP.sizes for method in EXP.methods for seed in EXP.seeds]


def curve_benchmarks():
    """Benchmarks of the checkpoints' evaluations (evaluate.curve_benchmarks, else all)."""
    return keys_curve_benchmarks(CFG)


def eval_step_dirs():
    """Every checkpoint evaluation: size x method x seed x saved step x curve benchmark."""
    return [
        eval_steps_dir(size, method, seed, step, bench)
        for size in EXP.sizes
        for method in EXP.methods
        for seed in EXP.seeds
        for step in checkpoint_steps(CFG.train_for(method, size))
        for bench in curve_benchmarks()
    ]


def overlap_paths():
    """One overlap file per trained model, when token_stats.overlap_top is set."""
    if CFG.token_stats.overlap_top is None:
        return []
    return [overlap_path(size, method, seed)
            for size in EXP.sizes for method in EXP.methods for seed in EXP.seeds]


# ----- the Snakemake report (snakemake --report report.html) ----------------------------------
# Tables and figures shown in the report, with their captions (workflow/report/*.rst); the
# Markdown and LaTeX copies of the tables and the long CSVs are outputs, not report items.
REPORT_CSV = {"main_pass": "main_csv", "main_avg": "main_csv", "main_total": "main_total",
              "main_8020": "main_8020", "token_stats": "token_stats", "overlap": "overlap",
              "ict_readings": "ict_readings", "ablation": "ablation", "graders": "graders",
              "curves": "curves_csv", "sources": "sources"}
REPORT_FIGURES = {"training": "training curves", "curves": "curves over steps",
                  "pass_at_k": "pass@k against k", "entropy_hist": "token entropy"}


def report_item(folder, name):
    """`folder/name`, flagged for the report when it is one of its items (captions relative to rules/)."""
    path = f"{folder}/{name}"
    stem = name.rsplit(".", 1)[0]
    if name == "tables.html":
        return report(path, caption="../report/tables.rst", category="Tables", subcategory="all tables")
    caption = next((c for prefix, c in REPORT_CSV.items() if stem.startswith(prefix)), None)
    if name.endswith(".csv") and caption:
        return report(path, caption=f"../report/{caption}.rst", category="Tables", subcategory="CSV")
    kind = next((k for k in REPORT_FIGURES if stem.startswith(k)), None)
    if name.endswith(".png") and kind:
        return report(
            path,
            caption=f"../report/{kind}.rst",
            category="Figures",
            subcategory=REPORT_FIGURES[kind],
            labels={"figure": REPORT_FIGURES[kind], "size": stem[len(kind) + 1 :] or "all sizes"},
        )
    return path
