"""What a step's data says about staleness: where off-policy data loses reward, measured on the batch.

```
 every step (cheap, from tensors the step already has)
   zero_signal_fraction  groups whose G rewards are all equal: no advantage, no gradient
   with the proximal log-probs p (trainer.minibatches > 1, m2po, or a diagnosed step):
     kl_by_lag          KL(behaviour → proximal) of the tokens sampled `lag` versions ago (k3 estimate):
                        how far the policy moved in lag versions, as the data sees it (kl_lag1: one version)
     baseline_shift     |self-normalised IS estimate of the current policy's group mean reward − the
                        behaviour group's mean|: how outdated the group baseline of a stale group is
 every `trainer.diagnose_every` steps: the step's prompts sampled again by the current weights p (fresh)
   update_kl            KL(p → θ after the step) on the fresh samples: how far one version moves the policy
   grad_cos_*           the policy gradients (at θ = p) of halves of the stale batch and of the fresh one:
                        grad_signal_alignment, the noise-corrected cosine between the directions stale and
                        fresh data point in (1 at η = 0; see `gradient_alignment`)
```
At steady state every group of a batch is about η versions old (producers outrun the trainer and the
oldest go first), so a lag profile within one batch says little; what one version moves the policy
(`update_kl`) and how far the behaviour is from p (`kl_behavior_proximal`, the loss's) say more.
Everything is reported as sums and counts (`*_sum`, `*_count`), which `step.accumulate` adds over
micro-batches, mini-batches and data-parallel ranks; `finish` turns them into means at the end of the
step. The functions are pure over tensors except `gradient_alignment`, which runs the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from streamrl.correction.losses import LOG_RATIO_CLAMP

MAX_LAG = 16  # tokens older than this are counted at MAX_LAG (η above 16 is rare and would only add keys)
_MEANS = ("baseline_shift", "update_kl")  # reported as <name>_sum / <name>_count, finished into <name>


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """(r − 1) − log r, r = e^log_ratio: a non-negative, unbiased per-sample estimate of KL(q ‖ π) from
    samples of q, with log_ratio = log π − log q."""
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(clamped) - 1.0 - clamped


def lag_kl_sums(behavior: torch.Tensor, proximal: torch.Tensor, versions: torch.Tensor, valid: torch.Tensor,
                version: int) -> dict[str, float]:
    """Sums and counts of KL(behaviour → proximal) per token lag (`version` − the token's version)."""
    kl = k3(torch.where(valid, proximal - behavior, 0.0))
    lag = (version - versions).clamp(0, MAX_LAG)
    out: dict[str, float] = {}
    for value in torch.unique(lag[valid]).tolist():
        where = valid & (lag == value)
        out[f"kl_lag{value}_sum"] = float(kl[where].sum())
        out[f"kl_lag{value}_count"] = float(where.sum())
    return out


def group_signal(rewards: torch.Tensor, group_size: int, *, behavior: torch.Tensor | None = None,
                 proximal: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> dict[str, float]:
    """Groups without a learning signal, and (given p) how far each group's baseline is from the
    current policy's expected reward. `rewards` [N] with groups adjacent; the tensors [N, T]."""
    grouped = rewards.double().reshape(-1, group_size)
    out = {"zero_signal_groups_count": float((grouped.max(1).values == grouped.min(1).values).sum()),
           "groups_count": float(grouped.shape[0])}
    if proximal is not None:
        # sequence log-weights log π_p(y)/π_b(y); self-normalised within the group (a softmax), so a long
        # response's huge product cannot overflow and the estimate stays within the group's rewards
        log_w = torch.where(valid, proximal - behavior, 0.0).double().sum(-1).reshape(-1, group_size)
        weights = torch.softmax(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), dim=1)
        shift = ((weights * grouped).sum(1) - grouped.mean(1)).abs()
        out.update(baseline_shift_sum=float(shift.sum()), baseline_shift_count=float(grouped.shape[0]))
    return out


def update_kl_sums(proximal: torch.Tensor, after: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """KL(p → θ after the step) on the step's tokens (a k3 estimate; exact in expectation where the
    tokens were sampled by p, i.e. fresh data)."""
    kl = k3(torch.where(valid, after - proximal, 0.0))
    return {"update_kl_sum": float(kl[valid].sum()), "update_kl_count": float(valid.sum())}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else float("nan")


def gradient_alignment(stale_gradient_of: Callable[[np.ndarray], torch.Tensor],
                       fresh_gradient_of: Callable[[np.ndarray], torch.Tensor], groups: int, group_size: int,
                       rng: np.random.Generator) -> dict[str, float]:
    """Whether the step's (stale) data points where fresh data would: the gradients of two random halves
    A, B of the groups, from the batch (S) and from the same prompts sampled again by the current
    weights (F). `*_gradient_of(rows)` is the flat gradient of those rows' loss at the step's starting
    weights, each normalised by its own tokens.

    A half's gradient is its data's mean direction plus sampling noise, so cosines between disjoint
    halves are small even for the same data (the noise floor: cos(S_A, S_B), cos(F_A, F_B)). Their ratio
    cos(S, F) / √(cos(S_A, S_B) · cos(F_A, F_B)) removes that attenuation (Spearman's correction): about 1
    when stale and fresh data share their mean direction (η = 0 is the control), less by as much as the
    stale data points elsewhere."""
    if groups < 4:
        return {}
    order = rng.permutation(groups)
    halves = [order[:groups // 2], order[groups // 2:2 * (groups // 2)]]

    def rows(part: np.ndarray) -> np.ndarray:
        return (np.sort(part)[:, None] * group_size + np.arange(group_size)).ravel()

    stale_a, stale_b = (stale_gradient_of(rows(h)) for h in halves)
    fresh_a, fresh_b = (fresh_gradient_of(rows(h)) for h in halves)
    same_stale, same_fresh = cosine(stale_a, stale_b), cosine(fresh_a, fresh_b)
    across = 0.5 * (cosine(stale_a, fresh_b) + cosine(fresh_a, stale_b))
    out = {"grad_cos_stale_halves": same_stale, "grad_cos_fresh_halves": same_fresh, "grad_cos_stale_fresh": across}
    if same_stale > 0 and same_fresh > 0:
        out["grad_signal_alignment"] = across / float(np.sqrt(same_stale * same_fresh))
    # a half without any advantage (every group's rewards equal) has no gradient: no direction to compare
    return {name: value for name, value in out.items() if np.isfinite(value)}


def finish(totals: dict[str, Any]) -> dict[str, Any]:
    """The step's diagnostics from the sums and counts gathered over micro-batches and ranks."""
    lags = sorted(int(k[len("kl_lag"):-len("_sum")]) for k in totals if k.startswith("kl_lag") and k.endswith("_sum"))
    by_lag = {}
    for lag in lags:
        total, count = totals.pop(f"kl_lag{lag}_sum"), totals.pop(f"kl_lag{lag}_count")
        if count:
            by_lag[str(lag)] = total / count
    if by_lag:
        totals["kl_by_lag"] = by_lag
        if "1" in by_lag:
            totals["kl_lag1"] = by_lag["1"]
    groups, silent = totals.pop("groups_count", 0.0), totals.pop("zero_signal_groups_count", 0.0)
    if groups:
        totals["zero_signal_fraction"] = silent / groups
    for name in _MEANS:
        total, count = totals.pop(f"{name}_sum", None), totals.pop(f"{name}_count", 0.0)
        if total is not None and count:
            totals[name] = total / count
    return totals
