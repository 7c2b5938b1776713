"""The one implementation of every per-token formula (METHODS §2): the block math and the
sources of blocks of scaled logits, with the per-position statistics over them.

stages.core.statistics.stats is the public face; per_token, uniqueness and ceiling use these
pieces. CACHE_BLOCKS and PIECE_BYTES are read here: stats re-exports their values, so a test
or benchmark that changes one sets it on this module.

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
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

LN2 = math.log(2.0)
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
             for r0, r1 in row_pieces(z.shape[0], rows)]
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


def jsd_block(p: Tensor, logp: Tensor, q: Tensor, logq: Tensor, mix: Tensor | None = None,
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
        half_q = half_of(q)
    mix = torch.add(half_q, p, alpha=0.5, out=mix).log_()  # log m
    kl = logp.sub_(mix).mul_(p).sum(dim=-1)  # (...) KL(p ‖ m)
    gap = torch.sub(logq, mix, out=mix)  # (..., v) log q − log m
    if q.shape[-2] == 1 < p.shape[-2]:  # one reference row for several rows: matrix × vector
        return kl.add_(torch.matmul(gap, q.transpose(-1, -2)).squeeze(-1)).mul_(0.5)
    return kl.add_(gap.mul_(q).sum(dim=-1)).mul_(0.5)


def log_probs(x: Tensor, out: Tensor | None = None) -> Tensor:
    """log x of probabilities x, finite: a 0 gets log of the smallest positive float."""
    return torch.clamp_min(x, _smallest(x.dtype), out=out).log_()


def half_of(q: Tensor, out: Tensor | None = None) -> Tensor:
    """½q raised to the smallest positive float (jsd_block's half_q)."""
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
    return jsd_block(p, log_probs(p), q, log_probs(q)).clamp(0.0, LN2).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Logit sources: where the blocks of scaled logits come from.
# ---------------------------------------------------------------------------------------------
def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype of every reduction: float64 when an input is float64, float32 otherwise."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


class LogitSource:
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
        """The scratch tensor of jsd_block for a piece of rows."""
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
        same values as source_logsumexp's (one pass of _block_moments per chunk, z kept). The kept
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


def row_pieces(n: int, rows: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [r0, r1) of `rows` rows covering range(n), the last one shorter,
    but never a single row when n > 1 (it joins the range before it): torch sums the rows of a
    tensor of several rows one row per thread, but a single row in two halves, another
    rounding, and a row's statistics must not depend on the pieces."""
    starts = list(range(0, n, max(rows, 2)))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return [(r0, starts[i + 1] if i + 1 < len(starts) else n) for i, r0 in enumerate(starts)]


def valid_token_ids(src: LogitSource, token_ids: Tensor) -> Tensor:
    """token_ids (...) -> (N_valid,) long at the valid positions, checked against the vocabulary."""
    if token_ids.shape != src.shape:
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} != positions {tuple(src.shape)}")
    ids = token_ids.reshape(-1).to(src.device)[src.rows].long()  # (N_valid,)
    if ids.numel() and (ids.min() < 0 or ids.max() >= src.vocab):
        raise ValueError(f"token ids outside the vocabulary [0, {src.vocab})")
    return ids


def source_statistics(src: LogitSource, ids: Tensor | None, full: bool = True,
                      rows: tuple[int, int] = (0, -1)) -> dict[str, Tensor]:
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


def source_logsumexp(src: LogitSource, a: int = 0, b: int = -1) -> Tensor:
    """logsumexp (N_valid,), or of valid rows a..b: the same values as source_statistics's,
    without its entropy and Rényi passes."""
    return source_statistics(src, None, full=False, rows=(a, b))["logsumexp"]


def valid_values(src: LogitSource, values: Tensor) -> Tensor:
    """values (...) of every position -> (N_valid,) at the valid ones, in the compute dtype."""
    if values.shape != src.shape:
        raise ValueError(f"shape {tuple(values.shape)} != positions {tuple(src.shape)}")
    return values.reshape(-1).to(device=src.device, dtype=src.dtype)[src.rows]
