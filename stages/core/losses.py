"""Advantages and policy losses (METHODS §4), as pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-6


def group_advantages(rewards: Tensor, groups: Tensor) -> Tensor:
    """Â_i = (R_i − mean(R_group)) / (std(R_group) + 1e-6) for responses (B,) in groups (B,).

    std is the sample standard deviation (Bessel-corrected, as torch.std, TRL and verl use);
    a group whose rewards are all equal, or a group of one, gets 0.
    """
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(groups, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.bincount(inverse, minlength=n_groups).to(torch.float64)  # (G,)
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, rewards) / size
    dev = rewards - mean[inverse]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, dev * dev)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    adv = dev / (std[inverse] + ADV_EPS)
    return torch.where(std[inverse] > 0, adv, torch.zeros_like(adv))
