"""Policy losses with off-policy correction. Pure functions over tensors returning `(loss, metrics)`.

Notation (all [N, T], aligned to response tokens): `b` behaviour log-prob (the engine that sampled),
`p` proximal log-prob (trainer weights at the start of the step, no grad), `θ` current log-prob
(with grad), `A` token advantage, `mask` valid response tokens.

| loss            | per-token objective (minimised)                                   | needs p |
|-----------------|-------------------------------------------------------------------|---------|
| `decoupled_ppo` | −min(e^(p−b), C) · min(r·A, clip(r, 1−ε, 1+ε_h)·A),  r = e^(θ−p)  | yes     |
| `ppo_bypass`    | −min(r_b·A, clip(r_b, 1−ε, 1+ε_h)·A),  r_b = e^(θ−b)              | no      |
| `tis`           | −min(e^(p−b), C) · r·A  (truncated IS, no PPO clip)                | yes     |
| `masked_is`     | −w · PPO term on r; w = e^(p−b) (or 1: rejection), 0 outside [lo, hi] | yes     |
| `reinforce`     | −sg(min(e^(θ−b), C)) · A · θ  (REINFORCE with truncated IS)        | no      |
| `naive`         | −min(r·A, clip(r)·A): PPO on p, behaviour ignored (the baseline)  | yes     |
| `m2po`          | −M · e^(θ−b) · A; M masks trust-region tokens of largest (p−b)² until their mean ≤ τ | yes |
| `gspo`          | −min(e^(p̄−b̄), C) · min(s·A, clip(s, 1−ε, 1+ε_h)·A), s = e^(mean_t(θ−p)) per sequence | yes |
| `topr`          | −w·A·θ; w = 1 where A > 0, sg(min(e^(Σ_t θ−b), 1)) where A < 0 (per sequence) | no |

`masked_is` checks the ratio per token, per sequence (product) or by geometric mean (`level`).

Normalisation (one convention for every loss, alone or micro-batched): a token that is masked —
rejected by `masked_is`, or with a non-finite log-prob — contributes zero but still counts in the
denominator, which is the number of response tokens in `mask` (`token_mean`), of rows
(`seq_mean_token_sum`), or of rows with each row's mean over its response tokens
(`seq_mean_token_mean`). Why this and not dividing by the kept tokens (verl's convention): rejection
is then an importance weight of zero, so the estimate shrinks as more of the batch is rejected instead
of blowing up the few tokens left exactly when the data is most off-policy; and the denominator is
known before the loss is computed, so micro-batches and data-parallel ranks given the whole batch's
count as `denominator` add up to the whole-batch loss (AReaL's and slime's convention). A KL penalty
(`kl_coef`) is added over every token with finite log-probs, rejected ones too: the distance to the
reference does not read the behaviour log-prob a rejection distrusts.

Safety: every log-ratio is clamped to ±`LOG_RATIO_CLAMP` before `exp`; tokens whose behaviour (or
proximal, or current) log-prob is not finite are masked and counted; an all-masked batch gives a zero loss whose
gradients are zero, never NaN. Metrics are detached 0-d tensors (no device sync here); per-token means
come as a sum and a count (`token_means` divides them, once per step).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch

LOG_RATIO_CLAMP = 20.0
Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
Level = Literal["token", "sequence", "geometric"]


class PolicyBatch(NamedTuple):
    """The tensors every loss reads; [N, T] each, `mask` bool."""

    logprobs: torch.Tensor  # θ, with grad
    behavior_logprobs: torch.Tensor  # b
    advantages: torch.Tensor  # A per token
    mask: torch.Tensor
    proximal_logprobs: torch.Tensor | None = None  # p, no grad
    ref_logprobs: torch.Tensor | None = None  # reference policy, for the KL penalty
    versions: torch.Tensor | None = None  # behaviour version per token, for staleness metrics


def _exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _prepare(batch: PolicyBatch, *, needs_proximal: bool
             ) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The batch with θ made finite, the valid mask, and finite stand-ins for b and p. A masked token's
    θ, b and p are all 0 (ratio 1): a stand-in taken from a non-finite θ made every ratio NaN, and NaN
    survives masking by product. `torch.where` sends no gradient to the values it did not pick."""
    if needs_proximal and batch.proximal_logprobs is None:
        raise ValueError("this loss needs proximal_logprobs (the trainer's log-probs before the step)")
    valid = batch.mask.bool() & torch.isfinite(batch.behavior_logprobs) & torch.isfinite(batch.logprobs.detach())
    prox = batch.proximal_logprobs
    if prox is not None:
        valid &= torch.isfinite(prox)
    theta = torch.where(valid, batch.logprobs, 0.0)
    behavior = torch.where(valid, batch.behavior_logprobs, 0.0)
    proximal = torch.where(valid, prox, 0.0) if prox is not None else None
    return batch._replace(logprobs=theta), valid, behavior, proximal


