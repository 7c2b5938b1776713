"""The policy-loss and loss-aggregation registries (stages.core.training.losses): the built-ins, a
registered loss and mode reaching the actor's micro_loss and loss_weights, and the config's check
of train.loss.policy_loss / train.loss.denominator."""

from __future__ import annotations

import pytest
import torch
import yaml

from stages.config import ConfigError, Loss, validate
from stages.core.training.actor import micro_loss
from stages.core.training.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    clipped_surrogate,
    loss_weights,
    policy_loss_fn,
    register_loss_agg_mode,
    register_policy_loss,
)
from stages.keys import train_config_hash, train_result_config
from tests.conftest import ROOT

D = torch.float64


@pytest.fixture
def toy():
    """A toy policy loss ℓ = −Â · log p (REINFORCE, nothing clipped) and a toy mode w = m (the
    plain sum), registered for one test."""

    @register_policy_loss("toy_reinforce")
    def toy_reinforce(logprob, old_logprob, advantages, cfg):
        return -advantages * logprob, torch.zeros_like(logprob, dtype=torch.bool)

    @register_loss_agg_mode("toy_sum")
    def toy_sum(m, counts):
        return m

    yield
    POLICY_LOSSES.pop("toy_reinforce", None)
    LOSS_AGG_MODES.pop("toy_sum", None)


def default_raw() -> dict:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def test_the_built_ins_are_registered_and_ppo_clip_is_the_clipped_surrogate():
    assert "ppo_clip" in POLICY_LOSSES and Loss().policy_loss == "ppo_clip"
    assert list(LOSS_AGG_MODES)[:3] == ["selected", "all", "sequence"]
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(64, generator=g, dtype=D) for _ in range(3))
    cfg = Loss(eps_low=0.1, eps_high=0.3, dual_clip=3.0)
    loss, clipped = policy_loss_fn("ppo_clip")(logp, old, adv, cfg)
    want, want_clipped = clipped_surrogate(logp, old, adv, 0.1, 0.3, 3.0)
    assert torch.equal(loss, want) and torch.equal(clipped, want_clipped)
    with pytest.raises(KeyError, match="unknown policy loss 'nope'"):
        policy_loss_fn("nope")


def test_a_registered_loss_and_mode_reach_the_actor(toy):
    """micro_loss computes the loss train.loss.policy_loss names, and loss_weights the mode
    train.loss.denominator names."""
    valid = torch.tensor([[True, True, True], [True, True, False]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    w = loss_weights(mask, valid, "toy_sum", dtype=D)[valid]
    assert w.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    logp = torch.tensor([-0.5, -1.0, -2.0, -0.1, -3.0], dtype=D, requires_grad=True)
    adv = torch.tensor([1.0, 2.0, -1.0, 0.5, 2.0], dtype=D)
    cfg = Loss(policy_loss="toy_reinforce", denominator="toy_sum")
    term, value, clipped, _, _ = micro_loss(logp, logp.detach() + 0.7, adv, w, cfg, 1)
    assert value == pytest.approx(0.5 * 1 - 2.0 * 1 + 3.0 * 2)  # Σ w (−Â log p)
    assert clipped == 0
    term.backward()
    assert logp.grad.tolist() == pytest.approx((-adv * w).tolist())
    # the default loss on the same tokens differs: the lookup, not a fixed function, decides
    _, default_value, _, _, _ = micro_loss(logp.detach(), logp.detach() + 0.7, adv, w, Loss(), 1)
    assert default_value != pytest.approx(value)


def test_the_config_names_the_key_of_an_unknown_loss_or_mode(toy):
    raw = default_raw()
    raw["train"]["loss"]["policy_loss"] = "toy_reinforce"
    raw["train"]["loss"]["denominator"] = "toy_sum"
    cfg = validate(raw, "config/config.yaml")
    assert (cfg.train.loss.policy_loss, cfg.train.loss.denominator) == ("toy_reinforce", "toy_sum")
    raw["train"]["loss"]["policy_loss"] = "gspo"
    with pytest.raises(ConfigError, match=r"config/config.yaml: train\.loss\.policy_loss: unknown "
                       r"policy loss 'gspo'; registered: \[.*'ppo_clip'"):
        validate(raw, "config/config.yaml")
    raw = default_raw()
    raw["methods"]["grpo"]["train"] = {"loss": {"denominator": "tokens"}}
    with pytest.raises(ConfigError, match=r"methods\.grpo\.train\.loss\.denominator: unknown loss "
                       r"aggregation mode 'tokens'"):
        validate(raw, "config/config.yaml")


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="policy loss 'ppo_clip' is already registered"):
        register_policy_loss("ppo_clip")(lambda *a: a)
    with pytest.raises(ValueError, match="loss aggregation mode 'all' is already registered"):
        register_loss_agg_mode("all")(lambda *a: a)
    assert POLICY_LOSSES["ppo_clip"].__name__ == "ppo_clip_loss"


def test_the_default_loss_leaves_the_training_hash_as_it_was(toy):
    """policy_loss at its default is not in a training's result keys (configs written before the
    key keep their hashes and resume states); another loss is, and changes the hash."""
    cfg = validate(default_raw(), "config/config.yaml")
    size, method = cfg.experiment.sizes[0], cfg.experiment.methods[0]
    assert "policy_loss" not in train_result_config(cfg, size, method)["train"]["loss"]
    raw = default_raw()
    raw["train"]["loss"]["policy_loss"] = "ppo_clip"
    assert train_config_hash(validate(raw, "c"), size, method) == train_config_hash(cfg, size, method)
    raw["train"]["loss"]["policy_loss"] = "toy_reinforce"
    other = validate(raw, "c")
    assert train_result_config(other, size, method)["train"]["loss"]["policy_loss"] == "toy_reinforce"
    assert train_config_hash(other, size, method) != train_config_hash(cfg, size, method)
