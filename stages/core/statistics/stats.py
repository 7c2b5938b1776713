"""Exact per-token statistics of the full-vocabulary distribution (METHODS §2).

For a position with logits z ∈ R^V and temperature T the distribution is p = softmax(z / T).
Every quantity is in nats:

- ``entropy``   H(p)  = -Σ_j p_j log p_j
- ``renyi2``    H2(p) = -log Σ_j p_j²            (0 ≤ H2 ≤ H ≤ log V)
- ``logsumexp`` log Σ_j exp(z_j / T)
- ``max_prob``  max_j p_j                        (a probability, not a log)
- ``logprob``   log p(o) of the sampled token o
- ``jsd``       d = JSD(p ‖ p̄), p̄ the mean distribution over the valid positions of the scope
- :func:`group_step_jsd`  ICT's uniqueness u_{i,t} = JSD(p_{i,t} ‖ P̄_t), P̄_t the mean over the
  responses of i's group that are active at step t (METHODS §3); with other keys, or leaving
  the row out of its own reference, the readings of the reference that the summaries leave open
- :func:`group_step_reference`  the same u and, in the same pass, the reference's probability of
  the position's token P̄(y) (ICT: P̄_t(y_{i,t})) and its β = Σ_a P̄(a)², float64 (REFERENCE_FIELDS);
  :func:`mean_without` leaves a part of a reference (the row, the response) out of its mean
- :func:`jsd_ceiling`  c(w), the largest JSD(p ‖ w·p + (1 − w)·r): how far u can go when p's own
  weight in its reference is w
- :func:`diverged_positions`  the positions whose response prefix no other active response of the
  group shares

There is one implementation, written over *blocks* of scaled logits (positions × vocabulary):
the moments of a block are merged with an online logsumexp (running max, running sums), so the
same code serves materialised logits (:func:`token_statistics`) and hidden states times the
language-model head (:func:`chunked_token_statistics`), where the full (N, V) logits never exist
and peak memory is O(chunk_positions × chunk_vocab).

Numerics: everything is computed in float32 (float64 when an input is float64), whatever the
dtype of the inputs; bf16 hidden states and head weights are cast per block before the matmul.
Entropy is computed as log s0 - s1 / s0 with s0 = Σ e^{z-m} and s1 = Σ e^{z-m} (z-m) (m the row
max), a sum of two non-negative terms, so it does not cancel even for logits of size 1e4.
JSD uses x·log(2x/(x+y)) terms, each non-negative, with 0·log 0 = 0.

Masked positions (mask False / 0) are never computed; their statistics are 0.
With a head, z = (h / T) · W^T + b / T: the temperature is folded into the hidden state, which
differs from (h · W^T + b) / T only by float rounding.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

LN2 = math.log(2.0)
U_FLOOR_ULPS = 64
"""group_step_jsd: u below this many machine epsilons of the compute dtype is rounding noise: 0."""
CEILING_RTOL = 1e-3
"""at_ceiling: u within this relative distance of its ceiling c(w) counts as at the ceiling (ours)."""
CHUNK_POSITIONS = 1024
CHUNK_VOCAB = 32768
CACHE_BLOCKS = 2
"""group_step_jsd without a precomputed logsumexp keeps a block of keys' logits over the whole
vocabulary (at most this many chunk_positions × chunk_vocab blocks, so blocks of fewer keys)
between its two passes, so that the head's matmul runs once per row, not twice (ours;
benchmarks/token_stats.py measures it)."""
PIECE_BYTES = 1 << 30
"""On a CPU, the elementwise passes over a block visit its rows in pieces of about this many
bytes per tensor; the values are the same, every pass being per row. 1 GiB: the whole block at
the default chunks. Pieces of 2 MiB (16 rows, to stay in the cache) ran 1.5-2x slower on the
shared 2-core machine of docs/performance.md: each torch op over a small piece is a parallel
region whose threads wait for one another, and there another job often holds one of the cores
(ours; measured with benchmarks/token_stats.py and by hand, 2026-12-02)."""


# ---------------------------------------------------------------------------------------------
# Block math: the single implementation of every formula.
# ---------------------------------------------------------------------------------------------
@dataclass
class _Moments:
    """Online-logsumexp state of a set of rows over part of the vocabulary (all (n,) tensors).

    With m the running max of the scaled logits over the part seen so far:
    s0 = Σ e^{z-m}, s1 = Σ e^{z-m} (z-m) ≤ 0, s2 = Σ e^{2(z-m)}; s1 and s2 are None when only the
    logsumexp is asked for.
    """

    m: Tensor
    s0: Tensor
    s1: Tensor | None
    s2: Tensor | None


def _block_moments(z: Tensor, scratch: Tensor | None = None, finite: bool = False,
                   full: bool = True, shifted: Tensor | None = None) -> _Moments:
    """Moments of one block of scaled logits z (n, v). Overwrites z (it is a scratch buffer),
    unless shifted (n, v) is given: z − max is formed there instead, z kept.

    finite=False allows -inf logits (masked vocabulary entries): they contribute e = 0 and
    e·(z-m) = 0 instead of 0·inf = nan. A head's logits are finite, which saves that pass.
    full=False: m and s0 only (the logsumexp), the same values, three passes fewer.
    """
    # a block whose row is all -inf gets the finite max finfo.min, so that row's moments are 0
    # and merging them stays 0 · (finite) instead of 0 · inf
    m = z.amax(dim=1).clamp_min_(torch.finfo(z.dtype).min)  # (n,)
    z = z.sub_(m[:, None]) if shifted is None else torch.sub(z, m[:, None], out=shifted)
    if not finite:
        z.clamp_min_(torch.finfo(z.dtype).min)
    if not full:
        return _Moments(m, z.exp_().sum(dim=1), None, None)
    e = torch.exp(z, out=scratch) if scratch is not None else torch.exp(z)  # (n, v)
    s0 = e.sum(dim=1)
    s1 = z.mul_(e).sum(dim=1)
    s2 = e.square_().sum(dim=1)
    return _Moments(m, s0, s1, s2)


def _piece_moments(z: Tensor, scratch: Tensor, finite: bool, full: bool, rows: int) -> _Moments:
    """_block_moments of z (n, v) computed `rows` rows at a time (each row's values are the same:
    every pass is per row), so that a piece's passes run from the cache, not from memory."""
    parts = [_block_moments(z[r0:r1], scratch[r0:r1], finite, full)
             for r0, r1 in _row_pieces(z.shape[0], rows)]
    if len(parts) == 1:
        return parts[0]
    return _Moments(*(None if getattr(parts[0], f) is None
                      else torch.cat([getattr(part, f) for part in parts])
                      for f in ("m", "s0", "s1", "s2")))


def _merge(a: _Moments | None, b: _Moments) -> _Moments:
    """Moments of the union of two disjoint vocabulary parts of the same rows."""
    if a is None:
        return b
    m = torch.maximum(a.m, b.m)
    da, db = a.m - m, b.m - m  # ≤ 0, finite
    ca, cb = da.exp(), db.exp()
    if a.s1 is None:
        return _Moments(m=m, s0=ca * a.s0 + cb * b.s0, s1=None, s2=None)
    return _Moments(
        m=m,
        s0=ca * a.s0 + cb * b.s0,
        s1=ca * (a.s1 + da * a.s0) + cb * (b.s1 + db * b.s0),
        s2=ca.square() * a.s2 + cb.square() * b.s2,
    )