def _truncated_weight(is_log_ratio: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min(e^log_ratio, C) and where the cap bit."""
    raw = _exp_ratio(is_log_ratio)
    return raw.clamp(max=cap), raw > cap


def _ppo_term(log_ratio: torch.Tensor, adv: torch.Tensor, clip_low: float,
              clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """−min(r·A, clip(r)·A) per token, whether the clip was active, and r."""
    ratio = _exp_ratio(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped), ratio


def _aggregate(per_token: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation,
               denominator: float | None) -> torch.Tensor:
    """Sum of the kept tokens' losses over the count of `mask`'s tokens or rows (see the module docstring)."""
    masked = torch.where(kept, per_token, 0.0)  # not a product: 0 · NaN is NaN
    response = mask.to(per_token.dtype)
    if aggregation == "token_mean":
        return masked.sum() / (denominator if denominator is not None else response.sum().clamp(min=1.0))
    if aggregation == "seq_mean_token_sum":
        return masked.sum() / (denominator if denominator is not None else max(per_token.shape[0], 1))
    if aggregation == "seq_mean_token_mean":
        per_seq = masked.sum(-1) / response.sum(-1).clamp(min=1.0)
        return per_seq.sum() / (denominator if denominator is not None else max(per_token.shape[0], 1))
    raise ValueError(f"unknown aggregation {aggregation!r}")


# Per-token means a loss reports as a sum and a count: a trainer adds them over micro-batches and ranks,
# and `token_means` divides once for the whole step (a mean of micro-batch means would depend on where the
# batch was cut, and on how many tokens each part rejected).
TOKEN_MEANS = ("ratio_mean", "clipped_fraction", "truncated_fraction", "kl_behavior_proximal", "kl_ref",
               "staleness_mean")


def _mean_parts(name: str, x: torch.Tensor, where: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{name}_sum": torch.where(where, x, 0.0).sum(), f"{name}_count": where.sum().to(x.dtype)}


def token_means(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` with each of `TOKEN_MEANS`' sum and count replaced by their quotient (0 without a token)."""
    out = dict(metrics)
    for name in TOKEN_MEANS:
        if f"{name}_sum" in out:
            total, count = out.pop(f"{name}_sum"), out.pop(f"{name}_count")
            out[name] = total / (count if count else 1)
    return out


def _finish(per_token: torch.Tensor, batch: PolicyBatch, valid: torch.Tensor, *, is_log_ratio: torch.Tensor,
            weights: torch.Tensor, clipped: torch.Tensor | None, truncated: torch.Tensor | None,
            rejected: torch.Tensor | None, aggregation: Aggregation, denominator: float | None,
            kl_coef: float, kl_estimator: Literal["k1", "k3"], trainer_version: int | None,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the KL penalty, aggregate, and compute the metrics every loss reports (per-token means as a
    sum and a count: `token_means` gives the means)."""
    metrics: dict[str, torch.Tensor] = {}
    if kl_coef and batch.ref_logprobs is None:  # a penalty that silently did nothing would be worse
        raise ValueError(f"kl_coef={kl_coef} needs the reference policy's log-probs (ref_logprobs)")
    kept = valid if rejected is None else valid & ~rejected
    response = batch.mask.bool()
    loss = _aggregate(per_token, kept, response, aggregation, denominator)
    if kl_coef:
        # Over every valid token, rejected ones too: a rejection says the behaviour policy's log-prob is not
        # to be trusted, which the distance to the reference does not read.
        kl = _kl_penalty(batch.logprobs, batch.ref_logprobs, valid, kl_estimator)
        loss = loss + kl_coef * _aggregate(kl, valid, response, aggregation, denominator)
        metrics.update(_mean_parts("kl_ref", kl.detach(), valid))

    with torch.no_grad():
        tokens = response.sum().clamp(min=1)
        raw_ratio = _exp_ratio(is_log_ratio)
        big, small = torch.finfo(raw_ratio.dtype).max, torch.finfo(raw_ratio.dtype).min
        w = weights * kept
        never = torch.zeros_like(valid)
        metrics.update(
            tokens=kept.sum().float(),
            ratio_min=torch.where(valid, raw_ratio, big).min() if valid.any() else raw_ratio.new_tensor(1.0),
            ratio_max=torch.where(valid, raw_ratio, small).max() if valid.any() else raw_ratio.new_tensor(1.0),
            masked_fraction=(response.sum() - kept.sum()) / tokens,
            nonfinite_fraction=(response & ~valid).sum() / tokens,
            ess=(w.sum() ** 2 / (kept.sum().clamp(min=1) * (w ** 2).sum().clamp(min=1e-30))),
            # ess's parts: a trainer sums them over micro-batches and ranks for the whole step's (`ess` of a
            # part is a ratio: an average of parts' would depend on where the micro-batches were cut)
            ess_weight_sum=w.sum(), ess_weight_sq_sum=(w ** 2).sum(),
            **_mean_parts("ratio_mean", raw_ratio, valid),
            **_mean_parts("clipped_fraction", (never if clipped is None else clipped).to(raw_ratio.dtype), kept),
            **_mean_parts("truncated_fraction", (never if truncated is None else truncated).to(raw_ratio.dtype),
                          valid),
            # k3 estimate of KL(b || p) from tokens sampled by b: (r − 1) − log r, r = p/b.
            **_mean_parts("kl_behavior_proximal",
                          raw_ratio - 1.0 - is_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), valid),
        )
        if batch.versions is not None and trainer_version is not None:
            age = (trainer_version - batch.versions).to(raw_ratio.dtype)
            metrics.update(_mean_parts("staleness_mean", age, valid))
            metrics["staleness_max"] = torch.where(valid, age, -1.0).max() if valid.any() else age.new_tensor(0.0)
            metrics.update(_mismatch(is_log_ratio, valid & (age == 0)))
    return loss, metrics


def _mismatch(is_log_ratio: torch.Tensor, current: torch.Tensor) -> dict[str, torch.Tensor]:
    """The train/inference mismatch on the tokens the trainer's own version sampled (`current`): there
    the trainer-side and behaviour log-probs differ only by how each side computes them (precision,
    kernels), the gap truncated and masked IS exist to absorb. Sums and a count, not a mean, so that
    micro-batches and ranks combine exactly (`mismatch_kl` = the sum over the count: a k3 estimate of
    KL(behaviour ‖ trainer))."""
    log_ratio = is_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.exp(log_ratio) - 1.0 - log_ratio
    return {"mismatch_kl_sum": (k3 * current).sum(), "mismatch_count": current.sum().float(),
            "mismatch_abs_max": torch.where(current, log_ratio.abs(), 0.0).max() if current.any()
            else log_ratio.new_tensor(0.0)}


def _kl_penalty(theta: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor,
                estimator: Literal["k1", "k3"]) -> torch.Tensor:
    # log(π_ref / π_θ); 0 where the reference's log-prob is not finite: that token gets no penalty, and no
    # gradient (θ.detach() − θ is 0 with a gradient of −1, which k1 passed on)
    log_ratio = torch.where(valid & torch.isfinite(ref), ref - theta, torch.zeros_like(theta))
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return _exp_ratio(log_ratio) - 1.0 - log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def _common(aggregation, denominator, kl_coef, kl_estimator, trainer_version) -> dict:
    return dict(aggregation=aggregation, denominator=denominator, kl_coef=kl_coef, kl_estimator=kl_estimator,
                trainer_version=trainer_version)


def decoupled_ppo(batch: PolicyBatch, *, clip_low: float = 0.2, clip_high: float = 0.2, is_cap: float = 2.0,
                  aggregation: Aggregation = "token_mean", denominator: float | None = None, kl_coef: float = 0.0,
                  kl_estimator: Literal["k1", "k3"] = "k3", trainer_version: int | None = None):
    """AReaL's decoupled objective: PPO trust region around p, truncated IS weight from b to p."""
    batch, valid, b, p = _prepare(batch, needs_proximal=True)
    is_log_ratio = p - b
    w, truncated = _truncated_weight(is_log_ratio, is_cap)
    term, clipped, _ = _ppo_term(batch.logprobs - p, batch.advantages, clip_low, clip_high)
    return _finish(w * term, batch, valid, is_log_ratio=is_log_ratio, weights=w, clipped=clipped,
                   truncated=truncated, rejected=None,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


def ppo_bypass(batch: PolicyBatch, *, clip_low: float = 0.2, clip_high: float = 0.2,
               aggregation: Aggregation = "token_mean", denominator: float | None = None, kl_coef: float = 0.0,
               kl_estimator: Literal["k1", "k3"] = "k3", trainer_version: int | None = None):
    """PPO clipped against the behaviour policy directly (no proximal forward pass)."""
    batch, valid, b, _ = _prepare(batch, needs_proximal=False)
    term, clipped, _ = _ppo_term(batch.logprobs - b, batch.advantages, clip_low, clip_high)
    is_log_ratio = batch.logprobs.detach() - b
    return _finish(term, batch, valid, is_log_ratio=is_log_ratio, weights=torch.ones_like(term),
                   clipped=clipped, truncated=None, rejected=None,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


def tis(batch: PolicyBatch, *, is_cap: float = 2.0, aggregation: Aggregation = "token_mean",
        denominator: float | None = None, kl_coef: float = 0.0, kl_estimator: Literal["k1", "k3"] = "k3",
        trainer_version: int | None = None):
    """Truncated importance sampling: the IS-weighted policy gradient with the weight from b to p
    capped at C, and no trust-region clip."""
    batch, valid, b, p = _prepare(batch, needs_proximal=True)
    is_log_ratio = p - b
    w, truncated = _truncated_weight(is_log_ratio, is_cap)
    per_token = -w * _exp_ratio(batch.logprobs - p) * batch.advantages
    return _finish(per_token, batch, valid, is_log_ratio=is_log_ratio, weights=w, clipped=None,
                   truncated=truncated, rejected=None,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


def _rejected(is_log_ratio: torch.Tensor, valid: torch.Tensor, level: Level, lo: float, hi: float) -> torch.Tensor:
    """Tokens whose ratio (token, whole-sequence product, or geometric mean) lies outside [lo, hi]."""
    lr = torch.where(valid, is_log_ratio, 0.0)
    if level == "token":
        per = lr
    elif level == "sequence":
        per = lr.sum(-1, keepdim=True).expand_as(lr)
    elif level == "geometric":
        per = (lr.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)).expand_as(lr)
    else:
        raise ValueError(f"unknown level {level!r}")
    ratio = _exp_ratio(per)
    return valid & ((ratio < lo) | (ratio > hi))


def masked_is(batch: PolicyBatch, *, level: Level = "token", lo: float = 0.5, hi: float = 2.0,
              reweight: bool = True, clip_low: float = 0.2, clip_high: float = 0.2,
              aggregation: Aggregation = "token_mean", denominator: float | None = None, kl_coef: float = 0.0,
              kl_estimator: Literal["k1", "k3"] = "k3", trainer_version: int | None = None):
    """Masked importance sampling / rejection: drop tokens (or whole sequences) whose behaviour ratio
    is outside [lo, hi]; weight the rest by the ratio (`reweight`) or by 1 (pure rejection)."""
    if not 0 <= lo <= 1 <= hi:
        raise ValueError(f"need 0 <= lo <= 1 <= hi, got lo={lo}, hi={hi}")
    batch, valid, b, p = _prepare(batch, needs_proximal=True)
    is_log_ratio = p - b
    rejected = _rejected(is_log_ratio, valid, level, lo, hi)
    if not reweight:
        w = torch.ones_like(is_log_ratio)
    elif level == "token":
        w = _exp_ratio(is_log_ratio)
    else:
        w = _exp_ratio(torch.where(valid, is_log_ratio, 0.0).sum(-1, keepdim=True)
                       / (valid.sum(-1, keepdim=True).clamp(min=1) if level == "geometric" else 1)).expand_as(b)
    w = torch.where(rejected, 0.0, w)
    term, clipped, _ = _ppo_term(batch.logprobs - p, batch.advantages, clip_low, clip_high)
    return _finish(w * term, batch, valid, is_log_ratio=is_log_ratio, weights=w, clipped=clipped,
                   truncated=None, rejected=rejected,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


def reinforce(batch: PolicyBatch, *, is_cap: float = 2.0, aggregation: Aggregation = "token_mean",
              denominator: float | None = None, kl_coef: float = 0.0, kl_estimator: Literal["k1", "k3"] = "k3",
              trainer_version: int | None = None):
    """REINFORCE with a truncated IS weight from b to θ (detached): −sg(min(e^(θ−b), C))·A·θ."""
    batch, valid, b, _ = _prepare(batch, needs_proximal=False)
    is_log_ratio = batch.logprobs.detach() - b
    w, truncated = _truncated_weight(is_log_ratio, is_cap)
    per_token = -w * batch.advantages * batch.logprobs
    return _finish(per_token, batch, valid, is_log_ratio=is_log_ratio, weights=w, clipped=None,
                   truncated=truncated, rejected=None,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


def naive(batch: PolicyBatch, *, clip_low: float = 0.2, clip_high: float = 0.2,
          aggregation: Aggregation = "token_mean", denominator: float | None = None, kl_coef: float = 0.0,
          kl_estimator: Literal["k1", "k3"] = "k3", trainer_version: int | None = None):
    """No off-policy correction: PPO around p as if the data were on-policy. The baseline."""
    batch, valid, b, p = _prepare(batch, needs_proximal=True)
    term, clipped, _ = _ppo_term(batch.logprobs - p, batch.advantages, clip_low, clip_high)
    return _finish(term, batch, valid, is_log_ratio=p - b, weights=torch.ones_like(term), clipped=clipped,
                   truncated=None, rejected=None,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


# ---- trust regions for stale data -----------------------------------------------------------------------
def m2po_values(is_log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """M2PO's statistic: (log r)² of the trust-region tokens, those where PPO's clip could act (A > 0
    and r > 1, or A < 0 and r < 1), r = p / b; and where those tokens are."""
    log_ratio = is_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    region = valid & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))
    return log_ratio[region] ** 2, region


def m2po_cutoff(values: torch.Tensor, m2_tau: float) -> float:
    """M2PO's Algorithm 1 as a threshold: the trust-region tokens with the largest (log r)² are masked
    until the mean over the rest is at most τ; the smallest value masked (a token at or above it is
    masked), +inf when nothing needs masking. Tokens tied at the cutoff are masked together, which can
    be more than the fewest removals that suffice (four tied at the top where one would do: all four):
    the algorithm names no order among equal values, ties come from identical responses, which this
    treats alike, and a threshold is the same mask in every micro-batch and rank with no global token
    order. The rest's mean is at most τ either way."""
    n = values.numel()
    if n == 0 or float(values.double().mean()) <= m2_tau:
        return math.inf
    ordered = values.double().sort(descending=True).values
    removed = ordered.cumsum(0)  # removed[k − 1]: the sum of the k largest
    left = torch.arange(n - 1, -1, -1, dtype=torch.float64)  # tokens left after removing k = 1..n
    remaining_mean = (ordered.sum() - removed) / left.clamp(min=1)
    k = int(torch.nonzero((remaining_mean <= m2_tau) | (left == 0))[0]) + 1  # the fewest removals that suffice
    return float(ordered[k - 1])


def m2po(batch: PolicyBatch, *, m2_tau: float = 0.04, cutoff: float | None = None,
         aggregation: Aggregation = "token_mean", denominator: float | None = None, kl_coef: float = 0.0,
         kl_estimator: Literal["k1", "k3"] = "k3", trainer_version: int | None = None):
    """M2PO (Zheng et al., 2025, "Prosperity before Collapse"): no ε-clip; instead the trust-region
    tokens with the largest second moment (log r)² are masked until the batch's mean second moment is
    at most τ, and the rest follow −r_b·A, r_b = e^(θ−b) = e^(p−b)·e^(θ−p). The statistic uses r = p/b,
    fixed for the step (θ = p at its first optimizer step, as the paper's θ/b), so that the mask is the
    whole batch's: the trainer computes `cutoff` over every micro-batch and rank (`m2po_cutoff`); called
    alone, the loss computes it from its own tokens."""
    batch, valid, b, p = _prepare(batch, needs_proximal=True)
    is_log_ratio = p - b
    values, region = m2po_values(is_log_ratio, batch.advantages, valid)
    if cutoff is None:
        cutoff = m2po_cutoff(values, m2_tau)
    rejected = region & (is_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) ** 2 >= cutoff)
    w = torch.where(rejected, 0.0, _exp_ratio(is_log_ratio))
    per_token = -w * _exp_ratio(batch.logprobs - p) * batch.advantages
    return _finish(per_token, batch, valid, is_log_ratio=is_log_ratio, weights=w, clipped=None, truncated=None,
                   rejected=rejected, **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


def gspo(batch: PolicyBatch, *, seq_clip_low: float = 3e-4, seq_clip_high: float = 4e-4, is_cap: float = 2.0,
         aggregation: Aggregation = "token_mean", denominator: float | None = None, kl_coef: float = 0.0,
         kl_estimator: Literal["k1", "k3"] = "k3", trainer_version: int | None = None):
    """GSPO's sequence-level trust region (Zheng et al., 2025, Qwen), decoupled: the PPO clip acts on
    each sequence's geometric-mean ratio s = e^(mean_t(θ − p)) with GSPO's small ε, and the behaviour
    correction is the sequence's truncated geometric-mean weight min(e^(mean_t(p − b)), C). A sequence
    is in or out of the trust region as a whole, however long; one stale token cannot dominate."""
    batch, valid, b, p = _prepare(batch, needs_proximal=True)
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = torch.where(valid, batch.logprobs - p, 0.0).sum(-1, keepdim=True) / count
    seq_is = torch.where(valid, p - b, 0.0).sum(-1, keepdim=True) / count
    w, truncated = _truncated_weight(seq_is, is_cap)
    term, clipped, _ = _ppo_term(seq_log_ratio.expand_as(p), batch.advantages, seq_clip_low, seq_clip_high)
    weights = w.expand_as(p)
    return _finish(weights * term, batch, valid, is_log_ratio=p - b, weights=weights, clipped=clipped,
                   truncated=truncated.expand_as(p) & valid, rejected=None,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


def topr(batch: PolicyBatch, *, aggregation: Aggregation = "token_mean", denominator: float | None = None,
         kl_coef: float = 0.0, kl_estimator: Literal["k1", "k3"] = "k3", trainer_version: int | None = None):
    """TOPR (Le Roux et al., 2025, "Tapered Off-Policy REINFORCE"): samples better than their group
    are imitated at full weight, however stale (a right answer stays right); samples worse than it
    are pushed down with their sequence's ratio π_θ(y)/μ(y) truncated at 1 (no gradient through it),
    so a bad answer the current policy already avoids weighs little, and no weight ever exceeds 1."""
    batch, valid, b, _ = _prepare(batch, needs_proximal=False)
    is_log_ratio = batch.logprobs.detach() - b
    sequence_ratio = _exp_ratio(torch.where(valid, is_log_ratio, 0.0).sum(-1, keepdim=True)).expand_as(b)
    positive = batch.advantages > 0
    w = torch.where(positive, 1.0, sequence_ratio.clamp(max=1.0))
    per_token = -w * batch.advantages * batch.logprobs
    return _finish(per_token, batch, valid, is_log_ratio=is_log_ratio, weights=w, clipped=None,
                   truncated=~positive & (sequence_ratio > 1.0) & valid, rejected=None,
                   **_common(aggregation, denominator, kl_coef, kl_estimator, trainer_version))


LOSSES = {
    "decoupled_ppo": decoupled_ppo,
    "ppo_bypass": ppo_bypass,
    "tis": tis,
    "masked_is": masked_is,
    "reinforce": reinforce,
    "naive": naive,
    "m2po": m2po,
    "gspo": gspo,
    "topr": topr,
}
NEEDS_PROXIMAL = {"decoupled_ppo": True, "ppo_bypass": False, "tis": True, "masked_is": True,
                  "reinforce": False, "naive": True, "m2po": True, "gspo": True,
                  "topr": False}
