"""Fetch a run's hub models and data sets once, where the hub is reachable, and lock their commits.

    python -m stages.fetch --configfile config/paper.yaml              fetch, or verify the lock
    python -m stages.fetch --configfile config/paper.yaml --refresh ID  move ID's entry on purpose
    python -m stages.fetch --configfile config/paper.yaml --refresh     move every entry
    python -m stages.fetch --configfile config/paper.yaml --verify      re-hash the store, offline

Run it on the login node (it needs the hub; nothing else of the run does), before `snakemake`.
For each hub repository the run reads (stages.core.common.hub.all_uses) it resolves the
configured revision to its commit with the hub's API first, lists the files a job reads (a
model's top-level configs, weights and tokenizer files; a data set's README.md and the data
files its `configs:` map the configured config and split to), downloads them at that commit into
the snapshot store (the hub cache's layout, shared by runs: hub.cache_dir), checks each against
the hub's size, sha256 (LFS) or git blob id, and writes results/<run>/hub.lock.yaml.

A later fetch never moves the lock: it checks every locked file (size and sha256) and downloads
only what is missing, at the locked commit. `--refresh` moves entries; each commit is a result key
of the jobs that read it, so `snakemake -n` then lists exactly those, and a finished training is
replaced only with the consent that stages.reruns asks for. Nothing is written unless every
repository resolves: a gated, missing or unreachable one stops the fetch with its name and the fix.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import shutil
import sys
from pathlib import Path

from .config import ConfigError, load_configs, source_of
from .core.common import hub
from .core.common.io import ArtifactError, sha256_file
from .core.common.progress import progress
from .core.plans.cost import size_of

FetchError = hub.FetchError

def git_blob_id(path: Path) -> str:
    """The git object id of a file (what the hub reports for a file not stored in LFS)."""
    h = hashlib.sha1()
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fix(use: hub.Repo) -> str:
    return (f"{use.where}.model_id" if use.repo_type == "model" else f"{use.where}.dataset")


def resolve(api, use: hub.Repo, revision: str):
    """The hub's record of `use` at `revision` (its commit and files), after checking that this
    node's token may read its files (a gated repository answers its record to anyone, and refuses
    the files), or a FetchError that names the repository, the config key and the fix."""
    def info():
        api.auth_check(use.repo_id, repo_type=use.repo_type)
        return api.repo_info(use.repo_id, repo_type=use.repo_type, revision=revision,
                             files_metadata=True)

    return hub_call(api, use, revision, info)


def hub_call(api, use: hub.Repo, revision: str, call):
    """`call()`, with the hub client's errors turned into a FetchError that names the repository,
    the config key and the fix."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"{use.repo_type} {use.repo_id}"
    try:
        return call()
    except HFValidationError as err:
        raise FetchError(f"{name} ({_fix(use)}): neither a folder on this node nor a hub "
                         f"repository id ({err})") from None
    except GatedRepoError:
        raise FetchError(
            f"{name} ({_fix(use)}) is gated: accept its terms at {api.endpoint}/"
            f"{'datasets/' if use.repo_type == 'dataset' else ''}{use.repo_id} with your account, "
            "then give this node a token (export HF_TOKEN=..., or `hf auth login`)") from None
    except RevisionNotFoundError:
        raise FetchError(f"{name}: no revision {revision!r} ({use.where}.revision)") from None
    except EntryNotFoundError as err:
        raise FetchError(f"{name}@{revision[:12]}: a file listed by the hub is missing: {err}") from None
    except RepositoryNotFoundError:
        raise FetchError(f"{name} ({_fix(use)}): no such repository on {api.endpoint}, or a private "
                         "one this node's token (HF_TOKEN) cannot see") from None
    except OfflineModeIsEnabled:
        raise FetchError("HF_HUB_OFFLINE=1 is set in this shell: the fetch is the one step that "
                         "needs the hub (unset it here; the jobs set it themselves)") from None
    except HfHubHTTPError as err:
        raise FetchError(f"{name}: the hub answered {err}") from None
    except OSError as err:  # httpx's connection errors are OSErrors underneath
        raise FetchError(f"{name}: cannot reach {api.endpoint} ({type(err).__name__}: {err}): run "
                         "the fetch where the hub is reachable (the login node)") from None
    except Exception as err:  # noqa: BLE001 - httpx raises its own ConnectError, not an OSError
        if type(err).__module__.startswith("httpx"):
            raise FetchError(f"{name}: cannot reach {api.endpoint} ({type(err).__name__}: {err}): "
                             "run the fetch where the hub is reachable (the login node)") from None
        raise


