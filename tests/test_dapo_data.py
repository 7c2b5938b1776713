"""DAPO-Math-17k: the `dapo_math` adapter on real-shape fixtures, deduplication, and the guard
against wrapping the "Answer:" instruction twice (METHODS §9).

The fixtures (tests/fixtures/benchmarks/dapo_math_17k.{parquet,jsonl}, written by
make_dapo_math.py) hold three problems we wrote, each 4 times under one id, in the data set's
schema. Rows 1-12 visit the problems in the orders P1 P2 P3 | P3 P1 P2 | P2 P3 P1 | P1 P3 P2.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.config import ConfigError, LocalSource
from stages.core.data.adapters import ADAPTERS, AdapterError, load_local
from stages.prepare_data import check_instruction_once
from tests.conftest import run_stage, write_yaml

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"
PARQUET = FIXTURES / "dapo_math_17k.parquet"
JSONL = FIXTURES / "dapo_math_17k.jsonl"

P1, P2, P3 = ("3f1c9a52-7d4e-4b8a-9c61-2e5f0a7b8d13", "c84e2b17-5a09-4f3d-b6e2-91d7c0a4f558",
              "0b6d7e94-e2a1-4c5f-8d3b-6a9f1c2e7b40")
# P2's user message, copied by hand from the data set's instruction and our problem
P2_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "Let $r$ and $s$ be the roots of $x^2 + 7x + 10 = 0$. Find the value of $r + s - rs$.\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
GOLD = "reward_model.ground_truth"


def load(path: Path, **kwargs) -> list:
    return load_local(LocalSource(path=str(path), adapter="dapo_math", **kwargs), "dapo-math")


def dapo_record(index: str | None, problem: str, answer) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": f"Solve it.\n\n{problem}", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------------------------------
# The fixtures
# ---------------------------------------------------------------------------------------------


def test_fixtures_are_what_their_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_dapo_math", FIXTURES / "make_dapo_math.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    parquet, jsonl = script.write(tmp_path)
    assert pq.read_table(parquet).equals(pq.read_table(PARQUET))
    assert jsonl.read_text() == JSONL.read_text()


def test_parquet_fixture_has_the_data_sets_schema():
    schema = pq.read_schema(PARQUET)
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    assert pa.types.is_list(schema.field("prompt").type)
    assert schema.field("prompt").type.value_type == message
    assert schema.field("reward_model").type == pa.struct(
        [("ground_truth", pa.string()), ("style", pa.string())])
    assert schema.field("extra_info").type == pa.struct([("index", pa.string())])
    frame = pl.read_parquet(PARQUET)
    assert frame.height == 12
    assert frame["extra_info"].struct.field("index").value_counts()["count"].to_list() == [4, 4, 4]


# ---------------------------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [PARQUET, JSONL], ids=["parquet", "jsonl"])
def test_dapo_math_reads_the_fixture(path):
    problems = load(path, deduplicate=True)
    assert [p.problem_id for p in problems] == [P1, P2, P3]
    assert [p.answer for p in problems] == ["45", "-17", "41"]
    assert problems[1].question == P2_PROMPT  # the instruction stays: the records carry it
    assert {p.answer_type for p in problems} == {"math"}
    assert {p.source for p in problems} == {"dapo-math"}
    assert {(p.choices, p.solution, p.level, p.prompt) for p in problems} == {(None, None, None, "")}


def test_dapo_math_is_registered():
    assert "dapo_math" in ADAPTERS


def test_gold_is_kept_as_the_record_writes_it():
    # math_dapo normalises the gold itself; "1,000\n" would keep its comma there, so no stripping
    for gold in ["1,000\n", " 34", "\\frac{1}{2}", "27.0"]:
        problem = ADAPTERS["dapo_math"](dapo_record("u", "q", gold), 0, {}, "t")
        assert problem.answer == gold


def test_id_falls_back_to_the_position():
    record = dapo_record(None, "q", "1")
    assert ADAPTERS["dapo_math"](record, 7, {}, "t").problem_id == "7"
    del record["extra_info"]
    assert ADAPTERS["dapo_math"](record, 8, {}, "t").problem_id == "8"


def test_fields_mapping_reads_a_flat_copy():
    record = {"problem": "Solve it.\n\nFind 3+4.", "solution": "7", "uid": "k9"}
    fields = {"question": "problem", "answer": "solution", "id": "uid"}
    problem = ADAPTERS["dapo_math"](record, 0, fields, "t")
    assert (problem.problem_id, problem.question, problem.answer) == ("k9", "Solve it.\n\nFind 3+4.",
                                                                     "7")
    with pytest.raises(AdapterError, match=r"unknown field\(s\) \['gold'\]"):
        ADAPTERS["dapo_math"](record, 0, {"gold": "solution"}, "t")


def test_a_system_turn_is_an_error_not_dropped():
    record = dapo_record("u", "q", "1")
    record["prompt"].insert(0, {"content": "Be brief.", "role": "system"})
    with pytest.raises(AdapterError, match=r"one user message, got roles \['system', 'user'\]"):
        ADAPTERS["dapo_math"](record, 0, {}, "t")


@pytest.mark.parametrize(("reward_model", "message"), [
    ({"style": "rule-lighteval/MATH_v2"}, f"missing field '{GOLD}'"),
    ({"ground_truth": None, "style": "rule-lighteval/MATH_v2"}, f"null field '{GOLD}'"),
    ({"ground_truth": "", "style": "rule-lighteval/MATH_v2"}, f"empty field '{GOLD}'"),
    ({"ground_truth": "  ", "style": "rule-lighteval/MATH_v2"}, f"empty field '{GOLD}'"),
    ({"ground_truth": 34, "style": "rule-lighteval/MATH_v2"}, f"field '{GOLD}' must be a string"),
])
def test_a_record_without_gold_names_file_and_line(tmp_path, reward_model, message):
    good = dapo_record("a", "first", "1")
    bad = {**dapo_record("b", "second", "2"), "reward_model": reward_model}
    path = write_jsonl(tmp_path / "dapo.jsonl", [good, bad])
    with pytest.raises(AdapterError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}:2: {message}")
    assert str(err.value).endswith("(adapter 'dapo_math')")


@pytest.mark.parametrize("gold", [None, ""])
def test_a_parquet_row_without_gold_names_the_row(tmp_path, gold):
    rows = [dapo_record("a", "first", "1"), dapo_record("b", "second", "2"),
            dapo_record("c", "third", gold)]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    kind = "null" if gold is None else "empty"
    with pytest.raises(AdapterError, match=rf"dapo\.parquet: row 3: {kind} field '{GOLD}'.*"
                                           r"\(adapter 'dapo_math'\)"):
        load(path, deduplicate=True)


# ---------------------------------------------------------------------------------------------
# Deduplication
# ---------------------------------------------------------------------------------------------


def test_repeated_ids_without_deduplicate_are_an_error_with_a_hint():
    # off by default: row 4 is P3's second copy, under P3's id
    assert LocalSource(path="x.jsonl", adapter="dapo_math").deduplicate is False
    with pytest.raises(AdapterError) as err:
        load(PARQUET)
    assert str(err.value).startswith(
        f"{PARQUET}: row 4: duplicate problem_id '{P3}' (first at {PARQUET}: row 3; "
        "adapter 'dapo_math'); the record repeats that one's question: `deduplicate: true`")


def test_deduplicate_keeps_first_copies_and_logs_the_count(caplog):
    with caplog.at_level(logging.INFO, logger="stages.core.data.adapters"):
        problems = load(JSONL, deduplicate=True)
    assert [p.problem_id for p in problems] == [P1, P2, P3]
    assert "dropped 9 duplicate record(s)" in caplog.text
    assert "another gold answer" not in caplog.text


def test_deduplicate_compares_questions_not_ids(tmp_path, caplog):
    # the same text under other ids (and once with another gold): the first copy wins
    records = [dapo_record("a1", "A", "1"), dapo_record("b1", "B", "2"),
               dapo_record("a2", "A", "1"), dapo_record("c1", "C", "3"),
               dapo_record("b2", "B", "5"), dapo_record("d1", "A ", "4")]
    path = write_jsonl(tmp_path / "copies.jsonl", records)
    assert [p.problem_id for p in load(path)] == ["a1", "b1", "a2", "c1", "b2", "d1"]
    with caplog.at_level(logging.INFO, logger="stages.core.data.adapters"):
        problems = load(path, deduplicate=True)
    # "A " is another question: the text is compared as the adapter returns it
    assert [(p.problem_id, p.answer) for p in problems] == [("a1", "1"), ("b1", "2"), ("c1", "3"),
                                                            ("d1", "4")]
    assert "dropped 2 duplicate record(s)" in caplog.text
    assert (f"1 dropped duplicate(s) had another gold answer than the copy kept: {path}:5 ('5'; "
            f"kept '2' of {path}:2)") in caplog.text


def test_limit_counts_distinct_problems():
    assert [p.problem_id for p in load(PARQUET, deduplicate=True, limit=2)] == [P1, P2]


def test_deduplicate_works_for_every_adapter(tmp_path):
    record = {"question": "2+2?", "answer": "#### 4"}
    path = write_jsonl(tmp_path / "gsm.jsonl", [record, {**record, "answer": "#### 4"}, record])
    src = LocalSource(path=str(path), adapter="gsm8k", deduplicate=True)
    assert [p.problem_id for p in load_local(src, "gsm")] == ["0"]


# ---------------------------------------------------------------------------------------------
# Wrap the instruction once
# ---------------------------------------------------------------------------------------------

CHAT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
DAPO_TEMPLATE = ("<|im_start|>user\nSolve the following math problem step by step. The last line "
                 "of your response should be of the form Answer: $Answer (without quotes) where "
                 "$Answer is the answer to the problem.\n\n{question}\n\nRemember to put your answer "
                 "on its own line after \"Answer:\".<|im_end|>\n<|im_start|>assistant\n")


def test_check_instruction_once_on_rows():
    once = {"problem_id": "p", "prompt": DAPO_TEMPLATE.replace("{question}", "Find 1+1.")}
    check_instruction_once([once], "bench", "dapo")
    twice = {"problem_id": "q", "prompt": DAPO_TEMPLATE.replace("{question}", P2_PROMPT)}
    with pytest.raises(ConfigError, match=r"^datasets\.train\.template: .*twice \(template 'dapo', "
                                          r"problem 'q'"):
        check_instruction_once([once, twice], "train", "dapo")


def dapo_config(tmp_path, test_raw, template: str) -> Path:
    test_raw["templates"].update(chat=CHAT, dapo=DAPO_TEMPLATE)
    test_raw["datasets"]["dapo-math"] = {
        "role": "train", "template": template,
        "source": {"kind": "local", "path": str(PARQUET), "adapter": "dapo_math",
                   "deduplicate": True},
    }
    return write_yaml(tmp_path / "c.yaml", test_raw)


def test_stage_refuses_the_instruction_twice_and_writes_nothing(tmp_path, test_raw):
    cfg = dapo_config(tmp_path, test_raw, "dapo")
    out = tmp_path / "out" / "problems.parquet"
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "dapo-math", "--out", str(out))
    assert proc.returncode == 2
    assert ('error: datasets.dapo-math.template: the prompt carries the "Answer:" instruction twice '
            f"(template 'dapo', problem '{P1}'; the records already carry it; use a template "
            "without it)") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_stage_wraps_dapo_records_in_the_chat_template_once(tmp_path, test_raw):
    cfg = dapo_config(tmp_path, test_raw, "chat")
    out = tmp_path / "problems.parquet"
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "dapo-math", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    frame = pl.read_parquet(out)
    assert frame["problem_id"].to_list() == [P1, P2, P3]
    assert frame["prompt"][1] == f"<|im_start|>user\n{P2_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert frame["answer"].to_list() == ["45", "-17", "41"]
