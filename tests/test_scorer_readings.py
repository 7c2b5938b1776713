"""The scorer computes the readings of ICT's reference exactly when a selector needs them, and the
ict selector's readings select from them (METHODS §3)."""

from __future__ import annotations

import types

import torch

from stages.core.models.modeling import build_scratch_model
from stages.core.statistics.scorer import DEVIATIONS, Chunks, Scope, score_scope
from stages.core.statistics.scoring import pack
from stages.core.statistics.stats import group_step_jsd
from stages.core.training.selectors import (
    ICT_SCORES,
    SELECTORS,
    SelectionInput,
    grid,
    select_tokens,
)

ARCH = types.SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128)
VOCAB, PAD = 259, 256


def batch(seed=0, prompts=2, g=3):
    gen = torch.Generator().manual_seed(seed)
    p_ids, r_ids = [], []
    for _ in range(prompts):
        p = torch.randint(0, 256, (4,), generator=gen).tolist()
        for _ in range(g):
            n = int(torch.randint(2, 9, (1,), generator=gen))
            p_ids.append(p)
            r_ids.append(torch.randint(0, 256, (n,), generator=gen).tolist())
    return p_ids, r_ids, [k // g for k in range(prompts * g)]


def test_score_scope_computes_each_reading_with_its_keys():
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=2).double()
    p_ids, r_ids, groups = batch()
    ids, attention, rows, cols = pack(p_ids, r_ids, PAD)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
    h, w = hidden[rows, cols], model.lm_head.weight.detach()
    lengths = [len(r) for r in r_ids]
    response = torch.arange(len(r_ids)).repeat_interleave(torch.tensor(lengths))
    group = torch.tensor(groups).repeat_interleave(torch.tensor(lengths))
    step = torch.cat([torch.arange(n) for n in lengths])
    keys = {"group_jsd": (group * 100 + step, False), "response_mean_jsd": (response, False),
            "group_pooled_jsd": (group, False), "group_loo_jsd": (group * 100 + step, True)}
    assert set(keys) == set(DEVIATIONS)
    got = score_scope(model, Scope(p_ids, r_ids, groups), PAD, 0.7, set(DEVIATIONS),
                      device="cpu", max_sequences=2, chunks=Chunks(5, 50))
    for name, (k, leave_out) in keys.items():
        want = group_step_jsd(h, w, k, 0.7, leave_out=leave_out)
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-13, msg=name)
        assert float(got[name].max()) > 1e-3, name
    only = score_scope(model, Scope(p_ids, r_ids, groups), PAD, 0.7, {"group_loo_jsd"},
                       device="cpu", max_sequences=2, chunks=Chunks(5, 50))
    assert set(only) == {"entropy", "renyi2", "logprob", "logsumexp", "group_loo_jsd"}


def test_each_reading_needs_exactly_its_statistic_from_the_scorer():
    """What the trainer scores for a method (needs ∩ STATISTICS) is what its selector reads."""
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=3).double()
    p_ids, r_ids, groups = batch(seed=1)
    spec = SELECTORS["ict"]
    lengths = [len(r) for r in r_ids]
    for variant, statistic in ICT_SCORES.items():
        needs = spec.needs(spec.validate({"variant": variant}))
        stats = score_scope(model, Scope(p_ids, r_ids, groups), PAD, 1.0, needs, device="cpu",
                            max_sequences=4)
        inp = SelectionInput(valid=grid(torch.ones(sum(lengths), dtype=torch.bool), lengths),
                             **{statistic: grid(stats[statistic], lengths)})
        mask = select_tokens("ict", inp, rho=0.2, variant=variant)
        assert mask.sum(dim=1).tolist() == [-(-n // 5) for n in lengths]  # ceil(0.2·T_i)
