"""The staleness diagnostics as pure functions: each against a hand computation."""

import math

import numpy as np
import pytest
import torch

from streamrl.trainer import diagnostics


def test_kl_by_lag_is_the_k3_estimate_over_the_tokens_of_each_lag():
    behavior = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    proximal = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.0, 0.0]], dtype=torch.float64)
    versions = torch.tensor([[3, 3, 3], [1, 1, -1]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    sums = diagnostics.lag_kl_sums(behavior, proximal, versions, valid, version=4)

    def k3(x):  # x = log p − log b
        return math.exp(x) - 1 - x

    assert sums == pytest.approx({"kl_lag1_sum": k3(-0.5) + k3(1.0) + k3(0.0), "kl_lag1_count": 3,
                                  "kl_lag3_sum": k3(0.8) + k3(0.0), "kl_lag3_count": 2})
    finished = diagnostics.finish(dict(sums))
    assert finished["kl_by_lag"] == pytest.approx({"1": sums["kl_lag1_sum"] / 3, "3": sums["kl_lag3_sum"] / 2})
    assert finished["kl_lag1"] == finished["kl_by_lag"]["1"] and not any(k.endswith("_sum") for k in finished)


def test_group_signal_counts_silent_groups_and_the_outdated_baseline():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])  # groups of 2: one mixed, two silent
    assert diagnostics.group_signal(rewards, 3) == {"zero_signal_groups_count": 0.0, "groups_count": 2.0}
    out = diagnostics.group_signal(rewards, 2)
    assert out == {"zero_signal_groups_count": 2.0, "groups_count": 3.0}
    # with p: a sample the current policy finds e² times likelier than the behaviour did weighs e²× more
    behavior = torch.zeros(6, 2, dtype=torch.float64)
    proximal = torch.zeros(6, 2, dtype=torch.float64)
    proximal[3] = 1.0  # the rewarded sample of the mixed group: log weight 2 over its two tokens
    valid = torch.ones(6, 2, dtype=torch.bool)
    out = diagnostics.group_signal(rewards, 2, behavior=behavior, proximal=proximal, valid=valid)
    expected = math.exp(2) / (1 + math.exp(2)) - 0.5  # SNIS mean − plain mean of the mixed group
    assert out["baseline_shift_sum"] == pytest.approx(expected) and out["baseline_shift_count"] == 3
    assert diagnostics.finish(out) == pytest.approx({"zero_signal_fraction": 2 / 3, "baseline_shift": expected / 3})


def test_update_kl_is_zero_without_movement_and_positive_with_it():
    p = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    valid = torch.ones(1, 2, dtype=torch.bool)
    assert diagnostics.update_kl_sums(p, p, valid) == {"update_kl_sum": 0.0, "update_kl_count": 2.0}
    moved = diagnostics.update_kl_sums(p, p + torch.tensor([[0.3, -0.3]], dtype=torch.float64), valid)
    assert moved["update_kl_sum"] == pytest.approx((math.exp(0.3) - 1.3) + (math.exp(-0.3) - 0.7))


def test_alignment_is_one_when_stale_and_fresh_share_their_direction_under_noise():
    """Each half's gradient is a common direction plus noise: the raw cosines are small, the corrected
    alignment is about 1; with the stale data pointing elsewhere it is about the cosine of the directions."""
    generator = torch.Generator().manual_seed(0)
    dim, noise = 2000, 0.5  # |noise| ≈ 22 against a signal of 30: raw cosines about 0.65
    direction = torch.zeros(dim, dtype=torch.float64)
    direction[0] = 1.0
    elsewhere = torch.zeros(dim, dtype=torch.float64)
    elsewhere[:2] = torch.tensor([0.6, 0.8])  # cos(direction, elsewhere) = 0.6

    def half(mean):
        return lambda rows: mean * 30 + noise * torch.randn(dim, generator=generator, dtype=torch.float64)

    same = diagnostics.gradient_alignment(half(direction), half(direction), 16, 2, np.random.default_rng(0))
    assert same["grad_cos_stale_halves"] < 0.95 and same["grad_signal_alignment"] == pytest.approx(1.0, abs=0.05)
    apart = diagnostics.gradient_alignment(half(elsewhere), half(direction), 16, 2, np.random.default_rng(0))
    assert apart["grad_signal_alignment"] == pytest.approx(0.6, abs=0.05)
    assert diagnostics.gradient_alignment(half(direction), half(direction), 3, 2, np.random.default_rng(0)) == {}
