"""Rewrite the generated blocks of the docs from the committed configs, as tests/test_docs.py checks
them: docs/plan.md's memory plans and docs/cost.md's cost plans (the fenced blocks after each
'## config/...' heading), and the cost tables between '<!-- generated: NAME -->' and
'<!-- end: NAME -->' in README.md and docs/cluster.md."""
import sys
from pathlib import Path

from stages import cost_report
from stages.config import load_config
from stages.plan import plan, render

ROOT = Path(__file__).resolve().parents[1]


def fenced(text: str, heading: str, block: str) -> str:
    """`text` with the first fenced block after `heading` replaced by `block`."""
    start = text.index(heading)
    fence = text.index("```\n", start)
    end = text.index("```\n", fence + 4)
    return text[: fence + 4] + block.rstrip("\n") + "\n" + text[end:]


def between(text: str, name: str, block: str) -> str:
    """`text` with what lies between the markers of `name` replaced by `block`."""
    begin, end = f"<!-- generated: {name} -->\n", f"<!-- end: {name} -->"
    start = text.index(begin) + len(begin)
    return text[:start] + block.rstrip("\n") + "\n" + text[text.index(end, start):]


def rewrite(path: Path, edit) -> None:
    path.write_text(edit(path.read_text()))


def memory(text: str) -> str:
    for config, gpu_gb, heading in [("paper.yaml", None, "## config/paper.yaml as committed"),
                                    ("paper.yaml", 141.0, "## config/paper.yaml on H200s"),
                                    ("beyond-80-20.yaml", None, "## config/beyond-80-20.yaml as committed")]:
        text = fenced(text, heading, render(plan(load_config(ROOT / "config" / config), gpu_gb, None)))
    return text


plans = cost_report.docs_plans(ROOT)


def cost_page(text: str) -> str:
    for p in plans:
        text = fenced(text, f"## {p.source}", cost_report.render(p, load_config(ROOT / p.source)))
    return text


rewrite(ROOT / "docs" / "plan.md", memory)
rewrite(ROOT / "docs" / "cost.md", cost_page)
summary = cost_report.summary_table(cost_report.summary_plans(ROOT))
rewrite(ROOT / "README.md", lambda t: between(t, "cost-summary", summary))
rewrite(ROOT / "docs" / "cluster.md", lambda t: between(
    between(t, "cost-summary", summary), "cost-trainings", cost_report.train_table(plans)))
sys.exit(0)
