"""Every command the front page and the manual show runs as written.

The `snakemake` and `python -m stages...` commands are taken from README.md and docs/*.md (shell
blocks, and inline code that starts with one of them) and run in the environment the README sets
up (`source .venv/bin/activate`: this interpreter's Snakemake and packages), in a folder that
holds the repository's Snakefile, workflow/, config/, slurm/ and profiles/ and no results:
- `snakemake ...` as a dry run (`-n`), against the config it names; before that, its arguments are
  parsed as Snakemake parses them, so a target written after `--configfile`, `--forcerun` or
  `--set-resources` (each takes several values) is reported as swallowed;
- `python -m stages.plan ...` for real;
- any other stage's CLI only parses: its `--help` must list every flag the command uses.
Usage lines with placeholders (FILE, N, [--json]) run with the values in PLACEHOLDERS. The
commands that cannot run here are in SKIPPED, each with its reason. A code block whose first line
is `# <file name>`, or whose info string names a file (docs/science.md's selector, grader, config
overlays and benchmark data), is written to the working folder first, so a command may use it; the
examples' own tests are at the end.

One subprocess runs them all (`python -m tests.test_docs_commands`, reading the commands as JSON
on stdin), so Snakemake and torch are imported once: about 40 s for the lot (marked slow).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The flags of Snakemake that take several values: a target after one of them is read as a value.
MULTI_VALUE = ("--configfile", "--configfiles", "--forcerun", "-R", "--set-resources",
               "--rerun-triggers", "--config", "-C", "--until", "-U", "--omit-from", "-O")
PLACEHOLDERS = {"FILE": "config/beyond-80-20.yaml", "MINUTES": "2880", "N": "80"}
# Commands that cannot run on a machine without a finished run or a cluster, each with why.
SKIPPED = {
    "snakemake --report results/default/report.html":
        "needs the finished run's outputs; tests/test_tables.py and tests/test_browser.py build a report",
    "snakemake --profile slurm --configfile config/paper.yaml results/paper-pilot/calibration.yaml":
        "needs a finished pilot's calibration file; tests/test_calibrate.py writes one and runs the "
        "plan with it laid on its configuration",
}
COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:\.venv/bin/)?(?:snakemake(?:\s|$)|python -m stages\.)")


def commands_of(text: str) -> list[str]:
    """The snakemake and `python -m stages...` commands of a Markdown page, as written."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line.strip().removeprefix("$ "))
            line = " ".join(line.split())
            if COMMAND.match(line):
                found.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [span.strip() for span in re.findall(r"`([^`\n]+)`", prose) if COMMAND.match(span.strip())]
    return found


