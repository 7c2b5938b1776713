"""Token selectors on hand-computed examples (METHODS §3)."""

from __future__ import annotations

import pytest
import torch

from stages.core.statistics.stats import token_statistics
from stages.core.training.selectors import (
    ICT_LABELS,
    ICT_SCORES,
    ICT_VARIANTS,
    INPUTS,
    SELECTORS,
    STATISTICS,
    SelectionInput,
    count,
    linear_quantile,
    register_selector,
    select_tokens,
    top_k_first,
)

F, T = False, True


def m(rows):
    return torch.tensor(rows, dtype=torch.bool)


# Scope for the entropy selectors: N = 5 valid tokens; padding holds the largest values, so any
# selector that looks at padding fails these tests.
VALID = m([[1, 1, 1, 0], [1, 1, 0, 0]])
ENTROPY = torch.tensor([[0.5, 2.0, 0.1, 9.9], [1.5, 2.0, 7.0, 7.0]])


def entropy_input(valid=VALID):
    return SelectionInput(valid=valid, entropy=ENTROPY)


@pytest.mark.parametrize(
    ("rho", "expected"),
    [
        (0.2, [[F, T, F, F], [F, F, F, F]]),  # k = 1: tie 2.0 / 2.0 goes to the earlier position
        (0.4, [[F, T, F, F], [F, T, F, F]]),  # k = 2
        (0.5, [[F, T, F, F], [T, T, F, F]]),  # k = ceil(2.5) = 3
        (1.0, [[T, T, T, F], [T, T, F, F]]),
    ],
)
def test_entropy_top_and_bottom(rho, expected):
    top = select_tokens("entropy_top", entropy_input(), rho=rho)
    assert top.tolist() == expected
    bottom = select_tokens("entropy_bottom", entropy_input(), rho=rho)
    assert bottom.tolist() == (VALID & ~m(expected)).tolist()


def test_bottom_keeps_the_lowest_entropy_tokens():
    # ρ = 0.2: the complement of the single top token: the four lowest, 0.1, 0.5, 1.5, 2.0
    assert select_tokens("entropy_bottom", entropy_input(), rho=0.2).tolist() == [
        [T, F, T, F], [T, T, F, F]
    ]


def test_count_reads_rho_as_written():
    assert count(0.7, 10) == 7  # float 0.7 * 10 = 7.000000000000001
    assert count(0.1, 10) == 1
    assert count(0.1, 11) == 2
    assert count(0.2, 0) == 0
    assert count(1 / 3, 3) == 1
    with pytest.raises(ValueError):
        count(1.5, 3)


def test_top_k_first_ties_take_the_earliest():
    values = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 3.0])
    assert top_k_first(values, 3).tolist() == [F, T, T, F, T, F]
    assert top_k_first(values, 5).tolist() == [F, T, T, T, T, T]
    assert top_k_first(torch.zeros(4), 2).tolist() == [T, T, F, F]
    with pytest.raises(ValueError, match="NaN"):
        top_k_first(torch.tensor([1.0, float("nan"), 0.0]), 1)


def test_all():
    assert select_tokens("all", entropy_input()).tolist() == VALID.tolist()


def test_random_counts_seeds_and_stays_valid():
    valid = torch.rand(6, 50, generator=torch.Generator().manual_seed(0)) > 0.4
    inp = SelectionInput(valid=valid)
    n = int(valid.sum())
    a = select_tokens("random", inp, rho=0.1, seed=3)
    assert int(a.sum()) == count(0.1, n) and not (a & ~valid).any()
    assert torch.equal(a, select_tokens("random", inp, rho=0.1, seed=3))
    assert not torch.equal(a, select_tokens("random", inp, rho=0.1, seed=4))
    g = torch.Generator().manual_seed(3)
    assert torch.equal(a, select_tokens("random", SelectionInput(valid=valid, generator=g), rho=0.1))
    hits = sum(select_tokens("random", inp, rho=0.1, seed=s).long() for s in range(200))
    assert (hits[valid] > 0).all() and (hits[~valid] == 0).all()  # every valid token reachable
    assert select_tokens("random", inp, rho=1.0).tolist() == valid.tolist()


