"""The front page and the manual: every relative link resolves (files and #anchors), the README's
first shell block holds the two set-up commands, and the tables of GPUs per job in the docs are
the configs' own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    out = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"^#{1,6}\s+(.*)$", line):
            text = re.sub(r"`", "", m.group(1)).strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a link
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target} (no {where.relative_to(ROOT) if ROOT in where.parents else where})")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target} (no heading #{anchor} in {where.name})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_starts_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    assert first, "the README has no shell block"
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    assert commands == ["bash scripts/run_default.sh", "bash scripts/test.sh"]
    assert len(text.splitlines()) <= 250, "the README is a front page: the manual lives in docs/"


def test_the_link_checker_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n[ok](#title) [bad](#nowhere) [gone](missing.md) `[x](y.md)`\n")
    assert links(page) == ["#title", "#nowhere", "missing.md"]
    assert anchors(page) == {"title"}


@pytest.mark.parametrize("config", ["paper.yaml", "beyond-80-20.yaml"])
def test_the_docs_tables_of_job_requests_are_the_configs(config):
    """docs/cluster.md prints what each job asks for, generated from the config
    (python -m stages.plan --configfile config/<file> --requests): the two cannot disagree."""
    from stages.config import load_config
    from stages.plan import requests_table

    table = requests_table(load_config(ROOT / "config" / config))
    assert table in (ROOT / "docs" / "cluster.md").read_text(), (
        f"docs/cluster.md: the table of config/{config} is not the config's; regenerate it with "
        f"python -m stages.plan --configfile config/{config} --requests")


@pytest.mark.parametrize("config, gpu_gb", [("paper.yaml", None), ("paper.yaml", 141.0),
                                            ("beyond-80-20.yaml", None)])
def test_the_docs_memory_plans_are_the_configs(config, gpu_gb):
    """docs/plan.md prints the memory plan of both reproductions as committed."""
    from stages.config import load_config
    from stages.plan import plan, render

    text = render(plan(load_config(ROOT / "config" / config), gpu_gb, None))
    assert text.rstrip("\n") in (ROOT / "docs" / "plan.md").read_text(), (
        f"docs/plan.md: the plan of config/{config} is out of date; regenerate it with "
        f"python -m stages.plan --configfile config/{config}"
        + (f" --gpu-memory-gb {gpu_gb:g}" if gpu_gb else ""))


@pytest.fixture(scope="module")
def cost_plans():
    from stages.cost_report import docs_plans

    return docs_plans(ROOT)


@pytest.mark.parametrize("page", ["README.md", "docs/cluster.md"])
def test_the_cost_totals_in_the_docs_are_the_configs(page):
    """The reproductions' estimated totals (python -m stages.plan --cost), with their papers'
    ablations and their pilots, at the top of the cluster page and in the README's runs:
    regenerate with scripts/regen_plan_docs.py."""
    from stages.cost_report import summary_plans, summary_table

    assert summary_table(summary_plans(ROOT)) in (ROOT / page).read_text(), (
        f"{page}: the cost totals are out of date; run scripts/regen_plan_docs.py")


def test_the_docs_trainings_and_cost_plans_are_the_configs(cost_plans):
    from stages.config import load_config
    from stages.cost_report import render, train_table

    assert train_table(cost_plans) in (ROOT / "docs" / "cluster.md").read_text(), (
        "docs/cluster.md: the trainings' attempts are out of date; run scripts/regen_plan_docs.py")
    page = (ROOT / "docs" / "cost.md").read_text()
    for p in cost_plans:
        assert render(p, load_config(ROOT / p.source)) in page, (
            f"docs/cost.md: the cost plan of {p.source} is out of date; run scripts/regen_plan_docs.py")


OURS = re.compile(r"\bours\b", re.I)


def unmarked_ours(text: str) -> list[str]:
    """Comment lines that call a choice ours other than with the one marker, '# ours:' (quoted
    labels such as "(ours, not ICT)" are names shown in tables, not markers)."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        line = re.sub(r'"[^"]*"', '""', line)
        if "#" not in line:
            continue
        comment = line[line.index("#"):]
        if any(comment[max(0, m.start() - 2):m.end() + 1] != "# ours:" for m in OURS.finditer(comment)):
            bad.append(f"{n}: {line.strip()}")
    return bad


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "config").glob("*.yaml")))
def test_every_choice_that_is_ours_has_one_greppable_marker(config):
    """`grep -n '# ours:' config/<file>` lists every choice the papers leave open."""
    bad = unmarked_ours((ROOT / "config" / config).read_text())
    assert not bad, f"config/{config}: write '# ours:' at the choice:\n  " + "\n  ".join(bad)


def test_the_marker_check_can_fail():
    assert unmarked_ours("a: 1  # ours (not found)\nb: 2  # Ours: x\nc: {label: \"x (ours)\"}\n") == [
        "1: a: 1  # ours (not found)", "2: b: 2  # Ours: x"]
    assert unmarked_ours("a: 1  # ours: not found; veRL's\n# x. # ours: y\n") == []


def test_the_config_reference_is_the_config_models():
    """docs/config-reference.md is generated from stages/config/'s fields: regenerate it with
    python scripts/config_reference.py after changing a field."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert module.render() == page, (
        "docs/config-reference.md is out of date: run python scripts/config_reference.py")
    assert "| `checkpoint_every` |" in page and "| `overlap_top` |" in page
