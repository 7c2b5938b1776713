"""The config model: both shipped configs validate; every kind of mistake names file and key."""

from __future__ import annotations

import copy

import pytest
import yaml

from stages.config import ConfigError, load_config, validate
from tests.conftest import ROOT, write_yaml


@pytest.mark.parametrize("name", ["config.yaml", "paper.yaml", "test.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(ROOT / "config" / name)
    assert cfg.experiment.sizes and cfg.experiment.methods and cfg.experiment.benchmarks


def test_paper_config_has_the_reconstructed_setup():
    cfg = load_config(ROOT / "config" / "paper.yaml")
    assert [cfg.models[s].hub.model_id for s in cfg.experiment.sizes] == [
        "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B"]
    assert cfg.experiment.methods == ["grpo", "entropy20", "stapo", "ict"]
    assert len(cfg.experiment.benchmarks) == 7
    t, e = cfg.train, cfg.evaluate
    # METHODS §8: G 8, mini-batch 16, micro-batch 4, 2 PPO epochs, lr 1e-6 (7B 2e-6), T 0.6,
    # KL 0.001, bf16, gradient checkpointing, 512 / 2,048 response tokens, 5 seeds
    assert (t.group_size, t.prompts_per_step, t.mini_batch_prompts) == (8, 128, 16)
    assert (t.micro_batch_size, t.ppo_epochs, t.dtype, t.gradient_checkpointing) == (4, 2, "bfloat16", True)
    assert (t.lr, t.warmup_steps, t.weight_decay, t.grad_clip) == (1e-6, 0, 0.01, 1.0)
    assert cfg.models["qwen2.5-7b"].lr == 2e-6 and cfg.models["qwen2.5-0.5b"].lr is None
    assert (t.loss.eps_low, t.loss.eps_high, t.loss.kl_beta, t.loss.denominator) == (0.2, 0.2, 0.001, "sequence")
    assert (t.temperature, t.top_p, t.max_response_tokens) == (0.6, 1.0, 2048)
    assert cfg.experiment.train_datasets == ["gsm8k-train", "math-train"]
    assert [cfg.datasets[d].max_response_tokens for d in cfg.experiment.train_datasets] == [512, 2048]
    assert cfg.experiment.seeds == [0, 1, 2, 3, 4]
    assert (e.temperature, e.top_p, e.n, e.max_new_tokens, e.k) == (0.6, 0.95, 8, 2048, [1, 4])
    ict = cfg.methods["ict"]
    assert (ict.selector, ict.selector_params()["variant"], ict.warmup_steps, ict.rescore) == ("ict", "paper", 20, False)
    assert cfg.token_stats.dtype == "bfloat16"


def errors_of(raw, source="cfg.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw, source)
    return str(info.value)


def test_unknown_key_names_file_and_key(default_raw):
    default_raw["train"]["learning_rate"] = 1e-3
    assert "cfg.yaml: train.learning_rate: unknown key" in errors_of(default_raw)


def test_unknown_top_level_key(default_raw):
    default_raw["trian"] = {}
    assert "cfg.yaml: trian: unknown key" in errors_of(default_raw)


def test_wrong_type_names_the_key(default_raw):
    default_raw["train"]["steps"] = "many"
    msg = errors_of(default_raw)
    assert "cfg.yaml: train.steps:" in msg and "integer" in msg


def test_string_looking_float_is_not_coerced(default_raw):
    # YAML 1.1 reads 1e-6 (no dot) as a string: refuse it rather than guess
    default_raw["train"]["lr"] = "1e-6"
    assert "cfg.yaml: train.lr:" in errors_of(default_raw)


def test_out_of_range_value(default_raw):
    default_raw["methods"]["ict"]["rho"] = 1.5
    assert "cfg.yaml: methods.ict.rho:" in errors_of(default_raw)


@pytest.mark.parametrize(
    "key, value, expect",
    [
        ("methods", ["grpo", "ppo"], "experiment.methods.1: unknown name 'ppo'"),
        ("sizes", ["tiny-s", "huge"], "experiment.sizes.1: unknown name 'huge'"),
        ("benchmarks", ["aime99"], "experiment.benchmarks.0: unknown name 'aime99'"),
        ("benchmarks", ["rl"], "experiment.benchmarks.0: dataset 'rl' has role 'train'"),
        ("train_datasets", ["rl", "arith-easy"], "experiment.train_datasets.1: dataset 'arith-easy' has role 'benchmark'"),
    ],
)
def test_grid_references_must_resolve(default_raw, key, value, expect):
    default_raw["experiment"][key] = value
    assert f"cfg.yaml: {expect}" in errors_of(default_raw)


def test_selector_parameters_must_fit(default_raw):
    default_raw["methods"]["grpo"]["rho"] = 0.2
    assert "cfg.yaml: methods.grpo.rho: unknown key" in errors_of(default_raw)
    del default_raw["methods"]["grpo"]["rho"]
    for key, value in (("rho", 0.0), ("rho", 1.01), ("part", "middle")):
        bad = copy.deepcopy(default_raw)
        bad["methods"]["ict"][key] = value
        assert f"cfg.yaml: methods.ict.{key}:" in errors_of(bad)
    # unset parameters take the registered defaults (METHODS §3)
    del default_raw["methods"]["ict"]["variant"], default_raw["methods"]["ict"]["rho"]
    cfg = validate(default_raw, "cfg.yaml")
    assert cfg.methods["ict"].selector_params() == {"rho": 0.1, "variant": "paper", "part": "unique"}
    assert cfg.methods["ict"].needs() == {"group_jsd"}


def test_warm_up_must_be_shorter_than_the_run(default_raw):
    default_raw["methods"]["ict"]["warmup_steps"] = default_raw["train"]["steps"]
    assert "cfg.yaml: methods.ict.warmup_steps: a dense warm-up of 60 steps" in errors_of(default_raw)
    # a preset outside experiment.methods is not checked against this run's length
    default_raw["methods"]["ict"]["warmup_steps"] = 6
    default_raw["methods"]["ict-warmup12"]["warmup_steps"] = 100
    validate(default_raw, "cfg.yaml")


USER_SELECTOR = """
import torch
from pydantic import Field
from stages.core.training.selectors import Params, SelectionInput, register_selector


class SurpriseParams(Params):
    threshold: float = Field(2.0, gt=0, description="nats")


@register_selector("surprise", needs=("logprob",), params=SurpriseParams)
def select_surprise(inp: SelectionInput, threshold: float = 2.0) -> torch.Tensor:
    return inp.valid & (-inp.need("logprob") > threshold)
"""


def test_a_users_selector_module_is_one_file(default_raw, tmp_path):
    from stages.core.training.selectors import SELECTORS

    path = tmp_path / "my_selectors.py"
    path.write_text(USER_SELECTOR)
    default_raw["selector_modules"] = [str(path)]
    default_raw["methods"]["surprise"] = {"selector": "surprise", "threshold": 3.0}
    default_raw["experiment"]["methods"].append("surprise")
    try:
        cfg = validate(default_raw, "cfg.yaml")
        assert cfg.methods["surprise"].needs() == {"logprob"}
        assert cfg.methods["surprise"].selector_params() == {"threshold": 3.0}
        validate(default_raw, "cfg.yaml")  # loading the config again imports nothing twice
        default_raw["methods"]["surprise"]["threshold"] = -1.0
        assert "cfg.yaml: methods.surprise.threshold:" in errors_of(default_raw)
    finally:
        SELECTORS.pop("surprise", None)
    default_raw["selector_modules"] = [str(tmp_path / "missing.py")]
    assert "cfg.yaml: selector_modules.0: cannot import" in errors_of(default_raw)


def test_unknown_selector_and_variant(default_raw):
    default_raw["methods"]["ict"]["variant"] = "vibes"
    assert "methods.ict.variant:" in errors_of(default_raw)
    default_raw["methods"]["ict"]["variant"] = "token_id"
    default_raw["methods"]["ict"]["selector"] = "magic"
    assert "methods.ict.selector:" in errors_of(default_raw)


def test_dataset_source_errors(default_raw):
    default_raw["datasets"]["rl"]["source"]["max_terms"] = 1
    assert "datasets.rl.source.max_terms:" in errors_of(default_raw)
    default_raw["datasets"]["rl"]["source"] = {"kind": "ftp", "url": "x"}
    assert "datasets.rl.source:" in errors_of(default_raw)
    default_raw["datasets"]["rl"]["source"] = {"kind": "local", "adapter": "gsm8k"}
    assert "datasets.rl.source.path:" in errors_of(default_raw)


def test_template_must_exist_and_hold_question(default_raw):
    default_raw["datasets"]["rl"]["template"] = "nope"
    assert "datasets.rl.template: unknown template 'nope'" in errors_of(default_raw)
    default_raw["datasets"]["rl"]["template"] = "arith"
    default_raw["templates"]["arith"] = "Q: A:"
    assert "templates.arith: a template must contain '{question}'" in errors_of(default_raw)


def test_model_source_blocks(default_raw):
    del default_raw["models"]["tiny-s"]["sft"]
    assert "models.tiny-s: source 'scratch' needs the blocks" in errors_of(default_raw)
    default_raw["models"]["tiny-s"]["scratch"]["num_attention_heads"] = 7
    assert "models.tiny-s.scratch: hidden_size must be a multiple" in errors_of(default_raw)


def test_names_cannot_break_paths(default_raw):
    default_raw["methods"]["a/b"] = {"selector": "all"}
    assert "methods.a/b.[key]:" in errors_of(default_raw)


def test_k_must_fit_n(default_raw):
    default_raw["evaluate"]["k"] = [1, 16]
    n = default_raw["evaluate"]["n"]
    assert f"evaluate.k: every k must be in [1, n={n}]" in errors_of(default_raw)


def test_several_errors_are_all_reported(default_raw):
    default_raw["train"]["steps"] = -1
    default_raw["rollout"]["n"] = 0
    msg = errors_of(default_raw)
    assert "train.steps" in msg and "rollout.n" in msg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    write_yaml(bad, [1, 2])
    with pytest.raises(ConfigError, match="bad.yaml: the config must be a mapping"):
        load_config(bad)


def test_section_hash_tracks_only_its_section(default_raw):
    a = validate(default_raw, "a")
    default_raw["methods"]["ict"]["rho"] = 0.2
    b = validate(default_raw, "b")
    assert a.section_hash("methods/ict") != b.section_hash("methods/ict")
    assert a.section_hash("methods/grpo", "train") == b.section_hash("methods/grpo", "train")
    # dots in names (qwen2.5-7b) do not split the path
    paper = load_config(ROOT / "config" / "paper.yaml")
    assert paper.section_hash("models/qwen2.5-7b") != paper.section_hash("models/qwen2.5-0.5b")


def test_vllm_jobs_get_their_tensor_parallel_gpus():
    raw = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
    validate(copy.deepcopy(raw), "paper.yaml")  # 7B: tensor parallel 2 on 2 GPUs per job
    bad = copy.deepcopy(raw)
    bad["models"]["qwen2.5-7b"]["gpus"]["evaluate"] = 1
    assert ("paper.yaml: models.qwen2.5-7b.tensor_parallel_size: 2 GPUs of tensor parallelism, but "
            "gpus.evaluate gives the evaluate job 1 (evaluate.backend is vllm)") in errors_of(bad, "paper.yaml")
    bad["evaluate"]["backend"] = "hf"  # transformers on one device: no tensor parallelism to fit
    validate(bad, "paper.yaml")