def test_random_per_response_draws_ceil_rho_of_each_response():
    valid = torch.rand(6, 50, generator=torch.Generator().manual_seed(1)) > 0.3
    valid[2] = False  # an empty response draws nothing
    inp = SelectionInput(valid=valid)
    got = select_tokens("random", inp, rho=0.1, scope="response", seed=2)
    assert got.sum(dim=1).tolist() == [count(0.1, int(n)) for n in valid.sum(dim=1)]
    assert not (got & ~valid).any()
    assert not torch.equal(got, select_tokens("random", inp, rho=0.1, scope="response", seed=3))


def test_parameters_are_validated_against_the_selector_model():
    from pydantic import ValidationError

    for params in ({"rho": 0.0}, {"rho": 1.5}, {"rho": 0.2, "bogus": 1}):
        with pytest.raises(ValidationError):
            select_tokens("entropy_top", entropy_input(), **params)
    with pytest.raises(ValidationError):
        select_tokens("ict", ict_input(), variant="pooled")


# STAPO scope: response 0 has Â = 1 > 0, response 1 has Â = -1; τ_p = 0.1.
# Candidates (Â > 0 ∧ p < 0.1): row 0, positions 0, 2, 3 with H = 0.3, 1.0, 0.6.
STAPO_VALID = m([[1, 1, 1, 1], [1, 1, 1, 0]])
STAPO_P = torch.tensor([[0.05, 0.5, 0.01, 0.02], [0.01, 0.01, 0.5, 0.01]])
STAPO_H = torch.tensor([[0.3, 0.1, 1.0, 0.6], [0.2, 0.4, 0.5, 0.0]])


def stapo_input(advantages=None, valid=STAPO_VALID):
    advantages = torch.tensor([1.0, -1.0]) if advantages is None else advantages
    return SelectionInput(
        valid=valid, entropy=STAPO_H, logprob=STAPO_P.log(), advantages=advantages
    )


@pytest.mark.parametrize(
    ("q", "expected_row0"),
    [
        (0.5, [F, T, T, T]),  # sorted H = 0.3, 0.6, 1.0; h = 1 -> τ_h = 0.6; silence 0.3
        (0.75, [F, T, T, F]),  # h = 1.5 -> τ_h = 0.6 + 0.5 · 0.4 = 0.8; silence 0.3, 0.6
        (0.0, [T, T, T, T]),  # τ_h = 0.3 and H < 0.3 is false: nothing silenced
    ],
)
def test_stapo_hand_computed(q, expected_row0):
    mask = select_tokens("stapo", stapo_input(), tau_p=0.1, q=q)
    assert mask.tolist() == [expected_row0, [T, T, T, F]]


def test_stapo_per_token_advantages_and_empty_candidates():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    assert torch.equal(
        select_tokens("stapo", stapo_input(per_token), tau_p=0.1, q=0.75),
        select_tokens("stapo", stapo_input(), tau_p=0.1, q=0.75),
    )
    # no positive advantage: no candidates, everything valid is kept
    none = select_tokens("stapo", stapo_input(torch.tensor([0.0, -1.0])), tau_p=0.1, q=0.75)
    assert none.tolist() == STAPO_VALID.tolist()
    # Row 1 with Â > 0: candidates H = 0.2, 0.4 -> τ_h(q = 0.5) = 0.3, silence (1, 0).
    # The padding (1, 3) has p < τ_p and H = 0: counted as a candidate it would pull τ_h down
    # to 0.2 and nothing would be silenced.
    assert select_tokens("stapo", stapo_input(torch.tensor([-1.0, 1.0])), tau_p=0.1, q=0.5
                         ).tolist() == [[T, T, T, T], [F, T, T, F]]


