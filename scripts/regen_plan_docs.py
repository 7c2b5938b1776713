"""Rewrite the generated plan blocks of docs/plan.md from the committed configs (the fenced blocks
after each '## config/...' heading), as tests/test_docs.py checks them."""
import re
import sys
from pathlib import Path

from stages.config import load_config
from stages.plan import plan, render

ROOT = Path(__file__).resolve().parents[1]
page = ROOT / "docs" / "plan.md"
text = page.read_text()
for config, gpu_gb, heading in [("paper.yaml", None, "## config/paper.yaml as committed"),
                                ("paper.yaml", 141.0, "## config/paper.yaml on H200s"),
                                ("beyond-80-20.yaml", None, "## config/beyond-80-20.yaml as committed")]:
    start = text.index(heading)
    fence = text.index("```\n", start)
    end = text.index("```\n", fence + 4)
    block = render(plan(load_config(ROOT / "config" / config), gpu_gb, None)).rstrip("\n") + "\n"
    text = text[: fence + 4] + block + text[end:]
page.write_text(text)
sys.exit(0)