def _finish(mom: _Moments) -> dict[str, Tensor]:
    """Per-row statistics (nats) from the moments over the whole vocabulary."""
    log_s0 = mom.s0.log()  # ≥ 0: the max term is e^0 = 1
    return {
        "logsumexp": mom.m + log_s0,
        "entropy": (log_s0 - mom.s1 / mom.s0).clamp_min(0.0),
        "renyi2": (2.0 * log_s0 - mom.s2.log()).clamp_min(0.0),
        "max_prob": mom.s0.reciprocal(),
    }


def _jsd_block(p: Tensor, logp: Tensor, q: Tensor, logq: Tensor, mix: Tensor | None = None,
               half_q: Tensor | None = None) -> Tensor:
    """Σ over the last dimension of ½[p (log p − log m) + q (log q − log m)], m = (p+q)/2, in
    nats: JSD(p ‖ q) of each row of p (..., v) against q, which broadcasts to p (a reference row
    per row, or one row (..., 1, v) for the rows beside it). logp and logq are the logs of p and
    q, finite (any finite value where the probability is 0, so that 0 · (log − log m) = 0);
    logp is overwritten, mix is scratch like p.

    One log per entry, of m: log p is known without one (the scaled logit minus its logsumexp,
    of which p is the exp), and a reference row's log q serves all the rows beside it; the ratio
    form p·log(2p/(p+q)) needs two, the costliest passes here. Numerics: each of the two sums is
    a KL divergence to m, ≥ 0, so they do not cancel against each other; within a sum, log p −
    log m rounds to about eps·(|log p| + |log m|) where the ratio form rounds to about eps, so a
    term p (log p − log m) is off by about eps·p·|log p|, and u by at most eps times the
    entropies, ~eps·(H(p) + H(q)) (1e-6 nats in float32 at H = 4 nats each, below
    U_FLOOR_ULPS·eps = 7.6e-6; random rounding is far smaller). m is formed as ½q + ½p in one
    pass, ½q raised to the smallest positive float, so that log m is finite where p = q = 0 (and
    m the same as max((p + q)/2, that float) but below normal floats); half_q, that ½q, may be
    given (a reference row's serves all the rows beside it).
    """
    if half_q is None:
        half_q = _half(q)
    mix = torch.add(half_q, p, alpha=0.5, out=mix).log_()  # log m
    kl = logp.sub_(mix).mul_(p).sum(dim=-1)  # (...) KL(p ‖ m)
    gap = torch.sub(logq, mix, out=mix)  # (..., v) log q − log m
    if q.shape[-2] == 1 < p.shape[-2]:  # one reference row for several rows: matrix × vector
        return kl.add_(torch.matmul(gap, q.transpose(-1, -2)).squeeze(-1)).mul_(0.5)
    return kl.add_(gap.mul_(q).sum(dim=-1)).mul_(0.5)


def _log_probs(x: Tensor, out: Tensor | None = None) -> Tensor:
    """log x of probabilities x, finite: a 0 gets log of the smallest positive float."""
    return torch.clamp_min(x, _smallest(x.dtype), out=out).log_()


def _half(q: Tensor, out: Tensor | None = None) -> Tensor:
    """½q raised to the smallest positive float (_jsd_block's half_q)."""
    return torch.mul(q, 0.5, out=out).clamp_min_(_smallest(q.dtype))


def _smallest(dtype: torch.dtype) -> float:
    """The smallest positive (subnormal) number of a floating dtype."""
    return float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps)


def jensen_shannon(p: Tensor, q: Tensor) -> Tensor:
    """JSD(p ‖ q) in nats over the last dimension of two probability tensors (broadcast).

    0 ≤ JSD ≤ ln 2; scipy.spatial.distance.jensenshannon returns its square root.
    """
    p, q = torch.broadcast_tensors(p, q)
    shape = p.shape[:-1]
    p, q = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])
    return _jsd_block(p, _log_probs(p), q, _log_probs(q)).clamp(0.0, LN2).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Logit sources: where the blocks of scaled logits come from.
# ---------------------------------------------------------------------------------------------
def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype of every reduction: float64 when an input is float64, float32 otherwise."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


