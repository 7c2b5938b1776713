"""The hub repositories of a run: which ones it needs, the lock that fixes their commits, the one
snapshot store that runs share, and the offline environment of every job.

A run that names hub models or data sets is fetched once, where the hub is reachable (the login
node, before `snakemake`): `python -m stages.fetch` resolves each configured revision to its
commit, downloads the files a job reads into the store (the hub cache's own layout), hashes them,
and writes `results/<run>/hub.lock.yaml`. The workflow reads the lock when it parses: each commit
becomes a result key (models.<size>.hub.commit, datasets.<name>.source.commit), so moving the lock
(`python -m stages.fetch --refresh`) reruns exactly the jobs that depend on what moved. Every job
then runs with the hub's offline switches set and loads from the snapshot folder, after checking
each file's size against the lock.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .io import ArtifactError, sha256_file

LOCK_VERSION = 1
LOCK_NAME = "hub.lock.yaml"
CACHE_ENV = "ICT_RLVR_CACHE_DIR"
"""The environment variable that sets the cache root where the config's hub.cache_dir does not."""

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""The hub's own offline switches: every job but the fetch runs with them."""

CACHE_SUBDIRS = {
    "HF_HUB_CACHE": "hub",  # the snapshot store: the fetch writes it, every job reads it
    "HF_DATASETS_CACHE": "datasets",  # datasets' Arrow caches of the fetched files
    "VLLM_CACHE_ROOT": "vllm",  # vLLM's compile and kernel caches
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",  # DeepSpeed's JIT-built ops
    "CUDA_CACHE_PATH": "nv",  # the driver's PTX JIT cache
    "XDG_CACHE_HOME": "xdg",  # what else would land in ~/.cache (flashinfer, pip is not a job's)
}
"""Where each tool's cache goes under the cache root (hub.cache_dir)."""

MODEL_FILES = (".json", ".safetensors", ".model", ".tiktoken", ".txt", ".jinja")
"""The top-level files of a model repository a job reads: configs, weights, tokenizer files."""
DATA_FILES = (".parquet", ".jsonl", ".json", ".csv", ".arrow", ".txt")
"""Data files of a data set repository (its README.md's `configs:` chooses among them)."""


class FetchError(ArtifactError):
    """A repository that cannot be fetched or read as configured: the message names it, the
    config key and the fix."""


@dataclass(frozen=True)
class Repo:
    """One hub repository a run needs: `where` is the config key that names it."""

    repo_type: str  # "model" or "dataset"
    repo_id: str
    revision: str
    path: tuple[str, ...]  # the config's section that names it (names may hold dots)
    config: str | None = None  # a data set's configuration and split (which files to fetch)
    split: str | None = None

    @property
    def key(self) -> str:
        return f"{self.repo_type}:{self.repo_id}"

    @property
    def where(self) -> str:
        """The dotted config key of its section (models.qwen2.5-7b.hub)."""
        return ".".join(self.path)


def cache_root(cfg) -> Path | None:
    """The cache root: hub.cache_dir, else $ICT_RLVR_CACHE_DIR, else None (each tool's default)."""
    root = cfg.hub.cache_dir or os.environ.get(CACHE_ENV)
    return Path(root).expanduser().absolute() if root else None


def cache_environment(cfg) -> dict[str, str]:
    """The cache variables of every job and of the fetch (empty where no cache root is set)."""
    root = cache_root(cfg)
    return {} if root is None else {var: str(root / sub) for var, sub in CACHE_SUBDIRS.items()}


def job_environment(cfg) -> dict[str, str]:
    """What every job's environment gets: the caches and the offline switches."""
    return {**cache_environment(cfg), **OFFLINE}


def store(cfg=None) -> Path:
    """The snapshot store: the hub cache (HF_HUB_CACHE of the cache root, else huggingface_hub's)."""
    env = cache_environment(cfg) if cfg is not None else {}
    if "HF_HUB_CACHE" in env:
        return Path(env["HF_HUB_CACHE"])
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def snapshot_dir(store_dir: Path, repo_type: str, repo_id: str, commit: str) -> Path:
    """The snapshot folder of one commit in the hub cache's layout."""
    return Path(store_dir) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots" / commit


def is_local(name: str) -> bool:
    """A model id or data set that names a local folder: read as it is, never fetched."""
    return Path(name).expanduser().is_dir()


def all_uses(cfg) -> list[Repo]:
    """Every configured use of a hub repository, in a stable order: the hub models of the
    experiment's sizes, then the hub data sets it uses (local folders are not fetched)."""
    out = []
    for size in cfg.experiment.sizes:
        m = cfg.models[size]
        if m.source == "hub" and not is_local(m.hub.model_id):
            out.append(Repo("model", m.hub.model_id, m.hub.revision, ("models", size, "hub")))
    for name in cfg.used_datasets():
        src = cfg.datasets[name].source
        if src.kind == "hub" and not is_local(src.dataset):
            out.append(Repo("dataset", src.dataset, src.revision or "main",
                            ("datasets", name, "source"), src.config, src.split))
    return out