def model_files(names: list[str]) -> list[str]:
    """The files of a model repository a job reads: top-level configs, tokenizer files and the
    safetensors weights (PyTorch .bin weights only where there are no safetensors)."""
    top = [n for n in names if "/" not in n]
    chosen = [n for n in top if n.endswith(hub.MODEL_FILES)]
    if not any(n.endswith(".safetensors") for n in chosen):
        chosen += [n for n in top if n.endswith(".bin")]
    return sorted(chosen)


def dataset_files(names: list[str], readme: str | None, uses: list[hub.Repo]) -> list[str]:
    """README.md and the data files the uses' configs and splits map to (every data file where
    the card has no `configs:`); a config the card lacks, or no data file at all, is a FetchError
    naming the key."""
    chosen: set[str] = set()
    for use in uses:
        files = hub.use_files(names, readme, use)
        chosen |= set(files) if files is not None else {
            n for n in names if n.endswith(hub.DATA_FILES) and not n.startswith(".")}
    if not chosen:
        raise FetchError(f"dataset {uses[0].repo_id}: no data file ({', '.join(hub.DATA_FILES)}) "
                         f"in the repository ({uses[0].where}.dataset)")
    if "README.md" in names:
        chosen.add("README.md")
    return sorted(chosen)


def download(api, use: hub.Repo, commit: str, files: list[str], store: Path,
             sizes: dict[str, int], bar) -> None:
    """Download `files` of one commit into the store (already present ones are not fetched
    again)."""
    from huggingface_hub import hf_hub_download

    for rel in files:
        hub_call(api, use, commit, lambda rel=rel: hf_hub_download(
            use.repo_id, rel, repo_type=use.repo_type, revision=commit, cache_dir=store))
        bar.update(sizes.get(rel, 0))


def plan_repo(api, uses: list[hub.Repo], entry: dict | None, refresh: bool, store: Path) -> dict:
    """What to do for one repository: its commit, the files a job reads with their hub sizes and
    ids, and the files still to download."""
    use = uses[0]
    revision = use.revision
    if entry is not None and not refresh:
        commit = entry["commit"]
        if entry["revision"] != revision:
            raise FetchError(f"{use.key} is locked at revision {entry['revision']!r}, {use.where}"
                             f".revision asks for {revision!r}: move the lock on purpose with "
                             f"--refresh {use.repo_id}")
        folder = hub.snapshot_dir(store, use.repo_type, use.repo_id, commit)
        wanted = dict(entry["files"])
        missing = [f for f, facts in wanted.items()
                   if not (folder / f).is_file() or (folder / f).stat().st_size != facts["size"]]
        listing = _needs_listing(uses, entry)
        if not missing and not listing:
            return {"use": use, "commit": commit, "files": wanted, "todo": [], "meta": {},
                    "entry": entry, "moved": False}
        meta = _meta(resolve(api, use, commit))
        new_files = []
        if listing:  # the files a changed use needs beyond the locked ones, at the locked commit
            readme = _readme(api, use, commit, store) if "README.md" in meta else None
            new_files = [f for f in dataset_files(sorted(meta), readme, uses) if f not in wanted]
        files = {f: {"size": meta[f]["size"]} for f in [*wanted, *new_files] if f in meta}
        return {"use": use, "commit": commit, "files": files, "meta": meta, "entry": entry,
                "todo": sorted(set(missing) | set(new_files)), "moved": False}
    info = resolve(api, use, revision)
    meta = _meta(info)
    names = sorted(meta)
    if use.repo_type == "model":
        chosen = model_files(names)
        if not any(n.endswith((".safetensors", ".bin")) for n in chosen):
            raise FetchError(f"model {use.repo_id}@{info.sha[:12]}: no weights (.safetensors or "
                             f".bin) at the top of the repository ({use.where}.model_id)")
    else:
        readme = _readme(api, use, info.sha, store) if "README.md" in meta else None
        chosen = dataset_files(names, readme, uses)
    folder = hub.snapshot_dir(store, use.repo_type, use.repo_id, info.sha)
    todo = [f for f in chosen if not ((folder / f).is_file()
                                      and (folder / f).stat().st_size == meta[f]["size"])]
    return {"use": use, "commit": info.sha, "files": {f: {"size": meta[f]["size"]} for f in chosen},
            "meta": meta, "entry": entry, "todo": todo,
            "moved": entry is not None and entry["commit"] != info.sha}