def test_linear_quantile_matches_torch_quantile():
    values = torch.randn(37, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.999, 1.0):
        torch.testing.assert_close(linear_quantile(values, q), torch.quantile(values, q))
    assert float(linear_quantile(torch.tensor([4.0]), 0.75)) == 4.0


# ICT scope: ids 0 at padding only; JSD values are binary fractions so means are exact.
ICT_VALID = m([[1, 1, 1, 1], [1, 1, 1, 0]])
ICT_IDS = torch.tensor([[5, 7, 5, 9], [7, 3, 3, 0]])
ICT_JSD = torch.tensor([[0.25, 0.5, 0.5, 0.125], [0.25, 0.75, 0.0, 0.9]])
# per-id means: 3 -> (0.75 + 0) / 2 = 0.375, 5 -> 0.375, 7 -> 0.375, 9 -> 0.125; U = 4


def ict_input(**kw):
    return SelectionInput(valid=ICT_VALID, jsd=ICT_JSD, token_ids=ICT_IDS, **kw)


@pytest.mark.parametrize(
    ("rho", "expected"),
    [
        (0.25, [[F, F, F, F], [F, T, T, F]]),  # k = 1 of U = 4; ids 3, 5, 7 tie: id 3
        (0.5, [[T, F, T, F], [F, T, T, F]]),  # ids 3, 5
        (0.75, [[T, T, T, F], [T, T, T, F]]),  # ids 3, 5, 7
        (1.0, [[T, T, T, T], [T, T, T, F]]),
    ],
)
def test_jsd_token_id_reading(rho, expected):
    assert select_tokens("ict", ict_input(), rho=rho, variant="token_id").tolist() == expected


@pytest.mark.parametrize(
    ("rho", "expected"),
    [
        # valid JSD in row-major order: 0.25 0.5 0.5 0.125 | 0.25 0.75 0.0; N = 7
        (0.1, [[F, F, F, F], [F, T, F, F]]),  # k = 1: 0.75
        (0.3, [[F, T, T, F], [F, T, F, F]]),  # k = 3: 0.75, 0.5, 0.5
        (0.5, [[T, T, T, F], [F, T, F, F]]),  # k = 4: ... then 0.25 tie -> earliest (0, 0)
    ],
)
def test_jsd_scope_position_reading(rho, expected):
    assert select_tokens("ict", ict_input(), rho=rho, variant="scope_position").tolist() == expected


# ICT's rule: u per position (the group-step JSD); per response the top ceil(ρ·T_i) positions.
# Row 0: T = 4; row 1: T = 3 (padding holds the largest u); row 2: T = 10 with ties.
PAPER_VALID = m([[1, 1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0], [1] * 10])
PAPER_U = torch.tensor([
    [0.1, 0.4, 0.2, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9],
    [0.0, 0.0, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9],
    [0.2, 0.6, 0.1, 0.6, 0.6, 0.0, 0.3, 0.3, 0.1, 0.05],
])


@pytest.mark.parametrize(
    ("rho", "expected"),
    [
        # k = ceil(0.1 · T): 1, 1, 1 — row 2's three 0.6 ties go to the earliest (position 1)
        (0.1, [[1], [2], [1]]),
        # k = 2, 1, 3: row 0 0.4, 0.3; row 2 the three 0.6
        (0.3, [[1, 3], [2], [1, 3, 4]]),
        # k = 2, 2, 5: row 1's second pick is a tie at 0.0 -> position 0; row 2 adds 0.3, 0.3
        (0.5, [[1, 3], [0, 2], [1, 3, 4, 6, 7]]),
        (1.0, [[0, 1, 2, 3], [0, 1, 2], list(range(10))]),
    ],
)
def test_ict_paper_rule_is_per_response(rho, expected):
    inp = SelectionInput(valid=PAPER_VALID, group_jsd=PAPER_U)
    got = select_tokens("ict", inp, rho=rho)  # variant 'paper' is the default
    assert [row.nonzero().squeeze(1).tolist() for row in got] == expected
    frequent = select_tokens("ict", inp, rho=rho, part="frequent")
    assert torch.equal(frequent, PAPER_VALID & ~got)  # the paper's "90%-frequent" control