def lock_path(cfg) -> Path:
    return Path(f"results/{cfg.run}") / LOCK_NAME


def read_lock(path: Path) -> dict:
    """The lock at `path` ({} where there is none); a malformed one is an error naming it."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        lock = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ArtifactError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(lock, dict) or lock.get("version") != LOCK_VERSION \
            or not isinstance(lock.get("repositories"), dict):
        raise ArtifactError(f"{path}: not a hub lock of version {LOCK_VERSION} (key 'version' and "
                            "a mapping 'repositories'); move it aside and fetch again")
    for key, entry in lock["repositories"].items():
        for field in ("repo_id", "repo_type", "revision", "commit", "files"):
            if field not in entry:
                raise ArtifactError(f"{path}: repositories.{key}: key {field!r} missing")
    return lock


def write_lock(path: Path, lock: dict) -> None:
    from .io import atomic_path

    header = ("# The hub commits of this run, and every fetched file's size and sha256.\n"
              "# Written by python -m stages.fetch; moved only by its --refresh.\n")
    with atomic_path(path) as tmp:
        tmp.write_text(header + yaml.safe_dump(lock, sort_keys=False))


def apply_lock(cfg, lock: dict, lock_file: Path):
    """`cfg` with each hub model's and data set's commit from the lock (a result key). A lock that
    disagrees with the config (another revision, a commit the config sets otherwise) is an error
    naming the key and the command that moves the lock; a use the lock does not list (a new
    repository, or a new split of a locked data set) stays without a commit: the run then needs a
    fetch, which adds its files at the locked commit."""
    entries = lock.get("repositories", {})
    data = cfg.model_dump(mode="json")
    for use in all_uses(cfg):
        entry = entries.get(use.key)
        if entry is None or use.where not in entry.get("uses", [use.where]):
            continue  # not fetched, or not for this use (a new split): the run needs a fetch
        if entry["revision"] != use.revision:
            raise ArtifactError(
                f"{lock_file}: {use.key} is locked at revision {entry['revision']!r}, "
                f"{use.where}.revision asks for {use.revision!r}: move the lock on purpose with "
                f"python -m stages.fetch --configfile CONFIG --refresh {use.repo_id}")
        section = _at(data, use.path)
        if section.get("commit") not in (None, entry["commit"]):
            raise ArtifactError(
                f"{use.where}.commit: {section['commit']!r}, but {lock_file} holds "
                f"{entry['commit']!r} for {use.key}; leave the key unset (the lock sets it)")
        section["commit"] = entry["commit"]
    return type(cfg).model_validate(data)


def _at(tree: dict, path: tuple[str, ...]) -> dict:
    for part in path:
        tree = tree[part]
    return tree


def unlocked(cfg) -> list[Repo]:
    """The configured hub repositories that have no commit yet (no lock, or not in it)."""
    data = cfg.model_dump(mode="json")
    return [use for use in all_uses(cfg) if not _at(data, use.path).get("commit")]


def check_snapshot(entry: dict, folder: Path, lock_file: Path | str, *, full: bool = False) -> None:
    """Every locked file of one repository present in `folder` at its locked size (and sha256,
    with full=True); else an error naming the repository, the file and the fetch command."""
    name = f"{entry['repo_type']} {entry['repo_id']}@{entry['commit'][:12]}"
    fix = (f"fetch it again where the hub is reachable: python -m stages.fetch --configfile "
           f"CONFIG (the lock: {lock_file})")
    for rel, facts in entry["files"].items():
        path = folder / rel
        if not path.is_file():
            raise ArtifactError(f"{name}: file {rel} missing from the snapshot store ({path}); {fix}")
        size = path.stat().st_size
        if size != facts["size"]:
            raise ArtifactError(f"{name}: file {rel} has {size} bytes, the lock {facts['size']} "
                                f"({path.resolve()}): corrupted or changed on disk; {fix}")
        if full and sha256_file(path) != facts["sha256"]:
            raise ArtifactError(f"{name}: file {rel} has another sha256 than the lock "
                                f"({path.resolve()}): corrupted or changed on disk; {fix}")


def data_files_of(folder: Path, use: Repo) -> dict[str, list[str]] | None:
    """{split: the local paths of its data files} of a fetched data set's use, from its card's
    `configs:` (so that datasets reads exactly these files, whatever else the card lists); None
    where the card has none (datasets then infers the splits from the folder's file names)."""
    card = folder / "README.md"
    readme = card.read_text(errors="replace") if card.is_file() else None
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    files = use_files(names, readme, use)
    return None if files is None else {use.split: [str(folder / f) for f in files]}


BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
            ".arrow": "arrow", ".txt": "text"}
