"""Every HTML output in a real browser: the token page, tables.html and the Snakemake report.

Chromium (Debian's `chromium`) is installed with apt-get when missing (root needed; otherwise the
tests are skipped and say why, or fail where ICT_RLVR_REQUIRE_BROWSER=1 as in CI). Each check
copies the page, appends a script that measures the layout after load and writes the numbers as
JSON into a <pre id="layout">, and reads them back from `chromium --headless --dump-dom`.
Screenshots go to $ICT_RLVR_SHOTS (default: /tmp/browser-shots) for a person to look at.
"""

from __future__ import annotations

import html
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from stages.core.report import plots
from stages.core.report.render import Table, html_page
from tests.conftest import ROOT, workflow_env

pytestmark = pytest.mark.slow  # runs workflows and opens their pages in Chromium: scripts/test.sh --all

CHROMIUM = "/usr/bin/chromium"
# without these Chromium reaches for the network (closed here) and hangs on it
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]
WIDTH = 1200  # px, the window of every check
SHOTS = Path(os.environ.get("ICT_RLVR_SHOTS", Path(tempfile.gettempdir()) / "browser-shots"))
# CI sets this (.ci/run): there, a browser that cannot be installed is a failure, not a skip.
REQUIRED = os.environ.get("ICT_RLVR_REQUIRE_BROWSER") == "1"