def _needs_listing(uses: list[hub.Repo], entry: dict) -> bool:
    """Whether a data set's configured uses changed since the lock was written (a new split)."""
    return (uses[0].repo_type == "dataset" and "uses" in entry
            and not {u.where for u in uses} <= set(entry["uses"]))


def _meta(info) -> dict[str, dict]:
    return {s.rfilename: {"size": s.size if s.lfs is None else s.lfs.size,
                          "sha256": None if s.lfs is None else s.lfs.sha256,
                          "blob_id": s.blob_id} for s in info.siblings or []}


def _readme(api, use: hub.Repo, commit: str, store: Path) -> str:
    from huggingface_hub import hf_hub_download

    path = hub_call(api, use, commit, lambda: hf_hub_download(
        use.repo_id, "README.md", repo_type=use.repo_type, revision=commit, cache_dir=store))
    return Path(path).read_text(errors="replace")


def verify_download(use: hub.Repo, commit: str, folder: Path, files: dict, meta: dict) -> dict:
    """The lock's record of each file ({size, sha256}), after checking it against the hub's
    size and its sha256 (LFS files) or git blob id (the others)."""
    out = {}
    for rel in sorted(files):
        path = folder / rel
        size = path.stat().st_size
        digest = sha256_file(path)
        hub_facts = meta.get(rel, {})
        bad = (hub_facts.get("size") is not None and size != hub_facts["size"]) or \
              (hub_facts.get("sha256") and digest != hub_facts["sha256"]) or \
              (not hub_facts.get("sha256") and hub_facts.get("blob_id")
               and git_blob_id(path) != hub_facts["blob_id"])
        if bad:
            raise FetchError(f"{use.repo_type} {use.repo_id}@{commit[:12]}: {rel} in the store "
                             f"({path.resolve()}) is not the hub's file (size or hash); delete it "
                             "and fetch again")
        out[rel] = {"size": size, "sha256": digest}
    return out


