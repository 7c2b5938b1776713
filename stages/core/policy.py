"""The policy as the training engine's one module: trunk and head of a causal LM together.

Under ZeRO-3 every parameter is a shard on each rank and is gathered (collectively, by every rank)
only inside the forward of a module that owns it. The scorer never calls the head module: it
reads the head's weight (the selective, chunked head of stages.core.scorer). :class:`Policy`
therefore owns the whole causal LM, and the head's parameters are registered as external
parameters of the Policy itself (``deepspeed.zero.register_external_parameter``), so that every
call of :meth:`Policy.forward` — the only place the head is read — has them gathered, and its
backward gathers them again. With ZeRO 0-2 the same calls are plain function calls: the numerics
are those of the bare model.

:func:`gathered_state` hands out the full weights one group of parameters at a time (DeepSpeed's
own gathering), for the vLLM engine and for the Hugging Face export, so no rank ever holds a
second full copy of the policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

GATHER_ELEMENTS = 1 << 27
"""Most elements gathered at once by :func:`gathered_state` (268 MB in bf16); a larger parameter
goes alone (Qwen3-8B: the embedding and the head alone, each decoder layer in two groups)."""


class Policy(torch.nn.Module):
    """A causal LM (``lm``: trunk, head, ``generate``, ``save_pretrained``) and :meth:`forward`,
    which runs a function of the head where ZeRO-3 has gathered it."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

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


def gathered_state(module: torch.nn.Module, elements: int | None = None) -> Iterator[dict[str, Tensor]]:
    """module.state_dict() with full tensors, in groups of consecutive parameters of at most
    `elements` (default GATHER_ELEMENTS) elements together, each group gathered from its ZeRO-3
    shards only while the consumer holds it (deepspeed.zero.GatheredParameters, a collective:
    every rank must iterate to the end). A tied weight appears under each of its names, in one
    group; buffers (never partitioned) come with the last group. Without ZeRO-3 there is one
    group: the live tensors, detached. A group's tensors are valid until the next group is asked
    for: copy what must outlive it."""
    entries = list(module.state_dict(keep_vars=True).items())
    if not partitioned(module):
        yield {name: t.detach() for name, t in entries}
        return
    from deepspeed.runtime.zero import GatheredParameters

    elements = elements or GATHER_ELEMENTS
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