def unavailable(reason: str):
    """Skip (or, where the browser is required, fail) with the reason Chromium cannot run."""
    if REQUIRED:
        pytest.fail(f"ICT_RLVR_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium() -> str:
    """The path of Chromium, installed with apt-get when missing."""
    if not Path(CHROMIUM).exists():
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            unavailable(f"{CHROMIUM} missing, and installing it needs root and apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode:
                unavailable(f"`{' '.join(cmd)}` failed, Chromium cannot be installed: {proc.stderr[-800:]}")
        if not Path(CHROMIUM).exists():
            unavailable(f"apt-get installed chromium but {CHROMIUM} is still missing")
    SHOTS.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser screenshots: {SHOTS}", file=sys.stderr)
    return CHROMIUM


def browse(chromium: str, page: Path, *args: str, height: int = 900) -> str:
    """Chromium's stdout for `page` in a fresh profile (deleted afterwards)."""
    with tempfile.TemporaryDirectory(prefix="ict-chromium-") as profile:
        proc = subprocess.run(
            [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={WIDTH},{height}",
             "--virtual-time-budget=5000", *args, page.as_uri()],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def with_script(page: Path, folder: Path, script: str) -> Path:
    """A copy of `page` in `folder` with `script` run at load (before the last </body>: the
    report's own scripts contain the string too)."""
    text = page.read_text()
    tag = f"<script>window.addEventListener('load', () => {{ {script} }});</script>"
    at = text.rfind("</body>")
    copy = folder / f"measured-{page.name}"
    copy.write_text(text[:at] + tag + text[at:] if at >= 0 else text + tag)
    return copy


# helpers of the measuring scripts: `out` collects the numbers, `finish()` writes them where the
# dumped DOM carries them (a script may call it later, from a timer, after clicks have rendered)
PRELUDE = ("const out = {}; const finish = () => { const pre = document.createElement('pre');"
           " pre.id = 'layout'; pre.textContent = JSON.stringify(out); document.body.append(pre); };")


def measure(chromium: str, page: Path, folder: Path, script: str) -> dict:
    """Run `script` (which fills `out` and calls `finish()`) on `page` after load; `out`."""
    dom = browse(chromium, with_script(page, folder, PRELUDE + script), "--dump-dom")
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S)
    assert found, f"the measuring script left no numbers in {page}:\n{dom[-3000:]}"
    return json.loads(html.unescape(found[1]))


def screenshot(chromium: str, page: Path, name: str, height: int = 1400) -> Path:
    shot = SHOTS / name
    browse(chromium, page, f"--screenshot={shot}", height=height)
    assert shot.stat().st_size > 10_000, f"{shot} is (nearly) empty"
    return shot


# ----- the token page ----------------------------------------------------------------------------
WORDS = ("the sum of 3 and 4 is 7 , so we add 9 to get 16 ; then multiply by 2 which gives 32 "
         "and the answer is").split()
NEWLINE_AT = 10  # the token of response 1 that ends with a newline: far from where lines wrap


def token_samples() -> list[dict]:
    """Three responses of 60 byte-level tokens (leading spaces as Qwen's tokenizer decodes them);
    response 1 has a newline, responses 0 and 1 carry ICT's u, response 2 does not."""
    rng = random.Random(0)
    samples = []
    for n in range(3):
        tokens = []
        for i in range(60):
            text = (" " if i else "") + rng.choice(WORDS)
            if n == 1 and i == NEWLINE_AT:
                text = ".\n"
            tok = {"text": text, "entropy": 2 * rng.random() ** 3, "jsd": 0.1 * rng.random(),
                   "logprob": -3 * rng.random(), "sel_entropy20": rng.random() < 0.2,
                   "sel_stapo": rng.random() > 0.1, "sel_ict": rng.random() < 0.1}
            if n < 2:
                tok["ict_u"] = math.log(2) * rng.random()
            tokens.append(tok)
        samples.append({"header": f"sample {n} (advantage {(-1) ** n * 0.5:+.2f})", "tokens": tokens})
    return samples


TOKEN_JS = """
const resps = [...document.querySelectorAll('.resp')];
out.resps = resps.map(div => {
  const spans = [...div.querySelectorAll('.tok')];
  const rects = spans.map(s => s.getBoundingClientRect());
  return {tokens: spans.length, text: div.textContent,
          lines: new Set(rects.map(r => Math.round(r.top))).size,
          tops: rects.map(r => Math.round(r.top)), lefts: rects.map(r => Math.round(r.left)),
          left: Math.round(div.getBoundingClientRect().left)};
});
out.scroll_width = document.documentElement.scrollWidth;
out.client_width = document.documentElement.clientWidth;
out.legend = (document.getElementById('legend') || {}).textContent || null;
const first = document.querySelector('.resp .tok');
out.background_h = getComputedStyle(first).backgroundColor;
const u = document.querySelector('input[name=shade][value=u]');
out.has_switch = !!u;
if (u) { u.click(); out.background_u = getComputedStyle(first).backgroundColor; }
finish();
"""


def test_token_page_reads_as_running_text(chromium, tmp_path):
    samples = token_samples()
    page = tmp_path / "tokens.html"
    plots.token_page(samples, page, max_entropy=2.0, title="Token statistics of tiny-s")
    got = measure(chromium, page, tmp_path, TOKEN_JS)
    print(f"\ntokens.html at {WIDTH} px: lines per response {[r['lines'] for r in got['resps']]}, "
          f"scrollWidth {got['scroll_width']} / clientWidth {got['client_width']}", file=sys.stderr)

    assert [r["tokens"] for r in got["resps"]] == [len(s["tokens"]) for s in samples]
    for resp, sample in zip(got["resps"], samples, strict=True):
        # nothing between the tokens: the text is theirs, spaces and newline included
        assert resp["text"] == "".join(t["text"] for t in sample["tokens"])
        # ~300 characters of monospace in a ~1100 px column: 2 lines, not one per token
        assert 2 <= resp["lines"] <= 4, resp["tops"]
    nl = got["resps"][1]
    after = NEWLINE_AT + 1
    assert nl["tops"][after] > nl["tops"][NEWLINE_AT], "the newline token does not break the line"
    assert nl["lefts"][after] == nl["left"], "the token after the newline does not start a line"
    assert len(set(nl["tops"][:after])) == 1, "the text before the newline (40 chars) wraps"
    assert got["scroll_width"] <= got["client_width"], "the page overflows horizontally"
    assert "entropy" in got["legend"] and "ICT pick" in got["legend"] and "STAPO" in got["legend"]
    assert "uniqueness u" in got["legend"]
    # the u switch changes the shading of the first token (entropy red to u violet)
    assert got["has_switch"] and got["background_u"] != got["background_h"], got

    screenshot(chromium, page, "tokens.html.png")
    shaded_u = with_script(page, tmp_path, "document.querySelector('input[name=shade][value=u]').click();")
    screenshot(chromium, shaded_u, "tokens.html-u.png")


# ----- tables.html -------------------------------------------------------------------------------
TABLES_JS = """
out.client_width = document.documentElement.clientWidth;
out.scroll_width = document.documentElement.scrollWidth;
out.tables = [...document.querySelectorAll('table')].map(t => {
  const r = t.getBoundingClientRect();
  const cells = [...t.querySelectorAll('th, td')].map(c => c.getBoundingClientRect());
  return {title: t.previousElementSibling ? t.previousElementSibling.textContent : null,
          left: r.left, right: r.right, width: r.width,
          header: [...t.querySelectorAll('thead tr th')].map(c => c.textContent),
          header_height: t.querySelector('thead tr').getBoundingClientRect().height,
          row_cells: [...t.querySelectorAll('tbody tr')].map(tr => tr.cells.length),
          empty_cells: cells.filter(c => c.width < 1 || c.height < 1).length,
          bold: [...t.querySelectorAll('td b')].map(b => [b.textContent, +getComputedStyle(b).fontWeight]),
          plain: [...t.querySelectorAll('td')].filter(td => !td.querySelector('b'))
                   .map(td => +getComputedStyle(td).fontWeight)};
});
finish();
"""


def check_tables(got: dict, expected: list[tuple[str, list[str], int]]) -> None:
    """Every table drawn with its header row, full rows and bold where marked, inside the window."""
    assert [(t["title"], t["header"], len(t["row_cells"])) for t in got["tables"]] == expected
    assert got["scroll_width"] <= got["client_width"], "the page overflows horizontally"
    for t in got["tables"]:
        assert t["header_height"] > 0 and t["empty_cells"] == 0, t
        assert set(t["row_cells"]) == {len(t["header"])}, t
        assert 0 <= t["left"] and t["right"] <= got["client_width"], f"{t['title']!r} overflows"
        assert all(weight >= 600 for _, weight in t["bold"]), t["bold"]
        assert all(weight < 600 for weight in t["plain"]), t["title"]


def expected_tables(markdown: str) -> list[tuple[str, list[str], int]]:
    """(title, header cells, body rows) of each table of tables.md, the page's Markdown twin."""
    out = []
    for block in markdown.split("### ")[1:]:
        lines = block.splitlines()
        rows = [ln for ln in lines[1:] if ln.startswith("|")]
        header = [html.unescape(c.strip().replace("\\|", "|")) for c in re.split(r"(?<!\\)\|", rows[0])[1:-1]]
        out.append((lines[0].strip(), header, len(rows) - 2))
    return out


def test_bold_cells_render_bold(chromium, tmp_path):
    """The test config's untrained models tie everywhere, so bold is checked on a table of ours."""
    table = Table("Toy", ["size", "method", "bench-a", "bench-b"],
                  [["tiny", "GRPO", "10.0", "20.0"], ["tiny", "ICT", "12.5", "—"]],
                  bold=[[False, False, False, True], [False, False, True, False]], left_columns=2)
    page = tmp_path / "toy.html"
    page.write_text(html_page([table], "toy"))
    got = measure(chromium, page, tmp_path, TABLES_JS)
    check_tables(got, [("Toy", ["size", "method", "bench-a", "bench-b"], 2)])
    assert got["tables"][0]["bold"] == [["20.0", 700], ["12.5", 700]]


def test_tables_html_renders_every_table(chromium, local_test_run, tmp_path):
    wd, proc = local_test_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = wd / "results" / "test" / "tables"
    page = folder / "tables.html"
    got = measure(chromium, page, tmp_path, TABLES_JS)
    expected = expected_tables((folder / "tables.md").read_text())
    print(f"\ntables.html at {WIDTH} px: {len(got['tables'])} tables, widest "
          f"{max(t['width'] for t in got['tables']):.0f} px, scrollWidth {got['scroll_width']} / "
          f"clientWidth {got['client_width']}", file=sys.stderr)
    assert len(expected) >= 4
    check_tables(got, expected)
    screenshot(chromium, page, "tables.html.png", height=2400)


# ----- the Snakemake report ----------------------------------------------------------------------
# The report is a React app: its menu lists the categories; clicking one lists its subcategories,
# clicking a subcategory lists its files. Each click renders on a timer (virtual time here).
REPORT_JS = """
const links = () => [...document.querySelectorAll('nav a')].map(a => a.textContent.trim()).filter(t => t);
const click = text => { const a = [...document.querySelectorAll('nav a')].find(a => a.textContent.trim() === text);
                        if (a) a.click(); return !!a; };
const steps = [() => { out.start = links(); out.description = document.body.innerText; click('Figures'); },
               () => { out.figures = links(); click('Results'); },
               () => { click('Tables'); },
               () => { out.tables = links(); click('all tables'); },
               () => { out.all_tables = document.body.innerText; }];
const next = () => { steps.shift()(); if (steps.length) setTimeout(next, 300); else finish(); };
setTimeout(next, 300);
"""


def test_snakemake_report_lists_the_results(chromium, local_test_run, tmp_path):
    wd, proc = local_test_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = wd / "report.html"
    made = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(wd),
         "--configfile", str(ROOT / "config" / "test.yaml"), "--report", str(report)],
        capture_output=True, text=True, env=workflow_env(), cwd=wd, timeout=300,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    got = measure(chromium, report, tmp_path, REPORT_JS)
    print(f"\nreport menu: {got['start']}; Figures: {got['figures']}; Tables: {got['tables']}",
          file=sys.stderr)
    assert {"Workflow", "Statistics", "About", "Figures", "Tables"} <= set(got["start"]), got["start"]
    assert "token-selective RLVR" in got["description"]  # workflow/report/workflow.rst
    # subcategories of workflow/rules/common.smk (REPORT_FIGURES and report_item)
    assert {"training curves", "pass@k against k", "token entropy"} <= set(got["figures"]), got
    assert {"all tables", "CSV"} <= set(got["tables"]), got
    assert "results/test/tables/tables.html" in got["all_tables"], got["all_tables"][:2000]
    # what a person sees after the same clicks
    screenshot(chromium, with_script(report, tmp_path, PRELUDE + REPORT_JS), "report.html.png",
               height=900)