READINGS = ("response_mean", "group_pooled", "group_leave_one_out")


@pytest.mark.parametrize("variant", READINGS)
@pytest.mark.parametrize(
    ("rho", "expected"),
    [(0.1, [[1], [2], [1]]), (0.3, [[1, 3], [2], [1, 3, 4]]), (0.5, [[1, 3], [0, 2], [1, 3, 4, 6, 7]])],
)
def test_ict_readings_pick_per_response_by_their_own_deviation(variant, rho, expected):
    """Each reading ranks each response's positions by its own statistic, exactly like the rule
    (same table as above), and reads no other: the other deviations hold decoys."""
    decoy = PAPER_U.flip(1)
    fields = {name: decoy for name in ICT_SCORES.values()}
    inp = SelectionInput(valid=PAPER_VALID, **{**fields, ICT_SCORES[variant]: PAPER_U})
    got = select_tokens("ict", inp, rho=rho, variant=variant)
    assert [row.nonzero().squeeze(1).tolist() for row in got] == expected
    frequent = select_tokens("ict", inp, rho=rho, variant=variant, part="frequent")
    assert torch.equal(frequent, PAPER_VALID & ~got)
    with pytest.raises(ValueError, match=f"needs '{ICT_SCORES[variant]}'"):
        select_tokens("ict", SelectionInput(valid=PAPER_VALID, group_jsd=PAPER_U), variant=variant)


def test_ict_variants_statistics_and_labels():
    assert ICT_VARIANTS == ("paper", "response_mean", "group_pooled", "group_leave_one_out",
                            "token_id", "scope_position")
    assert ICT_SCORES == {"paper": "group_jsd", "response_mean": "response_mean_jsd",
                          "group_pooled": "group_pooled_jsd", "group_leave_one_out": "group_loo_jsd"}
    assert set(ICT_SCORES.values()) <= set(STATISTICS) <= set(INPUTS)
    assert set(ICT_LABELS) == set(ICT_VARIANTS)
    # only the paper's rule is called ICT
    assert [v for v, label in ICT_LABELS.items() if "ICT" in label.replace("not ICT", "")] == ["paper"]
    assert all(ICT_LABELS[v].endswith("(ours, not ICT)") for v in ICT_VARIANTS if v != "paper")


def test_ict_needs_follow_the_variant():
    spec = SELECTORS["ict"]
    assert spec.needs() == {"group_jsd"}
    assert spec.needs(spec.validate({"variant": "token_id"})) == {"jsd", "token_ids"}
    assert spec.needs(spec.validate({"variant": "scope_position"})) == {"jsd"}
    for variant, statistic in ICT_SCORES.items():
        assert spec.needs(spec.validate({"variant": variant})) == {statistic}
    per_response = {v: spec.per_response(spec.validate({"variant": v})) for v in ICT_VARIANTS}
    assert per_response == {v: v in ICT_SCORES for v in ICT_VARIANTS}
    assert SELECTORS["stapo"].needs() == {"entropy", "logprob", "advantages"}
    assert SELECTORS["all"].needs() == set()
    with pytest.raises(ValueError, match="needs 'group_jsd'"):
        select_tokens("ict", SelectionInput(valid=PAPER_VALID))
    with pytest.raises(ValueError, match="part"):
        select_tokens("ict", ict_input(), variant="token_id", part="frequent")


