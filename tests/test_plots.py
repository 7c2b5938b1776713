"""The token page's HTML (its layout in a browser: tests/test_browser.py)."""

from __future__ import annotations

import html
import math
import re

import pytest

from stages.core.report import plots


def tok(text: str, entropy: float = 0.5, **extra) -> dict:
    return {"text": text, "entropy": entropy, "jsd": 0.01, "logprob": -0.5, "sel_entropy20": False,
            "sel_stapo": True, "sel_ict": False, **extra}


def page(tmp_path, samples, max_entropy: float = 2.0) -> str:
    path = tmp_path / "tokens.html"
    plots.token_page(samples, path, max_entropy, "Token statistics of tiny")
    return path.read_text()


def responses(text: str) -> list[str]:
    return re.findall(r"<div class='resp'>(.*?)</div>", text, re.S)


def test_tokens_are_joined_without_separators(tmp_path):
    toks = [tok("Q"), tok(":"), tok(" 3"), tok(" +"), tok(" 4"), tok(".\n"), tok("A"), tok(" 7")]
    (resp,) = responses(page(tmp_path, [{"header": "s0", "tokens": toks}]))
    assert resp.startswith("<span") and resp.endswith("</span>")
    assert re.search(r"</span>\s+<span class='tok", resp) is None
    # the text content is the tokens' own text, their spaces and newline included
    text = html.unescape(re.sub(r"<[^>]*>", "", resp))
    assert text == "Q: 3 + 4.\nA 7"
    assert "<span class='nl'></span>\n" in resp  # the newline, with its visible mark


def test_marks_shading_and_escaping(tmp_path):
    toks = [tok("<b>'", entropy=2.0, sel_ict=True), tok(" x", entropy=0.0, sel_entropy20=True),
            tok(" y", sel_stapo=False)]
    text = page(tmp_path, [{"header": "a <header>", "tokens": toks}])
    spans = re.findall(r"<span class='(tok[^']*)' style='([^']*)' title='([^']*)'>(.*?)</span>",
                       responses(text)[0], re.S)
    assert [s[0] for s in spans] == ["tok ict", "tok ent", "tok silenced"]
    assert spans[0][1] == "--h: rgb(255,0,0)" and spans[1][1] == "--h: rgb(255,255,255)"
    assert spans[0][3] == "&lt;b&gt;&#x27;"
    assert html.unescape(spans[0][2]).splitlines() == [
        repr("<b>'"), "H = 2.000 nats, JSD = 0.0100, log p = -0.500", "ICT"]
    assert "a &lt;header&gt;" in text
    assert "id='legend'" in text and "uniqueness" not in text and "<script" not in text
    assert "3 tokens · mean H 0.833 nats · ICT picks 1, 20-Entropy 1, STAPO silences 1" in text


def test_u_in_tooltips_and_the_shading_switch(tmp_path):
    toks = [tok(" a", ict_u=0.0), tok(" b", ict_u=math.log(2)), tok(" c", ict_u=None),
            tok(" d", ict_u=float("nan")), tok(" e")]
    text = page(tmp_path, [{"header": "s0", "tokens": toks}, {"header": "s1", "tokens": [tok("z")]}])
    styles = re.findall(r"style='(--h[^']*)' title='([^']*)'", text)
    assert styles[0][0].endswith("--u: rgb(255,255,255)") and "u = 0.000 nats" in styles[0][1]
    assert styles[1][0].endswith("--u: rgb(123,87,255)")  # plots.U_TOP at u = ln 2
    assert "u = 0.693 nats" in styles[1][1]
    assert all("--u" not in s and "u =" not in t for s, t in styles[2:])
    assert "input type='radio' name='shade' value='u'" in text and "<script>" in text
    assert "mean u 0.347 nats (2 tokens with u)" in text
    # self-contained: nothing is fetched
    assert not re.search(r"(src|href)=|https?:|@import|url\(", text)


@pytest.mark.parametrize("u", [-0.01, math.log(2) + 0.01])
def test_u_outside_its_range_is_an_error(tmp_path, u):
    with pytest.raises(ValueError, match=r"token 1: ict_u = .* outside \[0, ln 2\]"):
        page(tmp_path, [{"header": "s0", "tokens": [tok("a"), tok("b", ict_u=u)]}])
