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
    assert (t.group_size, t.prompts_per_step, t.mini_batch_prompts) == (8, 128, 32)
    assert (t.lr, t.warmup_steps, t.weight_decay, t.grad_clip) == (1e-6, 10, 0.1, 1.0)
    assert (t.loss.eps_low, t.loss.eps_high, t.loss.kl_beta) == (0.2, 0.28, 0.0)
    assert (t.temperature, t.top_p, t.max_response_tokens) == (1.0, 1.0, 4096)
    assert (e.temperature, e.top_p, e.n, e.max_new_tokens, e.k) == (0.6, 0.95, 8, 4096, [1, 4])
    assert cfg.datasets["math-l3to5"].source.levels == [3, 4, 5]


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
        ("train_dataset", "arith-easy", "experiment.train_dataset.0: dataset 'arith-easy' has role 'benchmark'"),
    ],
)
def test_grid_references_must_resolve(default_raw, key, value, expect):
    default_raw["experiment"][key] = value
    assert f"cfg.yaml: {expect}" in errors_of(default_raw)


def test_selector_parameters_must_fit(default_raw):
    default_raw["methods"]["grpo"]["rho"] = 0.2
    assert "methods.grpo: selector 'all' takes no ['rho']" in errors_of(default_raw)
    del default_raw["methods"]["grpo"]["rho"]
    del default_raw["methods"]["ict"]["variant"]
    assert "methods.ict: selector 'ict' needs ['variant']" in errors_of(default_raw)


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
    assert "evaluate: every k must be in [1, n=8]" in errors_of(default_raw)


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