FULL = dict(
    valid=ICT_VALID, entropy=STAPO_H, logprob=STAPO_P.log(), jsd=ICT_JSD, token_ids=ICT_IDS,
    group_jsd=ICT_JSD.flip(1), response_mean_jsd=STAPO_H, group_pooled_jsd=STAPO_H.flip(1),
    group_loo_jsd=ICT_JSD.flip(0), advantages=torch.tensor([1.0, 2.0]),
)
CASES = [
    ("all", {}), ("entropy_top", {"rho": 0.3}), ("entropy_bottom", {"rho": 0.3}),
    ("random", {"rho": 0.5, "seed": 1}), ("random", {"rho": 0.5, "scope": "response"}),
    ("stapo", {"tau_p": 0.1, "q": 0.75}),
    ("ict", {"rho": 0.5}), ("ict", {"rho": 0.5, "part": "frequent"}),
    ("ict", {"rho": 0.5, "variant": "token_id"}), ("ict", {"rho": 0.3, "variant": "scope_position"}),
    *[("ict", {"rho": 0.5, "variant": v}) for v in ("response_mean", "group_pooled",
                                                    "group_leave_one_out")],
    ("ict", {"rho": 0.5, "variant": "group_leave_one_out", "part": "frequent"}),
]

@pytest.mark.parametrize(("name", "params"), CASES)
def test_int_mask_selects_exactly_like_bool_mask(name, params):
    as_bool = select_tokens(name, SelectionInput(**FULL), **params)
    for dtype in (torch.long, torch.int32, torch.uint8, torch.float32):
        inp = SelectionInput(**{**FULL, "valid": ICT_VALID.to(dtype)})
        assert torch.equal(select_tokens(name, inp, **params), as_bool)
    assert as_bool.dtype == torch.bool and not (as_bool & ~ICT_VALID).any()


@pytest.mark.parametrize(("name", "params"), CASES)
def test_all_padding_selects_nothing(name, params):
    inp = SelectionInput(**{**FULL, "valid": torch.zeros(2, 4, dtype=torch.long)})
    assert not select_tokens(name, inp, **params).any()


def test_every_selector_is_covered():
    assert {name for name, _ in CASES} == set(SELECTORS)


def test_input_validation():
    with pytest.raises(ValueError, match="0 and 1"):
        SelectionInput(valid=torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="entropy"):
        SelectionInput(valid=VALID, entropy=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        SelectionInput(valid=VALID, advantages=torch.zeros(3))
    with pytest.raises(ValueError, match="needs 'entropy'"):
        select_tokens("entropy_top", SelectionInput(valid=VALID), rho=0.2)
    with pytest.raises(KeyError, match="unknown selector"):
        select_tokens("nope", SelectionInput(valid=VALID))
    with pytest.raises(ValueError, match="already registered"):
        register_selector("all")(lambda inp: inp.valid)
    with pytest.raises(ValueError, match="unknown inputs"):
        register_selector("_bad", needs=("entropy", "vibes"))


def test_misbehaving_selector_is_caught():
    name = "_test_selects_padding"
    register_selector(name)(lambda inp: torch.ones_like(inp.valid))
    try:
        with pytest.raises(AssertionError, match="invalid position"):
            select_tokens(name, SelectionInput(valid=VALID))
    finally:
        del SELECTORS[name]


def test_selectors_on_statistics_of_real_logits():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(3, 6, 11, generator=g)  # (B, T, V)
    valid = torch.ones(3, 6, dtype=torch.long)
    valid[1, 4:] = 0
    ids = torch.randint(0, 11, (3, 6), generator=g)
    s = token_statistics(logits, 1.0, valid, ids, jsd=True)
    inp = SelectionInput(valid=valid, entropy=s["entropy"], logprob=s["logprob"], jsd=s["jsd"],
                         token_ids=ids, advantages=torch.tensor([1.0, 0.0, -1.0]))
    top = select_tokens("entropy_top", inp, rho=0.2)
    n = int(valid.sum())
    assert int(top.sum()) == count(0.2, n)
    assert s["entropy"][top].min() >= s["entropy"][inp.valid & ~top].max()
    position = select_tokens("ict", inp, rho=0.25, variant="scope_position")
    assert s["jsd"][position].min() >= s["jsd"][inp.valid & ~position].max()
    token_id = select_tokens("ict", inp, rho=0.25, variant="token_id")
    assert len(ids[token_id].unique()) == count(0.25, len(ids[inp.valid].unique()))
