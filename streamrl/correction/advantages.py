"""Group-relative advantages: one scalar per sample, broadcast to its response tokens."""

from __future__ import annotations

import torch


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True,
                    eps: float = 1e-4) -> torch.Tensor:
    """`(r - mean_group) / (std_group + eps)`; without `scale`, only the mean is removed (Dr. GRPO).

    rewards: [N] with the G samples of each group adjacent. Returns [N]. The std is the population
    std (unbiased=False), so a group of one sample gets a zero advantage rather than NaN. A group whose
    rewards are all equal gets exactly zero: its float32 mean can be one rounding step off, and divided
    by a std of ~1e-7 + eps that residue became an advantage of the same sign for every sample.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    flat = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return centred.masked_fill(flat, 0.0).reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out baseline: `r_i - mean_{j != i} r_j`. Needs at least two samples per group."""
    if group_size < 2:
        raise ValueError("leave-one-out advantages need group_size >= 2")
    grouped = _grouped(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] advantages -> [N, T], zero outside the mask."""
    return advantages[:, None] * mask.to(advantages.dtype)