def expand(command: str) -> list[str]:
    """A usage line as commands to run: placeholders filled, optional [parts] included, and
    `python -m stages.<stage>` as every stage."""
    command = re.sub(r"\[([^\]]*)\]", r"\1", command)
    words = [PLACEHOLDERS.get(w, w) for w in command.split()]
    command = " ".join(words)
    if "stages.<stage>" in command:
        stages = sorted(p.stem for p in (ROOT / "stages").glob("*.py")
                        if 'if __name__ == "__main__"' in p.read_text())
        return [command.replace("stages.<stage>", f"stages.{s}") for s in stages]
    return [command]


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv without the .venv/bin/ prefix)."""
    env, words = {}, shlex.split(command)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    words[0] = words[0].removeprefix(".venv/bin/")
    return env, words


def swallowed(argv: list[str]) -> list[str]:
    """Values of a several-values flag that are targets (a results/ path) or rule names in the
    wrong place: what Snakemake would read as a config file, a rule to force or a resource."""
    problems, flag = [], None
    for word in argv[1:]:
        if word.startswith("-"):
            flag = word.split("=")[0] if word.split("=")[0] in MULTI_VALUE else None
            continue
        if flag in ("--configfile", "--configfiles") and not word.endswith((".yaml", ".yml", ".json")):
            problems.append(f"{word!r} follows {flag} and is read as a config file: write targets first")
        elif flag in ("--forcerun", "-R", "--until", "-U", "--omit-from", "-O") and "/" in word:
            problems.append(f"{word!r} follows {flag} and is read as a rule name: write targets first")
        elif flag == "--set-resources" and not re.match(r"^\w+:\w+=\S+$", word):
            problems.append(f"{word!r} follows --set-resources and is read as a resource: write targets first")
    return problems


def plan(command: str) -> dict:
    """What the runner does with one command: dry run, run, parse or skip, and its argv."""
    if command in SKIPPED:
        return {"command": command, "kind": "skip", "why": SKIPPED[command]}
    env, argv = split(command)
    if argv[0] == "snakemake":
        if problems := swallowed(argv):
            return {"command": command, "kind": "fail", "why": "; ".join(problems)}
        return {"command": command, "kind": "dry-run", "env": env, "argv": argv[1:]}
    assert argv[:2] == ["python", "-m"], command
    module, rest = argv[2], argv[3:]
    if not rest:  # `python -m stages.plan` in prose names the CLI: it must exist and parse
        return {"command": command, "kind": "parse", "env": env, "module": module, "flags": [],
                "nested": []}
    if module == "stages.plan":
        return {"command": command, "kind": "run", "env": env, "module": module, "argv": rest}
    if "--" in rest:  # stages.launch ... -- <the stage command>: each side parses
        inner = " ".join(rest[rest.index("--") + 1:])
        rest = rest[:rest.index("--")]
        nested = [plan(inner)] if COMMAND.match(inner) else []
    else:
        nested = []
    flags = sorted({w.split("=")[0] for w in rest if w.startswith("--") and w != "--help"})
    return {"command": command, "kind": "parse", "env": env, "module": module, "flags": flags,
            "nested": nested}


def example_files(text: str) -> dict[str, str]:
    """{name: content} of the page's code blocks that start with a `# <name>.py|yaml` line, or
    whose info string names the file (```jsonl my_bench.jsonl: a data file has no comments)."""
    files = {m.group(1): m.group(2) for m in re.finditer(
        r"```(?:python|yaml)\n# ([\w.-]+\.(?:py|yaml))\n(.*?)```", text, flags=re.S)}
    files |= {m.group(1): m.group(2) for m in re.finditer(
        r"```\w+ ([\w.-]+\.\w+)\n(.*?)```", text, flags=re.S)}
    return files


def documented() -> list[tuple[str, str]]:
    """(page, command) for every command of every page, usage lines expanded, duplicates once."""
    seen, out = set(), []
    for page in PAGES:
        for written in commands_of(page.read_text()):
            for command in expand(written):
                if command not in seen:
                    seen.add(command)
                    out.append((str(page.relative_to(ROOT)), command))
    return out


# The checker must be able to fail: a wrong size, and a target after --configfile / --forcerun.
MUST_FAIL = [
    "snakemake --cores 2 results/default/models/size=tiny/base.json",
    "snakemake --profile slurm --configfile config/paper.yaml "
    "results/paper/token_stats/size=qwen2.5-0.5b/tokens.parquet",
    "snakemake --cores 2 --forcerun base_model results/default/models/size=tiny-s/base.json",
    "python -m stages.plan --configfile config/missing.yaml",
    "python -m stages.prepare_data --config config/config.yaml --no-such-flag x",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every documented command and every MUST_FAIL one, run once: {command: outcome}."""
    wd = tmp_path_factory.mktemp("docs-commands")
    for part in ("Snakefile", "workflow", "config", "slurm", "profiles"):
        (wd / part).symlink_to(ROOT / part)
    for page in PAGES:
        for name, content in example_files(page.read_text()).items():
            (wd / name).write_text(content)
    jobs = [plan(c) for _, c in documented()] + [plan(c) for c in MUST_FAIL]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PWD": str(wd)}
    for var in ("SBATCH_PARTITION", "SBATCH_ACCOUNT", "SBATCH_QOS", "ICT_GPU_PARTITION"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "tests.test_docs_commands"], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=wd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["command"]: r for r in json.loads(proc.stdout.splitlines()[-1])}


def test_the_pages_show_commands_and_the_extractor_finds_them():
    cmds = [c for _, c in documented()]
    assert any(c.startswith("snakemake --profile slurm --configfile config/paper.yaml") for c in cmds)
    assert any(c.startswith("python -m stages.plan") for c in cmds)
    page = "```bash\nsource .venv/bin/activate\nsnakemake -n a \\\n  --configfile b.yaml  # why\n```\n" \
           "Run `python -m stages.plan --configfile FILE [--json]` or `.venv/bin/snakemake --cores 2`."
    assert commands_of(page) == ["snakemake -n a --configfile b.yaml",
                                 "python -m stages.plan --configfile FILE [--json]",
                                 ".venv/bin/snakemake --cores 2"]
    assert expand("python -m stages.plan --configfile FILE [--json]") == [
        "python -m stages.plan --configfile config/beyond-80-20.yaml --json"]
    assert swallowed(["snakemake", "--configfile", "c.yaml", "results/x.parquet"])
    assert not swallowed(["snakemake", "results/x.parquet", "--configfile", "c.yaml", "--cores", "2"])


@pytest.mark.slow
@pytest.mark.parametrize("page, command", documented(), ids=[c for _, c in documented()])
def test_a_documented_command_runs(page, command, results):
    outcome = results[command]
    if outcome["kind"] == "skip":
        pytest.skip(outcome["why"])
    assert outcome["ok"], f"{page}: `{command}` does not run as written: {outcome['why']}"


@pytest.mark.slow
@pytest.mark.parametrize("command", MUST_FAIL)
def test_the_checker_fails_a_broken_command(command, results):
    assert not results[command]["ok"], f"`{command}` should have failed"


# ---- the examples of docs/science.md --------------------------------------------------------

@pytest.fixture
def science_examples(tmp_path, monkeypatch):
    """docs/science.md's example files written to a folder that is the working directory."""
    files = example_files((ROOT / "docs" / "science.md").read_text())
    assert {"my_selectors.py", "my_graders.py", "my.yaml", "my_bench.jsonl", "my_bench.yaml",
            "my_losses.py", "my_loss.yaml"} <= set(files), sorted(files)
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_selector_example_validates_and_selects(science_examples):
    """The overlay merged onto the default as Snakemake merges two --configfiles validates, and the
    selector picks the tokens of surprisal above its threshold."""
    import torch
    import yaml
    from snakemake.utils import update_config

    from stages.config import validate
    from stages.core.training.selectors import SELECTORS, SelectionInput, select_tokens

    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    update_config(raw, yaml.safe_load((science_examples / "my.yaml").read_text()))
    try:
        cfg = validate(raw, "config/config.yaml, my.yaml")
        assert "surprise" in cfg.experiment.methods
        assert cfg.methods["surprise"].needs() == {"logprob"}
        assert cfg.methods["surprise"].selector_params() == {"threshold": 3.0}
        inp = SelectionInput(valid=torch.tensor([[True, True, True, False]]),
                             logprob=torch.tensor([[-0.5, -3.5, -4.0, -9.0]]))
        assert select_tokens("surprise", inp, threshold=3.0).tolist() == [[False, True, True, False]]
    finally:
        SELECTORS.pop("surprise", None)


def test_the_loss_example_validates_and_trains(science_examples):
    """The overlay validates with the method's loss and mode; CISPO's gradient is −clip(r) Â per
    token, with every token's gradient kept; the mode weighs by 1 / B; micro_loss uses both."""
    import math

    import torch
    import yaml
    from snakemake.utils import update_config

    from stages.config import validate
    from stages.core.training.actor import micro_loss
    from stages.core.training.losses import LOSS_AGG_MODES, POLICY_LOSSES, loss_weights

    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    update_config(raw, yaml.safe_load((science_examples / "my_loss.yaml").read_text()))
    try:
        cfg = validate(raw, "config/config.yaml, my_loss.yaml")
        loss = cfg.train_for("cispo", cfg.experiment.sizes[0]).loss
        assert (loss.policy_loss, loss.denominator) == ("cispo", "sequence_sum")
        assert cfg.train_for("grpo", cfg.experiment.sizes[0]).loss.policy_loss == "ppo_clip"
        valid = torch.tensor([[True, True, True], [True, False, False]])
        w = loss_weights(valid, valid, "sequence_sum", dtype=torch.float64)[valid]
        assert w.tolist() == [0.5, 0.5, 0.5, 0.5]
        d = torch.float64
        logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=d, requires_grad=True)
        old = logp.detach() - torch.tensor([2.0, 0.1, -2.0, 0.0], dtype=d)  # r = e², e^0.1, e^−2, 1
        adv = torch.tensor([1.0, -1.0, 1.0, 2.0], dtype=d)
        term, _, clipped, _, _ = micro_loss(logp, old, adv, w, loss, 1)
        term.backward()
        r = torch.tensor([1.28, math.exp(0.1), 0.8, 1.0], dtype=d)  # clipped to [1 − 0.2, 1 + 0.28]
        assert torch.allclose(logp.grad, -r * adv * w.to(d), rtol=1e-12)
        assert clipped == 2
    finally:
        POLICY_LOSSES.pop("cispo", None)
        LOSS_AGG_MODES.pop("sequence_sum", None)


def test_the_grader_example_grades_and_a_benchmark_can_name_it(science_examples):
    import yaml

    from stages.config import validate
    from stages.core.reward.registry import GRADERS

    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    raw["selector_modules"] = ["my_graders.py"]
    raw["datasets"]["arith-easy"]["grader"] = "last_number"
    try:
        validate(raw, "config/config.yaml")
        grades = GRADERS["last_number"].fn(["so it is 42", "", "7 or 8"], ["42", "1", "7"],
                                          ["math"] * 3, 5.0)
        assert [(g.correct, g.extracted, g.error) for g in grades] == [
            (True, "42", None), (False, None, "no_answer"), (False, "8", None)]
    finally:
        GRADERS.pop("last_number", None)


def test_the_benchmark_example_prepares(science_examples):
    """The benchmark block merged onto the default validates, and the stage's loader reads the
    example file into problems with the ids, questions and answers the page shows."""
    import yaml
    from snakemake.utils import update_config

    from stages.config import validate
    from stages.prepare_data import prepare

    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    update_config(raw, yaml.safe_load((science_examples / "my_bench.yaml").read_text()))
    cfg = validate(raw, "config/config.yaml, my_bench.yaml")
    assert "my-bench" in cfg.experiment.benchmarks
    rows = prepare(cfg, "my-bench")
    assert [(r["problem_id"], r["question"], r["answer"]) for r in rows] == [
        ("b1", "7 + 8", "15"), ("b2", "6 * 7", "42"), ("b3", "9 - 4 - 3", "2")]
    assert rows[0]["prompt"] == "Q: 7 + 8 A:"


# ---- the runner: one process for every command -------------------------------------------------

def _captured(fn) -> tuple[object, str]:
    """fn()'s value (or the exception / exit code) and what it wrote to stdout and stderr."""
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as out:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
        try:
            value = fn()
        except SystemExit as e:
            value = e.code if e.code is not None else 0
        except BaseException as e:  # noqa: BLE001 - the runner reports every failure
            value = repr(e)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out.seek(0)
        return value, out.read()


def _run(job: dict) -> dict:
    import runpy

    if job["kind"] in ("skip", "fail"):
        return {**job, "ok": False}
    old_env = dict(os.environ)
    os.environ.update({k: v.replace("$PWD", os.getcwd()) for k, v in job.get("env", {}).items()})
    try:
        if job["kind"] == "dry-run":
            from snakemake.cli import args_to_api, parse_args

            def go():
                parser, args = parse_args([*job["argv"], "--dry-run"])
                return args_to_api(args, parser)

            value, text = _captured(go)
            ok = value is True  # args_to_api's success; False (== 0) is a failure
        elif job["kind"] == "run":
            from stages.plan import main

            value, text = _captured(lambda: main(job["argv"]))
            ok = value in (0, None)
        else:  # parse: --help lists every flag used
            def helps():
                sys.argv = [job["module"], "--help"]
                runpy.run_module(job["module"], run_name="__main__", alter_sys=True)

            value, text = _captured(helps)
            missing = [f for f in job["flags"] if f not in text]
            ok = value == 0 and not missing
            if missing:
                text += f"\nnot in {job['module']} --help: {', '.join(missing)}"
            for inner in job["nested"]:
                sub = _run(inner)
                ok, text = ok and sub["ok"], text + "\n" + sub["why"]
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    return {**job, "ok": ok, "why": text[-2000:] if not ok else ""}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import time

    done = []
    for job in json.loads(sys.stdin.read()):
        start = time.perf_counter()
        done.append({**_run(job), "seconds": round(time.perf_counter() - start, 1)})
    print(json.dumps(done))