def fetch(cfg, source: str, refresh: list[str] | None, *, out=sys.stdout) -> int:
    """Fetch or verify every hub repository of `cfg`; write the lock when all succeed."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import disable_progress_bars

    path = hub.lock_path(cfg)
    lock = hub.read_lock(path) or {"version": hub.LOCK_VERSION, "repositories": {}}
    entries = lock["repositories"]
    uses_of: dict[str, list[hub.Repo]] = {}
    for use in hub.all_uses(cfg):
        uses_of.setdefault(use.key, []).append(use)
    if not uses_of:
        print(f"{source}: no hub model or data set to fetch (every source is local or built here)",
              file=out)
        return 0
    revisions = {key: {u.revision for u in uses} for key, uses in uses_of.items()}
    for key, revs in revisions.items():
        if len(revs) > 1:
            raise FetchError(f"{key}: the config asks for revisions {sorted(revs)} "
                             f"({', '.join(u.where for u in uses_of[key])}); one run reads one commit "
                             "of a repository: give them one revision")
    ids = {u.repo_id for uses in uses_of.values() for u in uses}
    unknown = sorted(set(refresh or []) - ids)
    if unknown:
        raise FetchError(f"--refresh {' '.join(unknown)}: not a hub repository of {source} "
                         f"({', '.join(sorted(ids))})")
    store = hub.store(cfg)
    store.mkdir(parents=True, exist_ok=True)
    api = HfApi()
    disable_progress_bars()  # one bar of our own, over the bytes of every file
    plans, errors = [], []
    for key, uses in uses_of.items():
        moving = refresh is not None and (not refresh or uses[0].repo_id in refresh)
        try:
            plans.append(plan_repo(api, uses, entries.get(key), moving, store))
        except FetchError as err:
            errors.append(str(err))
    if errors:
        raise FetchError(f"{source}: nothing fetched, the lock is unchanged:\n  " + "\n  ".join(errors))
    todo = sum(p["files"][f]["size"] or 0 for p in plans for f in p["todo"])
    free = shutil.disk_usage(store).free
    total = sum(facts["size"] or 0 for p in plans for facts in p["files"].values())
    print(f"{len(plans)} repositories, {size_of(total)} in all; {size_of(todo)} to download into "
          f"{store} ({size_of(free)} free there)", file=out)
    if todo > free:
        raise FetchError(f"{store}: {size_of(todo)} to download, {size_of(free)} free: set hub.cache_dir "
                         f"(or ${hub.CACHE_ENV}) to a larger disk")
    with progress(total=todo, unit="B", unit_scale=True, desc="fetch") as bar:
        for p in plans:
            if p["todo"]:
                sizes = {f: p["files"][f]["size"] or 0 for f in p["todo"]}
                download(api, p["use"], p["commit"], p["todo"], store, sizes, bar)
    moved = []
    for p in plans:
        use, commit = p["use"], p["commit"]
        folder = hub.snapshot_dir(store, use.repo_type, use.repo_id, commit)
        if p["meta"]:
            files = verify_download(use, commit, folder, p["files"], p["meta"])
        else:  # nothing downloaded: every locked file is checked, sha256 included
            files = p["entry"]["files"]
            hub.check_snapshot(p["entry"], folder, path, full=True)
        old = p["entry"]
        if old is not None and old["commit"] == commit:
            for rel, facts in old["files"].items():
                if rel in files and files[rel] != facts:
                    raise FetchError(f"{use.key}@{commit[:12]}: {rel} differs from the lock's record "
                                     f"({path}); delete {folder / rel} and fetch again")
        if p["moved"]:
            moved.append(f"{use.key}: {use.revision} moved {old['commit'][:12]} -> {commit[:12]}")
        entries[use.key] = {
            "repo_id": use.repo_id, "repo_type": use.repo_type, "revision": use.revision,
            "commit": commit, "uses": sorted(u.where for u in uses_of[use.key]),
            "fetched": old.get("fetched") if old is not None and old["commit"] == commit
            and not p["todo"] else datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "files": dict(sorted(files.items())),
        }
    lock["store"] = str(store.resolve())  # where the jobs must find the snapshots
    lock["repositories"] = dict(sorted(entries.items()))
    if hub.read_lock(path) != lock:
        hub.write_lock(path, lock)
    for p in plans:
        use = p["use"]
        state = "moved" if p["moved"] else ("fetched" if p["todo"] else "verified")
        print(f"{state}: {use.key}@{p['commit'][:12]} ({use.revision}), {len(entries[use.key]['files'])} "
              f"files", file=out)
    if moved:
        print("the lock moved; the jobs that read these commits rerun (`snakemake -n` lists them):\n  "
              + "\n  ".join(moved), file=out)
    print(f"lock: {path.resolve()} (snapshots in {store.resolve()})", file=out)
    return 0


def verify(cfg, *, out=sys.stdout) -> int:
    """Re-hash every locked file in the store (offline): 0 when all match."""
    path = hub.lock_path(cfg)
    lock = hub.read_lock(path)
    if not lock:
        raise FetchError(f"{path}: no lock to verify; fetch first: python -m stages.fetch "
                         "--configfile CONFIG")
    store = hub.store(cfg)
    for key, entry in lock["repositories"].items():
        folder = hub.snapshot_dir(store, entry["repo_type"], entry["repo_id"], entry["commit"])
        hub.check_snapshot(entry, folder, path, full=True)
        print(f"verified: {key}@{entry['commit'][:12]}, {len(entry['files'])} files", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configfile", required=True, nargs="+", metavar="FILE",
                   help="workflow config YAML; several are laid on each other in order, as Snakemake's\n                   flag does (a pilot or a calibration on a configuration)")
    p.add_argument("--refresh", nargs="*", metavar="REPO_ID", default=None,
                   help="move the lock of these repositories (all, where none is named) to what "
                        "their revisions point to now")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every locked file in the snapshot store; no network")
    args = p.parse_args(argv)
    try:
        cfg = load_configs(args.configfile)
        if args.verify:
            return verify(cfg)
        return fetch(cfg, source_of(args.configfile), args.refresh)
    except (ConfigError, ArtifactError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