"""datasets' packaged builder of each data file type."""


def locked_folder(cfg, repo_type: str, repo_id: str, commit: str | None, where: str = "") -> Path:
    """The checked snapshot folder of a locked repository, for a job (sizes against the lock);
    `where` names the config key of a repository the lock lacks (commit None)."""
    return locked(cfg, repo_type, repo_id, commit, where)[0]


def locked(cfg, repo_type: str, repo_id: str, commit: str | None,
           where: str = "") -> tuple[Path, dict]:
    """(the checked snapshot folder, the lock's entry) of a locked repository (locked_folder)."""
    path = lock_path(cfg)
    if not commit:
        raise ConfigError(f"{where}: {repo_id} has no commit in {path}: fetch it where the hub is "
                          "reachable (python -m stages.fetch --configfile CONFIG)")
    lock = read_lock(path)
    entry = lock.get("repositories", {}).get(f"{repo_type}:{repo_id}")
    if entry is None or entry["commit"] != commit:
        raise ArtifactError(f"{path}: no entry for {repo_type} {repo_id} at commit {commit[:12]}; "
                            f"fetch where the hub is reachable: python -m stages.fetch --configfile CONFIG")
    folder = snapshot_dir(store(cfg), repo_type, repo_id, commit)
    check_snapshot(entry, folder, path)
    return folder, entry


def sources(cfg) -> dict[str, Any]:
    """The hub commits a run's results come from, for provenance: {type:id: {revision, commit}}."""
    data = cfg.model_dump(mode="json")
    return {use.key: {"revision": use.revision, "commit": _at(data, use.path).get("commit")}
            for use in all_uses(cfg)}


# ----- a data set card's `configs:`: which files a config and split read ------------------------
def readme_configs(text: str) -> list[dict]:
    """The `configs:` list of a data set card's YAML front matter ([] where it has none)."""
    if not text.startswith("---"):
        return []
    end = text.find("\n---", 3)
    if end < 0:
        return []
    try:
        meta = yaml.safe_load(text[3:end]) or {}
    except yaml.YAMLError:
        return []
    configs = meta.get("configs") if isinstance(meta, dict) else None
    return configs if isinstance(configs, list) else []


def _patterns(config: dict, split: str | None) -> list[str]:
    """The file patterns of one card config for `split` (None: every split), as datasets reads
    them: `data_files` as a list of {split, path}, or as a plain pattern or list of them (split
    "train" alone); else every file under its `data_dir`."""
    data_files = config.get("data_files")
    if data_files is None and config.get("data_dir"):
        return [config["data_dir"].strip("/") + "/*"]
    if isinstance(data_files, str) or (isinstance(data_files, list)
                                       and all(isinstance(i, str) for i in data_files)):
        plain = [data_files] if isinstance(data_files, str) else list(data_files)
        return plain if split in (None, "train") else []
    out = []
    for item in data_files or []:
        if isinstance(item, dict) and (split is None or item.get("split") == split):
            path = item.get("path")
            out += [path] if isinstance(path, str) else list(path or [])
    return out


def config_of(configs: list[dict], use: Repo) -> dict:
    """The card config a use reads (its `config`, else the card's default one, else the first),
    or a FetchError naming the key."""
    by_name = {c.get("config_name", "default"): c for c in configs if isinstance(c, dict)}
    name = use.config or next((n for n, c in by_name.items() if c.get("default")),
                              "default" if "default" in by_name else next(iter(by_name)))
    if name not in by_name:
        raise FetchError(f"dataset {use.repo_id}: no configuration {name!r} in its README.md "
                         f"({use.where}.config; it has {sorted(by_name)})")
    return by_name[name]


def use_files(names: list[str], readme: str | None, use: Repo) -> list[str] | None:
    """The data files of one use (its config and split) among `names`; None where the card has no
    `configs:` (datasets then infers the splits from the file names, and every data file is
    fetched). A use that matches no file is a FetchError naming the key."""
    configs = readme_configs(readme or "")
    if not configs:
        return None
    config = config_of(configs, use)
    pats = _patterns(config, use.split)
    hits = sorted({n for n in names for p in pats if fnmatch.fnmatch(n, p)
                   and n.endswith(DATA_FILES)})
    if not hits:
        raise FetchError(f"dataset {use.repo_id}: no data file of configuration "
                         f"{config.get('config_name', 'default')!r}, split {use.split!r} "
                         f"({use.where}.split; patterns {pats})")
    return hits
