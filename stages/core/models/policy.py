"""The policy as the training engine's one module: trunk and head of a causal LM together.

Under ZeRO-3 every parameter is a shard on each rank and is gathered (collectively, by every rank)
only inside the forward of a module that owns it. The scorer never calls the head module: it
reads the head's weight (the selective, chunked head of stages.core.statistics.scorer). :class:`Policy`
therefore owns the whole causal LM, and the head's parameters are registered as external
parameters of the Policy itself (``deepspeed.zero.register_external_parameter``), so that every
call of :meth:`Policy.forward` — the only place the head is read — has them gathered, and its
backward gathers them again. With ZeRO 0-2 the same calls are plain function calls: the numerics
are those of the bare model.

:func:`gathered_state` hands out the full weights one group of parameters at a time (DeepSpeed's
own gathering), for the vLLM engine and for the Hugging Face export, so no rank ever holds a
second full copy of the policy.

:class:`Layout` says how the trunk is fed (stages.core.statistics.scorer.trunk_hidden reads it from the
Policy): right-padded rows or one padding-free row of concatenated sequences (position ids restart
at 0 for each; the attention kernel keeps sequences apart), and, with sequence parallelism, which
slice of the positions this rank runs. :func:`install_ulysses` puts DeepSpeed's Ulysses attention
in front of the model's attention kernel for the forwards that ask for it (``sequence_parallel=
True``, which gradient checkpointing's recomputation passes again), so generation with the same
module stays plain attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from stages.core.models.engine import Dist

GATHER_ELEMENTS = 1 << 27
"""Most elements gathered at once by :func:`gathered_state` (268 MB in bf16); a larger parameter
goes alone (Qwen3-8B: the embedding and the head alone, each decoder layer in two groups)."""


@dataclass(frozen=True)
class Layout:
    """How the trunk is fed.

    padding_free: a micro-batch is one row of its sequences back to back, each with position ids
    from 0 (variable-length attention: no position attends to another sequence's), instead of
    rows right-padded to the longest. sp: the sequence-parallel group of this rank (Ulysses: its
    ranks hold the same sequences and each runs one slice of the positions); None: one rank runs
    whole sequences."""

    padding_free: bool = False
    sp: Dist | None = None

    @property
    def sp_size(self) -> int:
        return 1 if self.sp is None else self.sp.world


class Policy(torch.nn.Module):
    """A causal LM (``lm``: trunk, head, ``generate``, ``save_pretrained``) and :meth:`forward`,
    which runs a function of the head where ZeRO-3 has gathered it; `layout`: how the scorer
    feeds its trunk."""

    def __init__(self, lm: torch.nn.Module, layout: Layout | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.layout = layout or Layout()

    @property
    def trunk(self) -> torch.nn.Module:
        """The transformer without its LM head (its own modules gather their parameters)."""
        return self.lm.get_decoder()

    @property
    def head(self) -> torch.nn.Module:
        """The LM head (V, D) (+ bias); with tied embeddings its weight is the input embedding."""
        return self.lm.get_output_embeddings()

    def register_head(self) -> None:
        """ZeRO-3: the head's parameters become external parameters of this module, gathered for
        every forward of it and for its backward."""
        from deepspeed.runtime.zero import register_external_parameter

        for p in self.head.parameters():
            register_external_parameter(self, p)

    def forward(self, *tensors: Tensor, fn: Callable, **kwargs):
        """fn(head, *tensors, **kwargs) inside this module's forward.

        Tensors that need gradient (the trunk's hidden states) go in `tensors`, positionally: that
        is where ZeRO-3's hooks see the backward leave this module and release the head again.
        `fn` and the rest are keyword arguments, which the hooks never see."""
        return fn(self.head, *tensors, **kwargs)


def as_policy(model) -> Policy:
    """`model` itself when it is a Policy, else a Policy around a bare causal LM (ZeRO 0-2 and
    the token-statistics stage, where nothing is partitioned)."""
    return model if isinstance(model, Policy) else Policy(model)


def partitioned(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameters are ZeRO-3 shards."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _parameter_groups(entries, elements: int) -> list[list[torch.nn.Parameter]]:
    """The partitioned parameters of state-dict `entries` in groups of consecutive ones of at most
    `elements` elements together (a larger one alone), each parameter once (a tied one in the
    group of its first name)."""
    groups: list[list[torch.nn.Parameter]] = []
    size = 0
    seen: set[int] = set()
    for _, t in entries:
        if not hasattr(t, "ds_id") or id(t) in seen:
            continue
        seen.add(id(t))
        n = t.ds_numel
        if not groups or size + n > elements:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def state_groups(module: torch.nn.Module, elements: int | None = None) -> list[list[str]]:
    """The state-dict names of each group :func:`gathered_state` yields, in its order, without
    gathering anything (every rank computes the same)."""
    entries = list(module.state_dict(keep_vars=True).items())
    if not partitioned(module):
        return [[name for name, _ in entries]]
    names: dict[int, list[str]] = {}
    for name, t in entries:
        names.setdefault(id(t), []).append(name)
    groups = [[name for p in group for name in names[id(p)]]
              for group in _parameter_groups(entries, elements or GATHER_ELEMENTS)]
    buffers = [name for name, t in entries if not hasattr(t, "ds_id")]
    if groups:
        groups[-1] += buffers
    return groups


def gathered_state(module: torch.nn.Module, elements: int | None = None) -> Iterator[dict[str, Tensor]]:
    """module.state_dict() with full tensors, in groups of consecutive parameters of at most
    `elements` (default GATHER_ELEMENTS) elements together, each group gathered from its ZeRO-3
    shards only while the consumer holds it (deepspeed.zero.GatheredParameters, a collective:
    every rank must iterate to the end). A tied weight appears under each of its names, in one
    group; buffers (never partitioned) come with the last group. Without ZeRO-3 there is one
    group: the live tensors, detached. A group's tensors are valid until the next group is asked
    for: copy what must outlive it. :func:`state_groups` gives each group's names up front."""
    entries = list(module.state_dict(keep_vars=True).items())
    if not partitioned(module):
        yield {name: t.detach() for name, t in entries}
        return
    from deepspeed.runtime.zero import GatheredParameters

    groups = _parameter_groups(entries, elements or GATHER_ELEMENTS)
    names: dict[int, list[str]] = {}
    for name, t in entries:
        names.setdefault(id(t), []).append(name)
    buffers = {name: t.detach() for name, t in entries if not hasattr(t, "ds_id")}
    for k, group in enumerate(groups):
        with GatheredParameters(group, modifier_rank=None):
            out = {name: p.detach() for p in group for name in names[id(p)]}
            if k == len(groups) - 1:
                out.update(buffers)
            yield out


def full_state_dict(module: torch.nn.Module, keep: bool, elements: int | None = None) -> dict[str, Tensor]:
    """The full weights of `module` copied to CPU memory when `keep` (one rank: the one that
    writes), gathered group by group (every rank must call this); tied names share one tensor, as
    in the live module, so save_pretrained drops the duplicate as it does for the module itself."""
    out: dict[str, Tensor] = {}
    for group in gathered_state(module, elements):
        if keep:
            copies: dict[int, Tensor] = {}  # by storage, within the group (all of it alive)
            for name, t in group.items():
                key = t.data_ptr() if t.numel() else id(t)
                out[name] = copies.setdefault(key, t.to("cpu", copy=True))
    return out


# ---------------------------------------------------------------------------------------------
# Ulysses sequence parallelism (DeepSpeed's, for Hugging Face attention)
# ---------------------------------------------------------------------------------------------
def packed_causal_mask(position_ids: Tensor) -> Tensor | None:
    """(b, 1, L, L) bool, True where a query may attend a key: causal and within the same
    sequence of a padding-free row, whose sequences are where the position ids restart (as
    transformers' own find_packed_sequence_indices reads them); None when no row is packed."""
    from transformers.masking_utils import find_packed_sequence_indices

    seq = find_packed_sequence_indices(position_ids)  # (b, L) sequence index of every position
    if seq is None:
        return None
    n = position_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    return (seq[:, None, :, None] == seq[:, None, None, :]) & causal


class UlyssesAttention:
    """The attention function of one kernel (`impl`: sdpa or flash_attention_2) for every model
    of the process. A forward called with ``sequence_parallel=True`` runs DeepSpeed's
    UlyssesSPAttentionHF over `group`: each rank holds a slice of the positions of every head,
    an all-to-all gives it all positions of its share of the heads, the kernel runs on the whole
    sequences (with the gathered position ids: causal, and within each sequence of a padding-free
    row), and another all-to-all gives the slice back. Any other call is the plain kernel.

    DeepSpeed's own register_with_transformers would fix the micro-batch's number of rows, and
    under sdpa drop the mask that keeps packed sequences apart; here the rows follow the query,
    sdpa gets the packed rows' block-diagonal causal mask from the gathered positions
    (flash_attention_2 reads them itself), and the module's num_key_value_groups, which DeepSpeed
    changes when it replicates key/value heads, is put back after every call."""

    def __init__(self, core: Callable, impl: str, config: Any, group) -> None:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        class RowsOfTheQuery(UlyssesSPAttentionHF):
            def forward(inner, module, query, *args, **kwargs):  # noqa: N805
                rows = query.shape[0]  # (b, heads, L_local, head_dim)
                inner.batch_size = rows
                inner.required_query_shape = torch.Size([1, rows, *inner.required_query_shape[2:]])
                inner.required_key_value_shape = torch.Size(
                    [1, rows, *inner.required_key_value_shape[2:]])
                inner.required_context_shape = torch.Size(
                    [1, rows, *inner.required_context_shape[2:]])
                return super().forward(module, query, *args, **kwargs)

        text = config.get_text_config()
        self.core, self.impl = core, impl
        self.shape = (text.num_attention_heads, text.num_key_value_heads)
        self.ulysses = RowsOfTheQuery(
            attn=self._kernel, batch_size=1, attn_head_count=text.num_attention_heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            kv_head_count=text.num_key_value_heads, num_hidden_layers=text.num_hidden_layers,
            process_group=group, seq_length_is_variable=True)

    def _kernel(self, module, query, key, value, mask, *args, **kwargs):
        if self.impl == "sdpa":  # the whole sequences' positions, gathered by DeepSpeed
            mask = packed_causal_mask(kwargs["position_ids"])
        return self.core(module, query, key, value, mask, *args, **kwargs)

    def __call__(self, module, query, key, value, mask, *args, sequence_parallel: bool = False,
                 **kwargs):
        if not sequence_parallel:
            return self.core(module, query, key, value, mask, *args, **kwargs)
        groups = getattr(module, "num_key_value_groups", None)
        try:  # the mask transformers made is the local slice's: the positions decide instead
            return self.ulysses(module, query, key, value, None, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups


def install_ulysses(lm: torch.nn.Module, group) -> None:
    """Ulysses in front of `lm`'s attention kernel (every model of this kernel in the process:
    the policy and the reference share it), over the sequence-parallel process group `group`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = lm.config._attn_implementation
    if impl not in ("sdpa", "flash_attention_2"):
        raise ValueError(f"sequence parallelism needs sdpa or flash_attention_2 attention, the "
                         f"model has {impl!r}")
    current = ALL_ATTENTION_FUNCTIONS[impl]
    text = lm.config.get_text_config()
    if isinstance(current, UlyssesAttention):
        if current.shape != (text.num_attention_heads, text.num_key_value_heads):
            raise ValueError("sequence parallelism: one attention shape per process")
        return
    ALL_ATTENTION_FUNCTIONS[impl] = UlyssesAttention(current, impl, lm.config, group)
