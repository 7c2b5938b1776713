"""An offline site: the fetch resolves and locks every hub model and data set where the hub is
reachable, and nothing after it touches the network (stages.fetch, stages.core.common.hub).

The hub is a server on the loopback (tests/hubserver.py) and the client is the real
`huggingface_hub`, run as the fetch runs (`python -m stages.fetch`, HF_ENDPOINT pointing at it).
The tests that run the fetch are in the slow tier (scripts/test.sh --all, CI); the last one runs the
whole workflow after the fetch in a network namespace without network
(`unshare --net`, as root, as CI runs), and compares its tables with the same model and data read
from local folders.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from stages.config import load_config
from stages.core.common import hub
from stages.core.common.hub import readme_configs
from stages.core.common.io import ArtifactError, sha256_file
from stages.fetch import dataset_files, model_files
from tests.conftest import ROOT, tiny_model, workflow_env, write_yaml
from tests.hubserver import Hub

MODEL = "test-org/tiny-qwen2"
DATA = "test-org/arith"
CARD = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: data/train-*\n  - split: test\n    path: data/test-*\n---\n# arithmetic\n")


def data_folder(folder: Path, seed: int = 0) -> Path:
    """A data set in the hub's layout: a card whose `configs:` maps two splits to Parquet files."""
    from stages.core.data.problems import generate_arithmetic

    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, offset, n in (("train", 2, 64), ("test", 3, 16)):
        probs = generate_arithmetic(n, seed=seed + offset, min_terms=2, max_terms=3, max_add=9,
                                    max_mul=9, split=split)
        pq.write_table(pa.table({"id": [p.problem_id for p in probs],
                                 "question": [p.question for p in probs],
                                 "answer": [p.answer for p in probs]}),
                       folder / "data" / f"{split}-00000-of-00001.parquet")
    (folder / "README.md").write_text(CARD)
    (folder / "notes.txt").write_text("not a data file of any configuration\n")
    return folder


def model_folder(folder: Path, seed: int = 0) -> Path:
    tiny_model(folder, seed=seed)
    (folder / "checkpoint" / "original").mkdir()
    (folder / "checkpoint" / "original" / "consolidated.pth").write_bytes(b"\0" * 64)  # not read
    return folder / "checkpoint"


@pytest.fixture
def served(tmp_path):
    """(the hub, the folders it serves) with one model and one data set on `main`."""
    h = Hub().start()
    folders = {"model": model_folder(tmp_path / "model-src"), "data": data_folder(tmp_path / "data-src")}
    h.repo("model", MODEL).push(Hub.folder_files(folders["model"]))
    h.repo("dataset", DATA).push(Hub.folder_files(folders["data"]))
    yield h, folders
    h.stop()


def hub_config(test_raw: dict, wd: Path, run: str = "hub", model: str = MODEL, data: str = DATA) -> Path:
    """config/test.yaml, GRPO alone, with its model and its training and benchmark data from the
    hub (or from local folders, where `model` and `data` name them)."""
    raw = {**test_raw, "run": run, "hub": {"cache_dir": str(wd / "cache")}}
    raw["experiment"] = {**raw["experiment"], "methods": ["grpo"]}  # one training is enough here
    raw["models"] = {"tiny-s": {"source": "hub", "hub": {"model_id": model}}}
    for name, split in (("rl", "train"), ("arith-easy", "test")):
        raw["datasets"][name]["source"] = {"kind": "hub", "dataset": data, "config": "default",
                                           "split": split, "adapter": "generic"}
    return write_yaml(wd / f"{run}.yaml", raw)