class _Source:
    """Blocks z[rows, c0:c1] / T of the logits at the valid positions, in the compute dtype.

    hidden (..., D) with head_weight (V, D) [and head_bias (V,)], or materialised logits (..., V)
    when head_weight is None. Only the valid positions are ever touched.

    Devices: the computation runs on the head's device (hidden's when there is no head); hidden
    stays where it is, in its own dtype (e.g. bf16 on the CPU at paper scale), and each block of
    rows is moved to that device and cast to the compute dtype when it is used, so neither all
    hidden states nor anything of size positions × V is ever on the device at once. Results are
    on the compute device.
    """

    def __init__(
        self,
        hidden: Tensor,
        head_weight: Tensor | None,
        temperature: float,
        mask: Tensor | None,
        head_bias: Tensor | None,
        chunk_positions: int,
        chunk_vocab: int,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if chunk_positions < 1 or chunk_vocab < 1:
            raise ValueError("chunk_positions and chunk_vocab must be ≥ 1")
        self.shape = hidden.shape[:-1]  # (...) the position shape
        self.dtype = compute_dtype(hidden, head_weight, head_bias)
        self.device = hidden.device if head_weight is None else head_weight.device
        flat = hidden.reshape(-1, hidden.shape[-1])  # (N, D) or (N, V)
        if mask is None:
            self.valid = torch.ones(flat.shape[0], dtype=torch.bool, device=self.device)
        else:
            if mask.shape != self.shape:
                raise ValueError(f"mask shape {tuple(mask.shape)} != positions {tuple(self.shape)}")
            self.valid = mask.reshape(-1).to(self.device) != 0  # (N,) int masks exactly as bool
        self.rows = self.valid.nonzero().squeeze(1)  # (N_valid,) on the compute device
        # (N, D) or (N, V) where hidden is, never copied whole: gathered block by block
        self.data = flat
        self._data_rows = self.rows.to(flat.device)  # (N_valid,) the same rows, beside the data
        self._cached: tuple[int, int] | None = None  # rows a..b of the block now on the device
        self._cached_rows: Tensor | None = None
        self.inv_t = 1.0 / temperature
        self.head = head_weight
        if head_weight is None:
            self.vocab = flat.shape[1]
            self.bias = None
        else:
            if head_weight.shape[1] != flat.shape[1]:
                raise ValueError(f"hidden size {flat.shape[1]} != head {tuple(head_weight.shape)}")
            self.vocab = head_weight.shape[0]
            self.bias = (None if head_bias is None
                         else head_bias.to(device=self.device, dtype=self.dtype) * self.inv_t)
        self.n = int(self.rows.numel())
        self.cp = min(chunk_positions, max(self.n, 1))
        self.cv = min(chunk_vocab, self.vocab)
        self._buf = torch.empty(2 * self.cp * self.cv, dtype=self.dtype, device=self.device)
        self._scratch: dict[str, Tensor] = {}
        self.chunk_positions = chunk_positions  # as requested: blocks of keys are formed from it
        self._cache: Tensor | None = None  # fill()'s logits of rows _filled over the vocabulary
        self._filled: tuple[int, int] | None = None

    def piece_rows(self, v: int) -> int:
        """Rows of a block visited at a time by its elementwise passes: on a CPU, a piece of
        about PIECE_BYTES per (rows, v) tensor, so that the passes over it run from the cache
        rather than memory; elsewhere the whole block (a GPU wants few large kernels)."""
        if self.device.type != "cpu":
            return self.cp
        return max(1, PIECE_BYTES // (v * torch.finfo(self.dtype).bits // 8))

    def piece_probs(self, z: Tensor, lse: Tensor, r0: int, r1: int, keep: bool = False
                    ) -> tuple[Tensor, Tensor]:
        """(p, log p), each (r1 − r0, v), of rows r0..r1 of a block z (n, v) from block(), lse (n,)
        of its rows: p = exp(z − lse) in z's place, as probs() forms it, and log p = z − lse in
        a scratch piece (keep=False: the next piece reuses it) or in the second buffer of
        buffers() at the same rows (keep=True: kept for the whole block). A -inf logit's log p
        is raised to the finite finfo.min (p = 0 all the same), so that 0 · log p = 0."""
        rows = z[r0:r1]
        out = (self.buffers(z.shape[0], z.shape[1])[1][r0:r1] if keep
               else self.scratch("logp", rows.shape))
        logp = torch.sub(rows, lse[r0:r1, None], out=out)
        if self.head is None:  # a head's logits are finite
            logp.clamp_min_(torch.finfo(logp.dtype).min)
        return torch.exp(logp, out=rows), logp

    def piece_mix(self, shape: tuple[int, ...]) -> Tensor:
        """The scratch tensor of _jsd_block for a piece of rows."""
        return self.scratch("mix", shape)

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
                ) -> Tensor:
        """A reusable scratch tensor by name (grown when a larger one is asked)."""
        dtype = self.dtype if dtype is None else dtype
        size = math.prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            buf = self._scratch[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:size].view(shape)

    def position_chunks(self, a: int = 0, b: int | None = None) -> Iterator[tuple[int, int]]:
        """Consecutive ranges of at most chunk_positions valid rows covering rows a..b."""
        b = self.n if b is None else b
        for a1 in range(a, b, self.cp):
            yield a1, min(a1 + self.cp, b)

    def cache_rows(self) -> int:
        """The most rows whose logits over the whole vocabulary fill() keeps: CACHE_BLOCKS blocks
        of the requested chunk_positions × chunk_vocab (the same on every rank)."""
        return max(1, CACHE_BLOCKS * self.chunk_positions * self.cv // self.vocab)

    def fill(self, a: int, b: int) -> Tensor:
        """Form the scaled logits of valid rows a..b (at most cache_rows()) over the whole
        vocabulary once, keep them for block(a, b, ...), and return their logsumexp (b − a,), the
        same values as _logsumexp's (one pass of _block_moments per chunk, z kept). The kept
        logits are read once: block() hands them out to be overwritten."""
        n = b - a
        if self._cache is None or self._cache.numel() < n * self.vocab:
            self._cache = None
            self._cache = torch.empty(n * self.vocab, dtype=self.dtype, device=self.device)
        self._filled = None
        mom = None
        for c0, c1 in self.vocab_chunks():
            z = self._block_into(a, b, c0, c1, self._cache[n * c0:n * c1].view(n, c1 - c0))
            _, shifted = self.buffers(n, c1 - c0)
            mom = _merge(mom, _block_moments(z, finite=self.head is not None, full=False,
                                             shifted=shifted))
        self._filled = (a, b)
        return mom.m + mom.s0.log()

    def release(self) -> None:
        """Forget fill()'s logits (they have been overwritten)."""
        self._filled = None

    def vocab_chunks(self) -> Iterator[tuple[int, int]]:
        for c in range(0, self.vocab, self.cv):
            yield c, min(c + self.cv, self.vocab)

    def buffers(self, n: int, v: int) -> tuple[Tensor, Tensor]:
        """Two contiguous (n, v) scratch tensors reused across blocks (no fresh page faults).

        Every caller asks for at most chunk_positions rows (group_step_jsd's blocks included);
        it would grow for more.
        """
        size = n * v
        if 2 * size > self._buf.numel():
            self._buf = torch.empty(2 * size, dtype=self.dtype, device=self.device)
        return self._buf[:size].view(n, v), self._buf[size : 2 * size].view(n, v)

    def hidden_rows(self, a: int, b: int) -> Tensor:
        """Hidden states (b - a, D) of valid positions a..b on the compute device, in the compute
        dtype, temperature folded in; kept for the vocabulary chunks of the same rows."""
        if self._cached != (a, b):
            self._cached_rows = None  # free the previous block before the next one arrives
            rows = self.data[self._data_rows[a:b]]  # (b - a, D) where hidden is, in its dtype
            self._cached_rows = rows.to(device=self.device, dtype=self.dtype) * self.inv_t
            self._cached = (a, b)
        return self._cached_rows

    def block(self, a: int, b: int, c0: int, c1: int) -> Tensor:
        """Scaled logits (b - a, c1 - c0) of valid positions a..b, in a reusable buffer (fill()'s
        when it holds these rows)."""
        if self._filled == (a, b):
            n = b - a
            return self._cache[n * c0:n * c1].view(n, c1 - c0)
        return self._block_into(a, b, c0, c1, self.buffers(b - a, c1 - c0)[0])

    def _block_into(self, a: int, b: int, c0: int, c1: int, out: Tensor) -> Tensor:
        """block()'s logits, formed in out (b - a, c1 - c0)."""
        if self.head is None:
            out.copy_(self.data[self._data_rows[a:b], c0:c1])  # moved and cast by copy_
            if self.inv_t != 1.0:
                out.mul_(self.inv_t)
        else:
            w = self.head[c0:c1].to(self.dtype)  # (v, D); no copy when already float32
            torch.matmul(self.hidden_rows(a, b), w.T, out=out)
            if self.bias is not None:
                out.add_(self.bias[c0:c1])
        return out

    def probs(self, a: int, b: int, c0: int, c1: int, lse: Tensor) -> Tensor:
        """p = exp(z/T - logsumexp) (b - a, c1 - c0) of valid positions a..b."""
        return self.block(a, b, c0, c1).sub_(lse[a:b, None]).exp_()

    def reorder(self, order: Tensor) -> None:
        """Visit the valid positions in the order rows[order]: block(a, b) and scatter follow it."""
        self.rows = self.rows[order]
        self._data_rows = self._data_rows[order.to(self._data_rows.device)]
        self._cached = self._cached_rows = None

    def scatter(self, values: Tensor) -> Tensor:
        """(N_valid,) values at the valid positions -> (...) with 0 elsewhere."""
        out = torch.zeros(self.valid.shape[0], dtype=values.dtype, device=self.device)
        out[self.rows] = values
        return out.reshape(self.shape)


def _row_pieces(n: int, rows: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [r0, r1) of `rows` rows covering range(n), the last one shorter,
    but never a single row when n > 1 (it joins the range before it): torch sums the rows of a
    tensor of several rows one row per thread, but a single row in two halves, another
    rounding, and a row's statistics must not depend on the pieces."""
    starts = list(range(0, n, max(rows, 2)))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return [(r0, starts[i + 1] if i + 1 < len(starts) else n) for i, r0 in enumerate(starts)]


def _token_ids_valid(src: _Source, token_ids: Tensor) -> Tensor:
    if token_ids.shape != src.shape:
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} != positions {tuple(src.shape)}")
    ids = token_ids.reshape(-1).to(src.device)[src.rows].long()  # (N_valid,)
    if ids.numel() and (ids.min() < 0 or ids.max() >= src.vocab):
        raise ValueError(f"token ids outside the vocabulary [0, {src.vocab})")
    return ids


def _stats(src: _Source, ids: Tensor | None, full: bool = True, rows: tuple[int, int] = (0, -1)
           ) -> dict[str, Tensor]:
    """Per valid position (N_valid,): logsumexp, entropy, renyi2, max_prob[, logprob]; only the
    logsumexp with full=False; of valid rows rows[0]..rows[1] only (-1: to the last)."""
    parts: dict[str, list[Tensor]] = {}
    for a, b in src.position_chunks(rows[0], src.n if rows[1] < 0 else rows[1]):
        mom = None
        tok = None if ids is None else torch.zeros(b - a, dtype=src.dtype, device=src.device)
        for c0, c1 in src.vocab_chunks():
            z = src.block(a, b, c0, c1)  # (n, v)
            if tok is not None:
                local = ids[a:b] - c0  # (n,)
                inside = (local >= 0) & (local < c1 - c0)
                picked = z.gather(1, local.clamp(0, c1 - c0 - 1)[:, None]).squeeze(1)
                tok = torch.where(inside, picked, tok)
            _, scratch = src.buffers(b - a, c1 - c0)
            mom = _merge(mom, _piece_moments(z, scratch, src.head is not None, full,
                                             src.piece_rows(c1 - c0)))
        out = _finish(mom) if full else {"logsumexp": mom.m + mom.s0.log()}
        if tok is not None:
            out["logprob"] = tok - out["logsumexp"]
        for key, value in out.items():
            parts.setdefault(key, []).append(value)
    keys = (["logsumexp", "entropy", "renyi2", "max_prob"] if full else ["logsumexp"]) + (
        [] if ids is None else ["logprob"])
    empty = torch.zeros(0, dtype=src.dtype, device=src.device)
    return {k: torch.cat(parts[k]) if k in parts else empty for k in keys}


def _logsumexp(src: _Source, a: int = 0, b: int = -1) -> Tensor:
    """logsumexp (N_valid,), or of valid rows a..b: the same values as _stats's, without its
    entropy and Rényi passes."""
    return _stats(src, None, full=False, rows=(a, b))["logsumexp"]


def _distribution_sum(src: _Source, lse: Tensor) -> Tensor:
    total = torch.zeros(src.vocab, dtype=src.dtype, device=src.device)  # (V,)
    for a, b in src.position_chunks():
        for c0, c1 in src.vocab_chunks():
            total[c0:c1] += src.probs(a, b, c0, c1, lse).sum(dim=0)
    return total


def _jsd(src: _Source, lse: Tensor, mean_dist: Tensor) -> Tensor:
    q = mean_dist.to(device=src.device, dtype=src.dtype)  # (V,)
    if q.shape != (src.vocab,):
        raise ValueError(f"mean distribution of shape {tuple(q.shape)}, expected ({src.vocab},)")
    out = torch.zeros(src.n, dtype=src.dtype, device=src.device)  # (N_valid,)
    for a, b in src.position_chunks():
        for c0, c1 in src.vocab_chunks():
            ref = q[None, c0:c1]  # (1, v)
            log_ref = _log_probs(ref)
            z = src.block(a, b, c0, c1)  # (n, v)
            for r0, r1 in _row_pieces(b - a, src.piece_rows(c1 - c0)):
                p, logp = src.piece_probs(z, lse[a:b], r0, r1)
                out[a + r0:a + r1] += _jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape))
    return out.clamp_(0.0, LN2)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def token_statistics(
    logits: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    token_ids: Tensor | None = None,
    *,
    jsd: bool = False,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> dict[str, Tensor]:
    """Statistics of p = softmax(logits / T) at every position of logits (..., V).

    Returns tensors of shape (...) in the compute dtype (float32, or float64 for float64 input):
    ``entropy``, ``renyi2``, ``logsumexp``, ``max_prob``; ``logprob`` when token_ids (...) is
    given; ``jsd`` (d = JSD(p ‖ p̄), p̄ the mean over the valid positions) when jsd=True.
    All in nats except max_prob. Masked positions (mask 0 / False) hold 0.
    The logits are read block by block, so no (..., V) float32 copy of them is made.
    Runs under no_grad: these statistics score and describe tokens; the loss computes its own
    log-probabilities with gradient.
    """
    return _all_statistics(
        logits, None, token_ids, temperature, mask, None, chunk_positions, chunk_vocab, jsd
    )


@torch.no_grad()
def chunked_token_statistics(
    hidden: Tensor,
    head_weight: Tensor | None,
    token_ids: Tensor | None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
    *,
    jsd: bool = True,
) -> dict[str, Tensor]:
    """Statistics of p = softmax((hidden · W^T + b) / T) without materialising the logits.

    hidden (..., D), head_weight (V, D), head_bias (V,) or None, token_ids (...) or None.
    Streams over chunk_positions × chunk_vocab blocks of logits (peak memory O(their product));
    returns (...) tensors ``entropy``, ``renyi2``, ``logsumexp``, ``max_prob`` and (with
    token_ids) ``logprob``, all nats but max_prob; with jsd=True also ``jsd`` (nats), the
    deviation d = JSD(p ‖ p̄) from the mean distribution p̄ over the valid positions, which costs
    two more passes over the vocabulary (p̄, then d). Masked positions hold 0.
    head_weight=None reads `hidden` as materialised logits (..., V).
    """
    return _all_statistics(
        hidden, head_weight, token_ids, temperature, mask, head_bias,
        chunk_positions, chunk_vocab, jsd,
    )


def _all_statistics(
    hidden, head_weight, token_ids, temperature, mask, head_bias, chunk_positions, chunk_vocab,
    jsd,
) -> dict[str, Tensor]:
    src = _Source(hidden, head_weight, temperature, mask, head_bias, chunk_positions, chunk_vocab)
    ids = None if token_ids is None else _token_ids_valid(src, token_ids)
    out = _stats(src, ids)
    if jsd:
        mean_dist = _distribution_sum(src, out["logsumexp"]) / max(src.n, 1)
        out["jsd"] = _jsd(src, out["logsumexp"], mean_dist)
    return {key: src.scatter(value) for key, value in out.items()}


@torch.no_grad()
def distribution_sum(
    hidden: Tensor,
    head_weight: Tensor | None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> tuple[Tensor, int]:
    """(Σ_i p_i over the valid positions (V,), number of valid positions).

    The pieces of p̄ that ranks all-reduce before dividing. logsumexp (...) from
    :func:`chunked_token_statistics` saves a pass over the vocabulary.
    """
    src = _Source(hidden, head_weight, temperature, mask, head_bias, chunk_positions, chunk_vocab)
    lse = _logsumexp(src) if logsumexp is None else _valid_values(src, logsumexp)
    return _distribution_sum(src, lse), src.n


def mean_distribution(
    hidden: Tensor,
    head_weight: Tensor | None,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> Tensor:
    """p̄ (V,): the mean of p_i over the valid positions (zeros when there are none)."""
    total, n = distribution_sum(
        hidden, head_weight, temperature, mask, head_bias, logsumexp, chunk_positions, chunk_vocab
    )
    return total / max(n, 1)


@torch.no_grad()
def jsd_to_mean(
    hidden: Tensor,
    head_weight: Tensor | None,
    mean_dist: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> Tensor:
    """d_i = JSD(p_i ‖ mean_dist) in nats, (...), 0 at masked positions; mean_dist (V,)."""
    src = _Source(hidden, head_weight, temperature, mask, head_bias, chunk_positions, chunk_vocab)
    lse = _logsumexp(src) if logsumexp is None else _valid_values(src, logsumexp)
    return src.scatter(_jsd(src, lse, mean_dist))


def _valid_values(src: _Source, values: Tensor) -> Tensor:
    if values.shape != src.shape:
        raise ValueError(f"shape {tuple(values.shape)} != positions {tuple(src.shape)}")
    return values.reshape(-1).to(device=src.device, dtype=src.dtype)[src.rows]


@torch.no_grad()
def group_step_jsd(
    hidden: Tensor,
    head_weight: Tensor | None,
    keys: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    *,
    leave_out: bool = False,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    all_keys: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> Tensor:
    """u_i = JSD(p_i ‖ mean of p over the positions sharing i's key) in nats, (...), in [0, ln 2].

    With keys = (group, step) this is ICT's uniqueness u_{i,t} = JSD(p_{i,t} ‖ P̄_t) (METHODS §3);
    with keys = the response, resp. the group, it is the response-mean, resp. group-pooled
    reading of the reference, and with leave_out=True the group-step reading that leaves the
    response out (stages.core.statistics.deviations.DEVIATIONS composes the keys of each).

    p = softmax(z / T) over the full vocabulary, z from hidden (..., D) × head_weight (V, D)
    [+ head_bias (V,)], or hidden read as materialised logits (..., V) when head_weight is None.
    keys (...) integer: the key of each position, composed by the caller (e.g.
    group * max_len + step). The reference of a key is the mean of p over the valid positions with
    that key: padding (mask 0 / False) is excluded from the mean (ours; the paper does not say how
    unequal lengths are handled), is never computed, and holds 0 in the result. A key that one
    position alone holds (a step where one response of the group is still active) has a reference
    equal to p bit for bit, so u = 0 exactly. Returned in the compute dtype (float32; float64 for
    float64 input). logsumexp (...), e.g. from :func:`chunked_token_statistics`, saves the first
    pass.

    leave_out: the reference of row i with key k is (S_k − p_i) / (n_k − 1), S_k the float64 sum
    of p over the key's n_k rows (over every rank), the difference clamped at 0 against rounding.
    A key that one row alone holds leaves no reference: its u is 0 (ours).

    Resolution: u below U_FLOOR_ULPS machine epsilons of the compute dtype (7.6e-6 nats in
    float32, 1.4e-14 in float64) is set to exactly 0. Where a group's responses agree (the same
    context, so the same distribution up to rounding) the computed u is rounding noise, and ICT
    ranks positions by u: with the floor, such positions tie at 0 and the tie goes to the earliest
    position, so the mask does not depend on the noise (ours; checked against a float64
    recomputation of the default run's token statistics).

    Memory: the valid rows are sorted by key (stably, so ties keep position order). Keys are
    visited in blocks of whole keys of at most chunk_positions rows in all (counted over every
    rank); for each block and chunk of chunk_vocab entries, p of its rows, the per-key sums of
    that chunk (index_add, float64) and the JSD terms of each row against its key's reference are
    formed, one pass over the vocabulary after the logsumexp pass. A key of more rows than
    chunk_positions (a whole response, or a whole group of 8 × 2,048 positions, as one key) is
    visited on its own in sub-blocks of chunk_positions rows, in two passes: its full-vocabulary
    sum (V,) float64 first, then the JSD terms, each row's p computed twice. Without logsumexp
    and with a head, a block holds at most CACHE_BLOCKS · chunk_positions · chunk_vocab / V rows
    (441 at the defaults and V = 151,936), whose logits over the whole vocabulary are formed once
    and kept between the logsumexp and the divergences, so the head's matmul runs once per row
    (a larger key, and materialised logits, as before). Nothing larger than chunk_positions ×
    chunk_vocab (a few buffers of it, CACHE_BLOCKS of them for the kept logits, two for a
    float64 copy of a block's p) or keys × V (for the keys of one block, whose count is bounded
    by chunk_positions) ever exists.

    Ranks: when a key's rows sit on several processes, all_reduce (sums a tensor over the ranks,
    returning the sum) is applied to the per-key counts once, to every block's per-key sums of
    each vocabulary chunk, and to every large key's (V,) sum, and all_keys (1-D, sorted unique
    keys of every rank, gathered by the caller) fixes the blocks (from the summed counts), so that
    every rank makes the same collective calls in the same order, also for blocks in which it
    holds no row. The float64 sums make u independent of how rows are split, to rounding. Without
    all_reduce, all_keys defaults to this call's unique keys.
    """
    return group_step_reference(
        hidden, head_weight, keys, temperature, mask, head_bias, logsumexp, leave_out=leave_out,
        all_reduce=all_reduce, all_keys=all_keys, chunk_positions=chunk_positions,
        chunk_vocab=chunk_vocab)["u"]


REFERENCE_FIELDS = ("prob", "beta", "key_sum", "own", "count")
"""What :func:`group_step_reference` returns per position beside u, float64 (METHODS §3, ours):

- ``prob``     the reference's probability of the position's token, P̄(y) (ICT: P̄_t(y_{i,t}));
- ``beta``     β = Σ_a P̄(a)², the reference's collision probability (1/V ≤ β ≤ 1);
- ``key_sum``  S_k(y) = Σ_j p_j(y) over the key's rows j, the row itself included, whatever
  leave_out says (so that a caller can leave out another part of the key: :func:`mean_without`);
- ``own``      p_i(y), the position's own probability of its token, from the same blocks;
- ``count``    n_k, the key's rows (over every rank).

Leaving the row out, prob and beta are those of (S_k − p_i) / (n_k − 1), NaN for a lone row
(it has no reference)."""


@torch.no_grad()
def group_step_reference(
    hidden: Tensor,
    head_weight: Tensor | None,
    keys: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    head_bias: Tensor | None = None,
    logsumexp: Tensor | None = None,
    *,
    token_ids: Tensor | None = None,
    leave_out: bool = False,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    all_keys: Tensor | None = None,
    chunk_positions: int = CHUNK_POSITIONS,
    chunk_vocab: int = CHUNK_VOCAB,
) -> dict[str, Tensor]:
    """:func:`group_step_jsd` (``u``) and, with token_ids (...), the reference's probability of
    each position's token and its β, from the same pass over the vocabulary (REFERENCE_FIELDS).

    Arguments, u, blocks, ranks and memory as :func:`group_step_jsd`. The extras read the float64
    per-key sums that u's references are made of, at the column of each row's token (a gather per
    vocabulary chunk) and, for β, their squares summed over each chunk (of the key's mean; of each
    row's own reference leaving the row out, whose float64 block exists anyway): nothing of size
    positions × V is added, and no collective call (they read the sums after all_reduce). A key
    that one row alone holds has prob = own exactly (its sum is the row's p) and β = Σ p². The
    extras are float64 (..., 0 at masked positions); u is in the compute dtype.
    """
    src = _Source(hidden, head_weight, temperature, mask, head_bias, chunk_positions, chunk_vocab)
    if keys.shape != src.shape:
        raise ValueError(f"keys shape {tuple(keys.shape)} != positions {tuple(src.shape)}")
    if keys.dtype.is_floating_point or keys.dtype.is_complex or keys.dtype == torch.bool:
        raise ValueError(f"keys must be integers, got {keys.dtype}")
    row_keys, order = torch.sort(keys.reshape(-1).to(src.device)[src.rows].long(), stable=True)
    src.reorder(order)  # the rows of a key are now contiguous
    ids = None if token_ids is None else _token_ids_valid(src, token_ids)  # (N_valid,) sorted rows
    # without a logsumexp, each block's is formed block by block below: with a head, from
    # logits kept for the block's second pass (fill), in blocks of at most cache_rows() rows
    keep = logsumexp is None and src.head is not None
    lse = (torch.empty(src.n, dtype=src.dtype, device=src.device) if logsumexp is None
           else _valid_values(src, logsumexp))  # (N_valid,)
    if all_keys is None:
        if all_reduce is not None:
            raise ValueError("all_reduce needs all_keys: the sorted unique keys of every rank")
        all_keys = torch.unique_consecutive(row_keys)  # (K,)
    else:
        all_keys = all_keys.to(src.device).long()
        if all_keys.dim() != 1 or not bool((all_keys[1:] > all_keys[:-1]).all()):
            raise ValueError("all_keys must be 1-D, sorted and unique")
    n_keys = all_keys.numel()
    out = torch.zeros(src.n, dtype=src.dtype, device=src.device)  # (N_valid,)
    extras = None if ids is None else {
        f: torch.zeros(src.n, dtype=torch.float64, device=src.device) for f in ("key_sum", "own", "beta")}
    if n_keys == 0:
        return _reference_result(src, out, extras, None, leave_out)
    key_index = torch.searchsorted(all_keys, row_keys)  # (N_valid,) into all_keys
    if src.n and not bool((all_keys[key_index.clamp(max=n_keys - 1)] == row_keys).all()):
        raise ValueError("keys missing from all_keys")
    local_counts = torch.bincount(key_index, minlength=n_keys)  # (K,)
    counts = local_counts.to(torch.float64)
    if all_reduce is not None:
        counts = all_reduce(counts)
    # row range of each key in the sorted local rows; blocks from the global counts only
    start = torch.cat([local_counts.new_zeros(1), local_counts.cumsum(0)]).tolist()
    # the reference's divisor: n_k, or n_k − 1 leaving the row out (1 for a lone key: u = 0 below)
    divisor = (counts - 1.0 if leave_out else counts).clamp_min(1.0)  # (K,)
    # blocks from chunk_positions itself, not from this rank's share of rows (src.cp)
    limit = min(chunk_positions, src.cache_rows()) if keep else chunk_positions
    for k0, k1 in _key_blocks(counts.round().long().tolist(), limit):
        a, b = start[k0], start[k1]
        if a == b and all_reduce is None:
            continue  # keys of all_keys that no row here holds, and no rank to answer
        large = k1 - k0 == 1 and float(counts[k0]) > chunk_positions  # read twice: not kept
        if logsumexp is None and b > a:
            lse[a:b] = (src.fill(a, b) if keep and not large and b - a <= src.cache_rows()
                        else _logsumexp(src, a, b))
        block = None if extras is None else {f: v[a:b] for f, v in extras.items()}  # views
        row_ids = None if ids is None else ids[a:b]
        if large:
            out[a:b] = _large_key_jsd(src, lse, a, b, float(divisor[k0]), leave_out, all_reduce,
                                      row_ids, block)
        else:
            out[a:b] = _key_block_jsd(src, lse, a, b, key_index[a:b] - k0, divisor[k0:k1],
                                      leave_out, all_reduce, row_ids, block)
        src.release()
    if leave_out:
        out[counts[key_index] < 2] = 0.0  # a lone row: no other response to compare with
    out.clamp_(0.0, LN2)
    out[out < U_FLOOR_ULPS * torch.finfo(out.dtype).eps] = 0.0
    return _reference_result(src, out, extras, counts[key_index], leave_out)


def _reference_result(src: _Source, u: Tensor, extras: dict[str, Tensor] | None,
                      count: Tensor | None, leave_out: bool) -> dict[str, Tensor]:
    """group_step_reference's dict, every value scattered to the positions' shape; extras
    (key_sum, own, beta per sorted valid row) and count (N_valid,) float64 become
    REFERENCE_FIELDS."""
    if extras is None:
        return {"u": src.scatter(u)}
    if count is None:  # no valid position
        count = torch.zeros(src.n, dtype=torch.float64, device=src.device)
    # the reference's probability of the token: the key's mean, without the row's own p(y)
    # leaving it out
    prob = (mean_without(extras["key_sum"], count, extras["own"]) if leave_out
            else mean_without(extras["key_sum"], count, torch.zeros_like(count), 0.0))
    if leave_out:
        extras["beta"][count < 2] = math.nan  # no reference: nothing to square
    values = {"prob": prob, "beta": extras["beta"], "key_sum": extras["key_sum"],
              "own": extras["own"], "count": count}
    return {"u": src.scatter(u), **{f: src.scatter(values[f]) for f in REFERENCE_FIELDS}}


def mean_without(total: Tensor, count: Tensor, part: Tensor, part_count: Tensor | float = 1.0
                 ) -> Tensor:
    """(total − part) / (count − part_count), float64: the mean over a set of `count` members
    whose sum is `total`, with a part of `part_count` members summing to `part` left out (one
    row: its own value and 1; a response: its own sum and length). Clamped at 0, since the
    difference of two float sums can round below 0 where the rest holds ~0; NaN where nothing is
    left (count − part_count < 1). All broadcast; counts are whole numbers."""
    left = torch.as_tensor(count, dtype=torch.float64) - part_count  # (...)
    rest = total.double() - part.double()
    return torch.where(left > 0.5, _divide_rest(rest, left.clamp_min(1.0)),
                       torch.tensor(math.nan, dtype=torch.float64, device=rest.device))


def _divide_rest(rest: Tensor, divisor: Tensor | float) -> Tensor:
    """rest / divisor clamped at 0, in place (rest float64: a sum minus the part left out, which
    can round below 0 where the others' values are ~0); divisor ≥ 1."""
    return rest.div_(divisor).clamp_min_(0.0)


def _key_blocks(counts: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive key ranges [k0, k1) of at most `limit` rows in all; a key of more rows alone.

    counts are the rows of each key over every rank, so every rank forms the same blocks."""
    blocks, k0, rows = [], 0, 0
    for k, n in enumerate(counts):
        if k > k0 and rows + n > limit:
            blocks.append((k0, k))
            k0, rows = k, 0
        rows += n
    if k0 < len(counts):
        blocks.append((k0, len(counts)))
    return blocks


def _at_tokens(values: Tensor, ids: Tensor, c0: int, c1: int, rows: Tensor | None = None) -> Tensor:
    """(n,) float64: each row's entry at its token's column of a vocabulary chunk [c0, c1), 0 for
    a row whose token lies outside it; values (m, c1 − c0) holds row r's entries in its row r,
    or in its row rows[r]."""
    local = ids - c0
    inside = (local >= 0) & (local < c1 - c0)
    which = torch.arange(ids.numel(), device=ids.device) if rows is None else rows
    return torch.where(inside, values[which, local.clamp(0, c1 - c0 - 1)].double(), 0.0)


@dataclass(frozen=True)
class _Piece:
    """Rows [r0, r1) of a block's sorted rows, within the block: keys [k0, k1) of the block with
    `rows` rows each, so that they view as (keys, rows, v). A key of more rows than a piece is
    split over several pieces; first / last: the piece holds the key's first / last rows."""

    r0: int
    r1: int
    k0: int
    k1: int
    rows: int
    first: bool = True
    last: bool = True


def _key_pieces(counts: list[int], limit: int) -> list[_Piece]:
    """The pieces of a block, in row order, from the rows of each of its keys here (counts):
    consecutive keys of one count together, up to `limit` rows, and a key of more rows in pieces
    of at most `limit` (the last one never a single row, see _row_pieces); keys without rows here
    are in no piece."""
    pieces, r, k = [], 0, 0
    while k < len(counts):
        c = counts[k]
        if c > limit:
            for j0, j1 in _row_pieces(c, limit):
                pieces.append(_Piece(r + j0, r + j1, k, k + 1, j1 - j0, j0 == 0, j1 == c))
            k1 = k + 1
        else:
            k1 = k + 1
            while k1 < len(counts) and counts[k1] == c and (k1 + 1 - k) * c <= limit:
                k1 += 1
            if c:
                pieces.append(_Piece(r, r + (k1 - k) * c, k, k1, c))
        r, k = r + (k1 - k) * c, k1
    return pieces


def _probs_and_sums(src: _Source, z: Tensor, lse: Tensor, piece: _Piece, sums: Tensor,
                    keep: bool) -> tuple[Tensor, Tensor]:
    """(p, log p) of a piece's rows, each (keys, rows, v) (src.piece_probs: p in z's place, log p
    kept for the block when `keep`), p added to the float64 sums (k, v) of its keys row after
    row, the sums index_add_ forms (torch.sum's order over rows depends on the shapes)."""
    p, logp = src.piece_probs(z, lse, piece.r0, piece.r1, keep)
    shape = (piece.k1 - piece.k0, piece.rows, p.shape[-1])
    p, logp = p.view(shape), logp.view(shape)
    acc = sums[piece.k0:piece.k1]  # (keys, v)
    # widened once, then added in float64: adding float32 rows to float64 ones element by
    # element converts each entry on its own, ~3x slower on a CPU; the same bits (exact casts)
    wide = src.scratch("wide", shape, torch.float64).copy_(p)
    if piece.first:
        acc.copy_(wide[:, 0])
    for j in range(1 if piece.first else 0, piece.rows):
        acc.add_(wide[:, j])
    return p, logp


def _row_sums(x: Tensor, alone: bool) -> Tensor:
    """x.sum(dim=-1), x (..., v) float64, with each row's sum as torch forms it inside a block of
    several rows: torch sums a tensor of a single row in two halves (one per thread), another
    rounding, so a lone row is summed beside a copy of itself, unless `alone` (its block has no
    other row: the sum it always had)."""
    if x.numel() == x.shape[-1] and not alone:
        return x.reshape(1, -1).expand(2, -1).sum(dim=1)[:1].reshape(x.shape[:-1])
    return x.sum(dim=-1)


def _piece_jsd(src: _Source, p: Tensor, logp: Tensor, piece: _Piece, sums: Tensor,
               divisor: Tensor, leave_out: bool, beta: Tensor | None, alone: bool) -> Tensor:
    """u's terms (piece rows,) of one vocabulary chunk: p and log p (keys, rows, v), sums (k, v)
    float64 over every rank, divisor (k,). A key's reference (and its log) is formed when the
    piece holds its first rows, then kept for its later pieces; leaving the row out, each row's
    own (adding its β's terms to beta (piece rows,) when given)."""
    k0, k1 = piece.k0, piece.k1
    if leave_out:
        rest = torch.sub(sums[k0:k1, None, :], p,  # (keys, rows, v) float64: S_k − p_i
                         out=src.scratch("wide", p.shape, torch.float64))
        ref = _leave_out_reference(rest, divisor[k0:k1, None, None], src.scratch("ref", p.shape))
        if beta is not None:  # rest now holds each row's float64 reference
            beta += _row_sums(rest.square_(), alone).reshape(-1)
        log_ref = _log_probs(ref, out=src.scratch("log_ref", p.shape))
    else:
        shape = (k1 - k0, 1, p.shape[-1])
        ref, log_ref = src.scratch("ref", shape), src.scratch("log_ref", shape)
        half = src.scratch("half_ref", shape)
        if piece.first:  # exactly p for a lone key
            # divided in float64, then rounded once (a float64 / float64 division written to
            # float32 converts entry by entry, several times slower)
            mean = torch.div(sums[k0:k1, None], divisor[k0:k1, None, None],
                             out=src.scratch("mean", shape, torch.float64))
            ref.copy_(mean)
            _log_probs(ref, out=log_ref)
            _half(ref, out=half)
        return _jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape), half).reshape(-1)
    return _jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape)).reshape(-1)


def _key_block_jsd(src: _Source, lse: Tensor, a: int, b: int, local: Tensor, divisor: Tensor,
                   leave_out: bool, all_reduce: Callable[[Tensor], Tensor] | None,
                   ids: Tensor | None = None, extras: dict[str, Tensor] | None = None) -> Tensor:
    """u (b - a,) of sorted valid rows a..b holding whole keys; local (b - a,) the key of each row
    within the block, divisor (k,) float64 of each key. With ids (b - a,) the rows' tokens, adds
    each row's key_sum, own and beta (REFERENCE_FIELDS) of this block's chunks into extras.

    Each vocabulary chunk's block of logits is visited in pieces of rows (_key_pieces): p and its
    keys' float64 sums, then the JSD terms of the same rows while they are in the cache. Without
    all_reduce a piece's keys are complete when it ends (a split key's: with its last piece); with
    it, every key's sum goes through the collective first, so p of every piece is formed before
    any JSD term (p stays in the block's buffer)."""
    k, n = divisor.numel(), b - a
    u = torch.zeros(n, dtype=src.dtype, device=src.device)
    key_beta = None if extras is None or leave_out else torch.zeros(k, dtype=torch.float64,
                                                                    device=src.device)
    counts = torch.bincount(local, minlength=k).tolist()  # the rows of each key here
    lse = lse[a:b]
    for c0, c1 in src.vocab_chunks():
        sums = src.scratch("sums", (k, c1 - c0), torch.float64)  # (k, v)
        if n == 0 or 0 in counts:
            sums.zero_()  # keys no row here holds (other ranks' rows)
        if n == 0:
            all_reduce(sums)
            continue
        z = src.block(a, b, c0, c1)  # (n, v); p in its place after _probs_and_sums
        pieces = _key_pieces(counts, src.piece_rows(c1 - c0))
        if all_reduce is None:
            groups, pending = [], []
            for piece in pieces:
                pending.append(piece)
                if piece.last:
                    groups.append(pending)
                    pending = []
        else:
            groups = [pieces]
        probs: dict[int, tuple[Tensor, Tensor]] = {}
        for group in groups:
            for piece in group:
                probs[piece.r0] = _probs_and_sums(src, z, lse, piece, sums,
                                                  keep=len(group) > 1)
            if all_reduce is not None:
                sums = all_reduce(sums)
            for piece in group:
                beta = None if extras is None or not leave_out else extras["beta"][piece.r0:piece.r1]
                u[piece.r0:piece.r1] += _piece_jsd(src, *probs.pop(piece.r0), piece, sums,
                                                   divisor, leave_out, beta, alone=n == 1)
        if extras is not None:
            extras["key_sum"] += _at_tokens(sums, ids, c0, c1, rows=local)
            extras["own"] += _at_tokens(z, ids, c0, c1)  # p in z's place
            if key_beta is not None:  # the block's keys at once, as their sums' rows
                key_beta += sums.div_(divisor[:, None]).square().sum(dim=1)
    if key_beta is not None:
        extras["beta"] += key_beta[local]
    return u


def _large_key_jsd(src: _Source, lse: Tensor, a: int, b: int, divisor: float, leave_out: bool,
                   all_reduce: Callable[[Tensor], Tensor] | None, ids: Tensor | None = None,
                   extras: dict[str, Tensor] | None = None) -> Tensor:
    """u (b - a,) of sorted valid rows a..b, all of one key of more than chunk_positions rows
    (over every rank): the key's sum over the whole vocabulary first, then the JSD terms, in
    sub-blocks of chunk_positions rows (visited in pieces of rows, as _key_block_jsd). With ids
    (b - a,), extras as :func:`_key_block_jsd`."""
    sums = torch.zeros(src.vocab, dtype=torch.float64, device=src.device)  # (V,)
    for a1 in range(a, b, src.cp):
        b1 = min(a1 + src.cp, b)
        for c0, c1 in src.vocab_chunks():
            sums[c0:c1] += src.probs(a1, b1, c0, c1, lse).sum(dim=0, dtype=torch.float64)
    if all_reduce is not None:
        sums = all_reduce(sums)
    mean = None if leave_out else sums / divisor  # (V,) float64
    if extras is not None:
        extras["key_sum"] += sums[ids]
        if mean is not None:
            extras["beta"] += mean.square().sum()
    mean = None if mean is None else mean.to(src.dtype)
    u = torch.zeros(b - a, dtype=src.dtype, device=src.device)
    for a1 in range(a, b, src.cp):
        b1 = min(a1 + src.cp, b)
        for c0, c1 in src.vocab_chunks():
            z = src.block(a1, b1, c0, c1)  # (n, v); p in its place, piece by piece
            if not leave_out:
                ref = mean[None, c0:c1]  # (1, v)
                log_ref = _log_probs(ref)
            for r0, r1 in _row_pieces(b1 - a1, src.piece_rows(c1 - c0)):
                rows = slice(a1 - a + r0, a1 - a + r1)
                p, logp = src.piece_probs(z, lse[a1:b1], r0, r1)  # (m, v) each
                if leave_out:
                    rest = torch.sub(sums[None, c0:c1], p,  # (m, v) float64: S_k − p_i
                                     out=src.scratch("wide", p.shape, torch.float64))
                    ref = _leave_out_reference(rest, divisor, src.scratch("ref", p.shape))
                    if extras is not None:
                        extras["beta"][rows] += _row_sums(rest.square_(), alone=b1 - a1 == 1)
                    log_ref = _log_probs(ref, out=src.scratch("log_ref", p.shape))
                u[rows] += _jsd_block(p, logp, ref, log_ref, src.piece_mix(p.shape))
            if extras is not None:
                extras["own"][a1 - a:b1 - a] += _at_tokens(z, ids[a1 - a:b1 - a], c0, c1)
    return u


def _leave_out_reference(rest: Tensor, divisor: Tensor | float, out: Tensor) -> Tensor:
    """rest / divisor clamped at 0 (_divide_rest, in place: rest holds it after), written into
    out in its dtype; rest (n, v) float64 holds S − p, divisor (n, 1) or a float."""
    return out.copy_(_divide_rest(rest, divisor))


# ---------------------------------------------------------------------------------------------
# The ceiling of a deviation from a mixture that contains p itself
# ---------------------------------------------------------------------------------------------
def jsd_ceiling(w: Tensor | float) -> Tensor:
    """c(w) = max over distributions p, r of JSD(p ‖ w·p + (1 − w)·r), in nats, float64, w ∈ [0, 1].

        c(w) = ½ [ln(2 / (1 + w)) + w·ln(2w / (1 + w)) + (1 − w)·ln 2];  c(0) = ln 2, c(1) = 0.

    w is the weight of p itself in its reference mixture q = w·p + (1 − w)·r: 1/n_t for ICT's
    rule (n_t active responses of the group at step t), 1/T_i for the response-mean reading,
    1/(the group's positions) for the group-pooled one, 0 leaving the response out.

    Derivation. JSD(p ‖ q) = Σ_j φ(p_j, q_j) with φ(x, y) = ½[x·ln(2x/(x+y)) + y·ln(2y/(x+y))],
    convex and positively homogeneous of degree 1. So is g(x, y) = φ(x, w·x + (1 − w)·y), hence
    subadditive: g(x, y) ≤ g(x, 0) + g(0, y) = x·A + y·B with A = g(1, 0) = ½[ln(2/(1 + w)) +
    w·ln(2w/(1 + w))] and B = g(0, 1) = ½(1 − w)·ln 2. Summing over j with Σ p_j = Σ r_j = 1:
    JSD(p ‖ w·p + (1 − w)·r) ≤ A + B = c(w), with equality where every entry has p_j = 0 or
    r_j = 0 (for w < 1, g is strictly convex across rays, so only there): p and r disjoint, e.g.
    p = δ_a with r(a) = 0 — a near-certain token whose step-mates are near-certain on other
    tokens. Check at a point mass: m = ½(p + q) has m_a = (1 + w)/2, so KL(p ‖ m) =
    ln(2/(1 + w)) and KL(q ‖ m) = w·ln(2w/(1 + w)) + (1 − w)·ln 2.
    """
    w = torch.as_tensor(w, dtype=torch.float64)
    return 0.5 * (torch.log(2.0 / (1.0 + w)) + torch.xlogy(w, 2.0 * w / (1.0 + w))
                  + (1.0 - w) * LN2)


def at_ceiling(u: Tensor, w: Tensor) -> Tensor:
    """Bool (...): u ≥ c(w)·(1 − CEILING_RTOL) where c(w) > 0 (ours). u (...) nats, w (...) the
    weight of p itself in its reference; a position that is its own reference (w = 1, c = 0)
    cannot deviate and is never at the ceiling."""
    c = jsd_ceiling(w)
    return (c > 0) & (u.double() >= c * (1.0 - CEILING_RTOL))


# ---------------------------------------------------------------------------------------------
# Where a response's context is its own
# ---------------------------------------------------------------------------------------------
def diverged_positions(responses: Sequence[Sequence[int]], groups: Sequence[Hashable]) -> Tensor:
    """(N,) bool over the flat response tokens, in (response, position) order: position t of
    response i is diverged when no other response of its group that is still active at step t
    (has a token there) begins with the same t tokens y_{i,<t} (ours, METHODS §10).

    The responses of a group share the prompt, so equal prefixes mean equal contexts and equal
    distributions p at step t: at a shared position the group's step mean P̄_t holds p_i several
    times; at a diverged one p_i enters it once, P̄_t(y) = p_i(y)/n_t + the others' share. Step 0
    is diverged only where the response is alone in its group. Exact (token ids, no rounding):
    a trie of each group's prefixes counts the active responses at each node."""
    if len(responses) != len(groups):
        raise ValueError(f"{len(responses)} responses but {len(groups)} groups")
    visits: list[int] = []  # per flat token: the trie node of its prefix
    count: Counter = Counter()  # active responses per node
    children: dict[tuple, int] = {}
    root = {g: i for i, g in enumerate(dict.fromkeys(groups))}  # one root node per group
    for tokens, group in zip(responses, groups, strict=True):
        node = -1 - root[group]  # roots are negative, trie nodes 0, 1, ...
        for token in tokens:
            visits.append(node)
            count[node] += 1
            node = children.setdefault((node, int(token)), len(children))
    return torch.tensor([count[node] == 1 for node in visits], dtype=torch.bool)
