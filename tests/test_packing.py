"""Padding-free packing (`train.padding_free`): one row of the micro-batch's sequences back to
back, position ids restarting at 0 for each, against right-padded rows.

transformers 5.x with sdpa on the CPU: with no attention mask and no KV cache the model reads the
restarts (masking_utils.find_packed_sequence_indices) and builds a block-diagonal causal mask, so
no position attends to another sequence's; the hidden states equal the padded rows' and do not
move when another sequence of the row changes. Through the scorer and the actor step (a float64
model to 1e-10, float32 to 1e-5): the same statistics, mask, loss and gradients, with the token
budget counting a packed row's tokens, not longest × sequences.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from stages import train
from stages.config import validate
from stages.core.models.engine import Dist
from stages.core.models.modeling import build_scratch_model
from stages.core.models.policy import Layout, Policy
from stages.core.statistics.scorer import micro_batches, trunk_hidden
from stages.core.statistics.scoring import pack, pack_batch
from stages.core.training import rollouts
from stages.core.training.actor import actor_step
from tests.test_sequence_parallel import PlainEngine, max_rel, stat_bound
from tests.test_train import PAD, VOCAB, random_batch

ARCH = types.SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128)
CPU = Dist(0, 1, torch.device("cpu"))
VIRTUAL = {"world_size": 2, "sequence_parallel": 1, "max_token_len_per_gpu": 20}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest (and shares the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_padding_free_row_is_the_sequences_back_to_back():
    got = pack_batch([[1, 2], [3]], [[4, 5, 6], [7]], pad_id=0, padding_free=True, multiple=4)
    assert got.input_ids.tolist() == [[1, 2, 4, 5, 6, 3, 7, 0]]
    assert got.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]  # the pad: a sequence of its own
    assert got.attention_mask is None
    assert got.flat.tolist() == [1, 2, 3, 5]  # the positions predicting 4, 5, 6 and 7
    padded = pack_batch([[1, 2], [3]], [[4, 5, 6], [7]], pad_id=0, multiple=4)
    assert padded.input_ids.tolist() == [[1, 2, 4, 5, 6, 0, 0, 0], [3, 7, 0, 0, 0, 0, 0, 0]]
    assert padded.attention_mask.tolist() == [[1] * 5 + [0] * 3, [1, 1] + [0] * 6]
    assert padded.position_ids.tolist() == [list(range(8))] * 2
    assert padded.flat.tolist() == [1, 2, 3, 8]
    assert pack_batch([[1, 2]], [[4]], 0).input_ids.tolist() == [[1, 2, 4]]  # multiple 1: as is


def test_a_padding_free_micro_batch_costs_its_tokens():
    # padded: sequences x longest within 12 -> [5, 5] = 10, then 3 x 5 = 15 > 12
    assert micro_batches([5, 5, 2, 2, 9, 1], 8, 12) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    # packed: the sum within 12 -> 5 + 5 + 2 = 12, then 2 + 9 = 11, + 1 = 12
    assert micro_batches([5, 5, 2, 2, 9, 1], 8, 12, padding_free=True) == [range(0, 3), range(3, 6)]
    assert micro_batches([20, 3], 8, 12, padding_free=True) == [range(0, 1), range(1, 2)]
    assert micro_batches([1] * 5, 2, None, padding_free=True) == [range(0, 2), range(2, 4), range(4, 5)]


def test_no_position_attends_to_another_sequence():
    model = build_scratch_model(ARCH, VOCAB, PAD, seed=0).double()
    assert model.config._attn_implementation == "sdpa"
    p_ids, r_ids, _, _ = random_batch(seed=3, prompts=2, g=2)
    with torch.no_grad():
        padded = trunk_hidden(model, p_ids, r_ids, PAD, "cpu")
        packed = trunk_hidden(Policy(model, Layout(padding_free=True)), p_ids, r_ids, PAD, "cpu")
        assert packed.hidden.shape[0] == 1
        assert torch.allclose(packed.rows(), padded.rows(), rtol=1e-12, atol=1e-12)
        # change the first sequence: every other sequence's hidden states stay bit for bit
        moved = [[(t + 1) % 256 for t in p_ids[0]]] + p_ids[1:]
        other = trunk_hidden(Policy(model, Layout(padding_free=True)), moved, r_ids, PAD, "cpu")
        first = len(r_ids[0])
        assert torch.equal(other.rows()[first:], packed.rows()[first:])
        assert not torch.equal(other.rows()[:first], packed.rows()[:first])
        # the same row without its position ids (one causal sequence) differs: the test can fail
        batch = pack_batch(p_ids, r_ids, PAD, padding_free=True)
        plain = model.get_decoder()(input_ids=batch.input_ids, use_cache=False).last_hidden_state
        assert not torch.allclose(plain.flatten(0, 1)[batch.flat][first:], packed.rows()[first:])
        # nor is the padded path changed: pack()'s rows through the model as before
        ids, attention, rows, cols = pack(p_ids, r_ids, PAD)
        before = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
        assert torch.equal(before[rows, cols], padded.rows())


def _update(dtype, padding_free: bool, method: dict, kl: float, budget: int | None) -> dict:
    """The sampling pass (ICT's u and the JSD to the scope's mean) and an off-policy update on
    2 groups of 4, fed padded or padding-free."""
    import yaml

    from tests.conftest import ROOT

    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["train"].update(micro_batch_size=3, micro_batch_tokens=budget, mini_batch_prompts=2,
                        prompts_per_step=2, group_size=4, padding_free=padding_free,
                        loss={"kl_beta": kl, "denominator": "sequence"})
    raw["methods"]["case"] = copy.deepcopy(method)
    micro = method.get("selection_scope") == "microbatch"
    if micro:  # verl's layout of 2 ranks, 20 tokens per micro-batch; its token-mean
        raw["train"].update(virtual_layout=VIRTUAL, loss={"kl_beta": kl, "denominator": "selected"})
    cfg = validate(raw, "packing.yaml")
    layout = Layout(padding_free)
    policy = Policy(build_scratch_model(ARCH, VOCAB, PAD, seed=0).to(dtype), layout)
    ref = Policy(build_scratch_model(ARCH, VOCAB, PAD, seed=1).to(dtype), layout).eval() if kl else None
    p_ids, r_ids, adv, noise = random_batch(seed=1)
    mb = rollouts.Rollouts(p_ids, r_ids, [i // 4 for i in range(len(r_ids))], adv)
    scope = None
    if micro:  # the mini-batch in verl's order, with its virtual micro-batches
        (mb,), (scope,), _ = rollouts.virtual_minibatches(mb, cfg, CPU)
    case = cfg.methods["case"]
    stats = train.rescore(policy, mb, train.scorer_needs(case, False) | {"jsd"}, cfg, PAD, CPU)
    mb.stats = {**stats, "logprob": stats["logprob"] + noise.to(dtype)}
    engine = PlainEngine(policy, CPU)
    u = actor_step(engine, mb, case, cfg, CPU, torch.Generator().manual_seed(7), PAD, stats=stats,
                   on_policy=False, ref_model=ref, scope=scope)
    return {"stats": stats, "loss": u.loss, "mask": u.mask, "clipped": u.n_clipped, "kl": u.kl_sum,
            "calls": u.micro_batches, "grads": engine.reduced}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["ict", "micro"])
def test_padding_free_gives_the_scores_loss_and_gradients_of_padded_rows(dtype, case):
    """ICT with the KL term under a token budget (packed micro-batches hold more sequences, and
    the selection spans the mini-batch), and the micro-batch selection scope (the same
    micro-batches: no token budget)."""
    method, kl, budget = {
        "ict": ({"selector": "ict", "rho": 0.3}, 0.05, 30),
        "micro": ({"selector": "entropy_top", "rho": 0.3, "selection_scope": "microbatch"}, 0.0, None),
    }[case]
    padded = _update(dtype, False, method, kl, budget)
    packed = _update(dtype, True, method, kl, budget)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    if budget is None:
        assert packed["calls"] == padded["calls"] == 3
    else:
        assert packed["calls"] < padded["calls"]  # a packed row costs its tokens
    for key, value in padded["stats"].items():
        assert max_rel(packed["stats"][key], value) <= stat_bound(key, tol, dtype == torch.float32), key
    assert {"group_jsd", "jsd"} <= padded["stats"].keys() or case == "micro"
    assert torch.equal(packed["mask"], padded["mask"]) and 0 < int(padded["mask"].sum())
    assert packed["loss"] == pytest.approx(padded["loss"], rel=tol) and padded["loss"] != 0
    assert packed["clipped"] == padded["clipped"] > 0
    assert packed["kl"] == pytest.approx(padded["kl"], rel=tol) and (padded["kl"] > 0) == (kl > 0)
    assert packed["grads"].keys() == padded["grads"].keys() and len(padded["grads"]) > 5
    for name, g in padded["grads"].items():
        assert max_rel(packed["grads"][name], g) <= tol, name