def fetch(h: Hub | None, wd: Path, cfg: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m stages.fetch` as a user runs it on the login node: online (no offline switch),
    the hub at HF_ENDPOINT (a closed port where `h` is None)."""
    env = {k: v for k, v in workflow_env().items() if k not in hub.OFFLINE}
    env["HF_ENDPOINT"] = h.endpoint if h is not None else "http://127.0.0.1:9"
    return subprocess.run([sys.executable, "-m", "stages.fetch", "--configfile", str(cfg), *args],
                          cwd=wd, env=env, capture_output=True, text=True, timeout=300)


def lock_of(wd: Path, run: str = "hub") -> dict:
    return yaml.safe_load((wd / "results" / run / hub.LOCK_NAME).read_text())


@pytest.mark.slow  # the fetch in subprocesses against the loopback hub
def test_the_fetch_locks_each_commit_and_a_moved_branch_changes_nothing_until_refreshed(
        served, tmp_path, test_raw):
    h, folders = served
    cfg = hub_config(test_raw, tmp_path)
    first = fetch(h, tmp_path, cfg)
    assert first.returncode == 0, first.stderr
    lock = lock_of(tmp_path)["repositories"]
    model, data = lock[f"model:{MODEL}"], lock[f"dataset:{DATA}"]
    assert model["commit"] == h.repo("model", MODEL).branches["main"]
    assert model["revision"] == "main" and model["uses"] == ["models.tiny-s.hub"]
    # the files a job reads: top-level configs, weights and tokenizer files, not original/
    assert sorted(model["files"]) == ["config.json", "generation_config.json", "model.safetensors",
                                      "tokenizer.json", "tokenizer_config.json"]
    assert sorted(data["files"]) == ["README.md", "data/test-00000-of-00001.parquet",
                                     "data/train-00000-of-00001.parquet"]
    store = tmp_path / "cache" / "hub"
    snap = hub.snapshot_dir(store, "model", MODEL, model["commit"])
    for rel, facts in model["files"].items():
        assert (snap / rel).stat().st_size == facts["size"]
        assert sha256_file(snap / rel) == facts["sha256"]
    # revision info resolved first, then the files at the commit, never at `main`
    resolves = [r for r in h.requests if "/resolve/" in r]
    assert resolves and all("/resolve/main/" not in r for r in resolves)

    # main moves on the hub: a later fetch verifies the lock and downloads nothing
    moved = h.repo("model", MODEL).push({**Hub.folder_files(folders["model"]), "extra.json": b"{}"})
    before = (tmp_path / "results" / "hub" / hub.LOCK_NAME).read_bytes()
    again = fetch(None, tmp_path, cfg)  # offline: everything is already in the store
    assert again.returncode == 0, again.stderr
    assert "verified: model:test-org/tiny-qwen2" in again.stdout
    assert (tmp_path / "results" / "hub" / hub.LOCK_NAME).read_bytes() == before

    # the deliberate move, of the model alone
    refresh = fetch(h, tmp_path, cfg, "--refresh", MODEL)
    assert refresh.returncode == 0, refresh.stderr
    lock2 = lock_of(tmp_path)["repositories"]
    assert lock2[f"model:{MODEL}"]["commit"] == moved and "extra.json" in lock2[f"model:{MODEL}"]["files"]
    assert lock2[f"dataset:{DATA}"] == data
    assert f"main moved {model['commit'][:12]} -> {moved[:12]}" in refresh.stdout
    unknown = fetch(h, tmp_path, cfg, "--refresh", "someone/else")
    assert unknown.returncode == 2 and "--refresh someone/else: not a hub repository" in unknown.stderr


@pytest.mark.slow  # the fetch in subprocesses against the loopback hub
def test_a_gated_missing_or_unreachable_repository_stops_the_fetch_with_the_fix_and_writes_nothing(
        served, tmp_path, test_raw):
    h, folders = served
    h.repo("dataset", "test-org/gated", gated=True).push(Hub.folder_files(folders["data"]))
    gated = fetch(h, tmp_path, hub_config(test_raw, tmp_path, data="test-org/gated"))
    assert gated.returncode == 2
    assert "dataset test-org/gated (datasets.rl.source.dataset) is gated" in gated.stderr
    assert "HF_TOKEN" in gated.stderr and "Traceback" not in gated.stderr
    missing = fetch(h, tmp_path, hub_config(test_raw, tmp_path, model="test-org/absent"))
    assert missing.returncode == 2
    assert "model test-org/absent (models.tiny-s.hub.model_id): no such repository" in missing.stderr
    offline = fetch(None, tmp_path, hub_config(test_raw, tmp_path))
    assert offline.returncode == 2 and "cannot reach http://127.0.0.1:9" in offline.stderr
    assert "the login node" in offline.stderr
    assert not (tmp_path / "results" / "hub" / hub.LOCK_NAME).exists()


@pytest.mark.slow  # the fetch in subprocesses against the loopback hub
def test_a_corrupted_snapshot_file_stops_a_job_with_the_files_name(served, tmp_path, test_raw):
    h, _ = served
    cfg_path = hub_config(test_raw, tmp_path)
    assert fetch(h, tmp_path, cfg_path).returncode == 0
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the lock lives under results/<run> of the working folder
    try:
        cfg = hub.apply_lock(load_config(cfg_path), lock_of(tmp_path), Path("lock"))
        commit = cfg.models["tiny-s"].hub.commit
        folder = hub.locked_folder(cfg, "model", MODEL, commit)
        blob = (folder / "model.safetensors").resolve()  # the store's blob behind the symlink
        with open(blob, "ab") as fh:
            fh.write(b"\0")
        with pytest.raises(ArtifactError, match=r"file model.safetensors has \d+ bytes, the lock"):
            hub.locked_folder(cfg, "model", MODEL, commit)
    finally:
        os.chdir(cwd)
    verify = fetch(None, tmp_path, cfg_path, "--verify")
    assert verify.returncode == 2 and "model.safetensors" in verify.stderr


def test_the_lock_sets_each_commit_and_disagreeing_with_the_config_is_an_error(tmp_path, test_raw):
    cfg = load_config(hub_config(test_raw, tmp_path))
    assert [u.key for u in hub.unlocked(cfg)] == [f"model:{MODEL}", f"dataset:{DATA}", f"dataset:{DATA}"]
    entry = {"repo_id": MODEL, "repo_type": "model", "revision": "main", "commit": "a" * 40, "files": {}}
    lock = {"version": 1, "repositories": {f"model:{MODEL}": entry}}
    locked = hub.apply_lock(cfg, lock, Path("hub.lock.yaml"))
    assert locked.models["tiny-s"].hub.commit == "a" * 40
    assert [u.key for u in hub.unlocked(locked)] == [f"dataset:{DATA}"] * 2
    with pytest.raises(ArtifactError, match=r"locked at revision 'v1'.*--refresh test-org/tiny-qwen2"):
        hub.apply_lock(cfg, {"version": 1, "repositories": {f"model:{MODEL}": {**entry, "revision": "v1"}}},
                       Path("hub.lock.yaml"))
    (tmp_path / "bad.yaml").write_text("version: 1\nrepositories: {x: {repo_id: a}}\n")
    with pytest.raises(ArtifactError, match="bad.yaml: repositories.x: key 'repo_type' missing"):
        hub.read_lock(tmp_path / "bad.yaml")
    # names with dots (qwen2.5-0.5b) are one key each
    paper = load_config(ROOT / "config" / "paper.yaml")
    qwen = {"repo_id": "Qwen/Qwen2.5-0.5B", "repo_type": "model", "revision": "main",
            "commit": "b" * 40, "files": {}}
    locked_paper = hub.apply_lock(paper, {"version": 1, "repositories": {"model:Qwen/Qwen2.5-0.5B": qwen}},
                                  Path("hub.lock.yaml"))
    assert locked_paper.models["qwen2.5-0.5b"].hub.commit == "b" * 40
    assert "model:Qwen/Qwen2.5-0.5B" not in {u.key for u in hub.unlocked(locked_paper)}
    assert "models.qwen2.5-1.5b.hub" in {u.where for u in hub.unlocked(locked_paper)}
    # the commit is a result key of what reads the model: the base model's job hash moves with it
    from stages.keys import job_hash_of

    assert job_hash_of(cfg, "base_model", {"size": "tiny-s"}) != \
        job_hash_of(locked, "base_model", {"size": "tiny-s"})


def test_every_job_gets_the_offline_switches_and_one_cache_root(tmp_path, test_raw):
    cfg = load_config(hub_config(test_raw, tmp_path))
    env = hub.job_environment(cfg)
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    for var in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR",
                "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert Path(env[var]).parent == tmp_path / "cache", var
    # a stage sets them itself, whatever its caller's shell exported
    code = ("import os, sys; sys.argv = ['x', '--config', sys.argv[1]]; from stages import cli; "
            "cli.run(lambda a, c: print(os.environ['HF_HUB_OFFLINE'], os.environ['HF_HUB_CACHE']),"
            " cli.parser('x'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hub.yaml")], cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True)
    assert out.stdout.split() == ["1", str(tmp_path / "cache" / "hub")], out.stderr


def test_which_files_a_job_reads():
    assert model_files(["config.json", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                        "tokenizer.json", "merges.txt", "original/params.json", ".gitattributes",
                        "README.md"]) == ["config.json", "merges.txt",
                                          "model-00001-of-00002.safetensors", "tokenizer.json"]
    assert model_files(["config.json", "pytorch_model.bin"]) == ["config.json", "pytorch_model.bin"]
    names = ["README.md", "data/train-0.parquet", "data/test-0.parquet", "other/x.parquet"]
    assert readme_configs(CARD)[0]["config_name"] == "default"
    test_only = hub.Repo("dataset", DATA, "main", ("datasets", "b", "source"), "default", "test")
    assert dataset_files(names, CARD, [test_only]) == ["README.md", "data/test-0.parquet"]
    assert dataset_files(names, "# no card metadata\n", [test_only]) == sorted(names[1:] + ["README.md"])
    from stages.fetch import FetchError

    with pytest.raises(FetchError, match=r"no configuration 'main' in its README.md \(datasets.b.source.config"):
        dataset_files(names, CARD, [hub.Repo("dataset", DATA, "main", ("datasets", "b", "source"), "main", "test")])


CARD2 = ("---\nconfigs:\n- config_name: algebra\n  data_files:\n  - split: train\n"
         "    path: algebra/train-*\n  - split: test\n    path: algebra/test-*\n"
         "- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
         "  - split: test\n    path: data/test-*\n- config_name: plain\n  data_files: all.csv\n"
         "---\n")


def test_one_split_of_a_second_config_is_fetched_and_read_alone(tmp_path):
    """A card whose first config is not the one used (MATH-lighteval's starts with `algebra`):
    the fetch takes the used config's split alone, and the job reads exactly those files
    (datasets, given the folder, would infer the format from the first config's absent files)."""
    from stages.config import HubSource
    from stages.core.data import adapters

    names = ["README.md", "algebra/train-0.parquet", "algebra/test-0.parquet",
             "data/train-0.parquet", "data/test-0.parquet", "all.csv"]
    train = hub.Repo("dataset", DATA, "main", ("datasets", "t", "source"), "default", "train")
    assert dataset_files(names, CARD2, [train]) == ["README.md", "data/train-0.parquet"]
    # a plain data_files pattern is split "train" alone, as datasets reads it
    plain = hub.Repo("dataset", DATA, "main", ("datasets", "p", "source"), "plain", "test")
    with pytest.raises(hub.FetchError, match=r"no data file of configuration 'plain', split 'test'"):
        dataset_files(names, CARD2, [plain])
    # the snapshot as the fetch leaves it: the card and the one file
    folder = data_folder(tmp_path / "src")
    snap = tmp_path / "snap"
    (snap / "data").mkdir(parents=True)
    (snap / "README.md").write_text(CARD2)
    (snap / "data" / "train-0.parquet").write_bytes(
        (folder / "data" / "train-00000-of-00001.parquet").read_bytes())
    src = HubSource(dataset=DATA, config="default", split="train", adapter="generic")
    problems = adapters.load_hub(src, f"hub:{DATA}", snap)
    assert len(problems) == 64 and problems[0].question
    with pytest.raises(ValueError, match=r"hub:test-org/arith/algebra/train: cannot read config "
                                         r"'algebra'.*no data file of configuration 'algebra'"):
        adapters.load_hub(HubSource(dataset=DATA, config="algebra", split="train", adapter="generic"),
                          f"hub:{DATA}", snap)


@pytest.mark.slow
def test_a_hub_run_completes_without_network_after_one_fetch_as_from_local_folders(
        served, tmp_path, test_raw):
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip for a network namespace without network (CI has them)")
    h, folders = served
    cfg = hub_config(test_raw, tmp_path)
    assert fetch(h, tmp_path, cfg).returncode == 0
    h.stop()  # no hub from here on, and no network at all inside the namespace
    snakemake = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory",
                 str(tmp_path), "--cores", "2"]

    def offline(*args: str) -> subprocess.CompletedProcess:
        inner = " ".join(map(shlex_quote, [*snakemake, *args]))
        return subprocess.run(["unshare", "--net", "sh", "-c", f"ip link set lo up && {inner}"],
                              cwd=tmp_path, env=workflow_env(), capture_output=True, text=True,
                              timeout=900)

    run = offline("--configfile", str(cfg))
    assert run.returncode == 0, run.stderr[-4000:]
    base = json.loads((tmp_path / "results/hub/models/size=tiny-s/base.json").read_text())
    assert base["commit"] == lock_of(tmp_path)["repositories"][f"model:{MODEL}"]["commit"]
    assert not any(str(tmp_path) in str(v) for v in base.values())  # no absolute path
    from stages.core.common.io import read_provenance

    prov = read_provenance(str(tmp_path / "results/hub/rollouts/size=tiny-s/rollouts.parquet"))
    assert set(prov["hub"]) == {f"model:{MODEL}", f"dataset:{DATA}"}
    sources = (tmp_path / "results/hub/tables/sources.csv").read_text()
    assert f"model:{MODEL}@{base['commit'][:12]}" in sources

    # the same model and data from local folders: the same tables
    local = hub_config(test_raw, tmp_path, run="local", model=str(folders["model"]),
                       data=str(folders["data"]))
    assert offline("--configfile", str(local)).returncode == 0
    tables = sorted((tmp_path / "results/local/tables").glob("*.csv"))
    assert len(tables) > 3
    for table in tables:  # the same numbers; the files they cite are the other run's
        if table.name != "sources.csv":
            ours = table.read_text().replace("results/local/", "results/hub/")
            assert ours == (tmp_path / "results/hub/tables" / table.name).read_text(), table.name

    # main moves: nothing to do until the lock moves on purpose
    h.start()
    h.repo("model", MODEL).push(Hub.folder_files(model_folder(tmp_path / "model-v2", seed=1)))
    dry = offline("-n", "--configfile", str(cfg))
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr
    assert fetch(h, tmp_path, cfg, "--refresh").returncode == 0
    dry = offline("-n", "--configfile", str(cfg))
    listed = dry.stdout + dry.stderr
    assert dry.returncode == 0 and "base_model" in listed and "prepare_data" not in listed, listed[-3000:]
    assert "replace_trainings" in listed  # finished trainings are replaced only with consent


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
