"""One trainer step, whatever model it trains: the plan of a consumed batch of groups → `minibatches`
optimizer steps, over a small `Backend` that runs the model.

```
 [N, L] padded batch ─► group advantages (one per sample, broadcast to tokens)
   minibatches > 1: proximal log-probs p of every row (no grad), groups shuffled and split in mini-batches
   kl_coef > 0:     reference log-probs of every row (no grad, the frozen initial policy)
   each mini-batch: this rank's rows (backend.shard), sorted by length, cut into micro-batches of
                    ≤ micro_batch_tokens padded tokens
     each micro-batch: backend.backward: θ log-probs ─► loss(θ, b, p, A) / mini-batch tokens ─► .grad
     backend.clip_gradients (after its reductions: every rank the same norm) ─► non-finite: roll back, raise
     backend.optimizer_step(lr of this optimizer step)
 metrics: each micro-batch's weighted by its share of the step's tokens, then every rank's merged
 diagnosed steps (trainer.diagnose_every, one rank): before the first optimizer step the gradients of
   halves of the batch and of `fresh` (its prompts sampled again by these weights); after the last,
   KL from before to after on `fresh` (streamrl.trainer.diagnostics)
```
The proximal log-probs `p` are the trainer's weights at the start of the step. With one optimizer
step per consumed batch (the default) `p` equals θ's value in the same forward pass, so it is taken as
`θ.detach()` instead of paying for a second forward pass; then `decoupled_ppo` and `tis` coincide
(r = 1, nothing to clip). With several mini-batches (PPO's inner epochs: more learning per generated
sample) θ moves away from p within the step, the PPO clip bounds that move, and the correction bounds
the behaviour → proximal gap: the objectives differ as they do in the literature. A loss that does not
read `p` (`LossConfig.needs_proximal`: `ppo_bypass`, `reinforce`) never pays for that forward pass.

Nothing here knows the model, its parallelism or its device: the same plan steps the plain-torch and
the megatron-core backends (`torch_trainer`, `megatron_trainer`), and is tested over a small model of
the tests' own without distributed torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from streamrl.buffer.padded import PaddedBatch
from streamrl.config import TrainerSection
from streamrl.correction import (
    LossConfig,
    PolicyBatch,
    broadcast_to_tokens,
    grpo_advantages,
    make_loss,
    rloo_advantages,
)
from streamrl.correction.losses import m2po_cutoff, m2po_values, token_means
from streamrl.trainer import diagnostics
from streamrl.trainer.schedule import lr_at

LossOf = Callable[[np.ndarray, torch.Tensor], torch.Tensor]  # (a micro-batch's rows, their θ log-probs) → loss


class Backend(Protocol):
    """The model a step trains, as the step sees it. Row indices are into the step's padded batch; a
    micro-batch's log-probs are [rows, w − 1] for its longest row w (tokens 1..w−1)."""

    def shard(self, rows: np.ndarray) -> np.ndarray:
        """The rows of a mini-batch this rank trains on (whole groups; all of them on one rank)."""

    def logprobs(self, batch: PaddedBatch, lengths: np.ndarray, parts: list[np.ndarray], *,
                 reference: bool = False) -> list[torch.Tensor]:
        """No-grad log-probs of each micro-batch, θ's or the frozen reference policy's ([] on a
        pipeline stage that does not compute them)."""

    def backward(self, batch: PaddedBatch, lengths: np.ndarray, parts: list[np.ndarray], loss_of: LossOf) -> None:
        """Accumulate the gradient of `loss_of(rows, θ log-probs)` of each micro-batch into `.grad`."""

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """The whole model's gradient norm (after any reduction over ranks, the same on every rank),
        the gradients scaled to at most `max_norm`."""

    def optimizer_step(self, lr: float) -> None: ...

    def zero_grad(self) -> None: ...

    def snapshot(self) -> Any:
        """The weights and optimizer state, in host memory: a step's rollback point."""

    def restore(self, saved: Any) -> None: ...

    def gather_metrics(self, totals: dict[str, float]) -> list[dict[str, float]]:
        """Every rank's step metrics (each already weighted by its share of the step's tokens)."""

    def all_gather(self, value: np.ndarray) -> list[np.ndarray]:
        """Every data-parallel rank's `value` (a whole-batch statistic from each rank's rows)."""

    def flat_gradient(self) -> torch.Tensor:
        """The accumulated gradient of the whole model as one vector (for `trainer.diagnose_every`; a
        backend that cannot gather it raises NotImplementedError, and pre-flight refuses the setting)."""


@dataclass(frozen=True)
class StepPlan:
    """What a step does with a batch, from the run config."""

    group_size: int
    minibatches: int
    micro_batch_tokens: int
    advantage: str  # grpo | drgrpo | rloo
    grad_clip: float
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    token_mean: bool  # the loss is normalised by tokens (else by rows)
    needs_proximal: bool
    with_reference: bool
    schedule: dict[str, Any]  # `lr_at`'s keywords
    m2_tau: float | None = None  # m2po: its mask is the whole batch's, computed before any gradient
    diagnose_every: int = 0  # the extra passes of `streamrl.trainer.diagnostics` every this many steps

    @classmethod
    def of(cls, trainer: TrainerSection, loss: LossConfig, group_size: int, lr_horizon: int | None = None) -> StepPlan:
        """`lr_horizon`: the run's optimizer steps, where a decaying schedule ends unless `lr_decay_steps` says."""
        decay = trainer.lr_decay_steps or lr_horizon
        schedule = {"lr": trainer.lr, "schedule": trainer.lr_schedule, "warmup_steps": trainer.warmup_steps,
                    "decay_steps": decay if trainer.lr_schedule != "constant" else None,
                    "min_lr_ratio": trainer.min_lr_ratio}
        lr_at(0, **schedule)  # a decaying schedule without a horizon fails here, not at its first step
        return cls(group_size=group_size, minibatches=trainer.minibatches,
                   micro_batch_tokens=trainer.micro_batch_tokens, advantage=trainer.advantage,
                   grad_clip=trainer.grad_clip, loss_fn=make_loss(loss),
                   token_mean=loss.aggregation == "token_mean", needs_proximal=loss.needs_proximal,
                   with_reference=loss.kl_coef > 0, schedule=schedule,
                   m2_tau=loss.m2_tau if loss.name == "m2po" else None, diagnose_every=trainer.diagnose_every)

    def lr(self, optimizer_step: int) -> float:
        return lr_at(optimizer_step, **self.schedule)


def run_step(backend: Backend, plan: StepPlan, batch: PaddedBatch, *, version: int, optimizer_steps: int,
             rng: np.random.Generator, fresh: PaddedBatch | None = None) -> dict[str, Any]:
    """One step on `batch` (complete groups, rows of a group adjacent); `optimizer_steps` taken before it
    (the schedule's position), `rng` the mini-batch shuffle's. A non-finite gradient in any mini-batch
    restores the backend to where it was and raises FloatingPointError. Returns the step's metrics,
    `optimizer_steps` (taken by this step) among them. `fresh`, on a diagnosed step: the same prompts
    sampled by the current weights, for `streamrl.trainer.diagnostics` (never trained on)."""
    lengths, mask, adv = _padded_parts(batch, plan)
    parts = minibatch_rows(len(lengths), plan.group_size, plan.minibatches, rng)
    mine = np.sort(np.concatenate([backend.shard(rows) for rows in parts]))
    diagnose = plan.diagnose_every > 0 and version % plan.diagnose_every == 0
    # one optimizer step: p is θ in the same forward pass (see the module docstring), unless the loss
    # needs a statistic of the whole batch's p before the first gradient (m2po) or the step is diagnosed
    proximal = forward_logprobs(backend, batch, lengths, mine, plan.micro_batch_tokens) \
        if (plan.needs_proximal and (len(parts) > 1 or plan.m2_tau is not None)) or diagnose else None
    keywords = {} if plan.m2_tau is None else {"cutoff": m2po_batch_cutoff(backend, batch, mine, proximal, adv,
                                                                           mask, plan.m2_tau)}
    reference = forward_logprobs(backend, batch, lengths, mine, plan.micro_batch_tokens, reference=True) \
        if plan.with_reference else None
    totals: dict[str, float] = data_diagnostics(batch, mine, mask, proximal, version=version,
                                                group_size=plan.group_size)
    diagnosed = diagnose and fresh is not None and backend.shard(np.arange(len(lengths))).size == len(lengths)
    extra = _alignment_with_fresh(backend, plan, batch, fresh, adv, proximal=proximal, reference=reference,
                                  version=version, keywords=keywords) if diagnosed else {}
    # the fresh batch's log-probs at the step's starting weights, as the trainer computes them (its
    # behaviour log-probs are the sampler's: another kernel, and over the top-p set if one is given)
    before = _every_rows_logprobs(backend, plan, fresh) if diagnosed else None
    saved = backend.snapshot() if len(parts) > 1 else None
    grad_norms = []
    step_tokens = int(mask.sum())
    for i, rows in enumerate(parts):
        try:
            grad_norms.append(_optimizer_step(backend, plan, batch, rows, lengths, mask, adv, totals,
                                              proximal=proximal, reference=reference, version=version,
                                              step_tokens=step_tokens, lr=plan.lr(optimizer_steps + i),
                                              keywords=keywords))
        except FloatingPointError:
            if saved is not None:  # earlier mini-batches of this step were applied: undo them
                backend.restore(saved)
            raise
    if diagnosed:
        extra.update(_update_kl(backend, plan, fresh, before))
    totals = diagnostics.finish(whole_step_ess(mean_mismatch(token_means(merge_ranks(backend.gather_metrics(totals))))))
    totals.update(extra, grad_norm=float(np.mean(grad_norms)), response_tokens=step_tokens,
                  trained_tokens=int(lengths.sum()), samples=len(lengths), optimizer_steps=len(parts),
                  lr=plan.lr(optimizer_steps + len(parts) - 1))  # the step's last optimizer step
    return totals


def _padded_parts(batch: PaddedBatch, plan: StepPlan) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Row lengths, the loss mask aligned to log-probs, and the token advantages of a batch."""
    lengths = (batch.prompt_lengths + batch.response_lengths).cpu().numpy()
    mask = batch.loss_mask[:, 1:]
    return lengths, mask, broadcast_to_tokens(advantages(batch.rewards, plan.group_size, plan.advantage), mask)


def _alignment_with_fresh(backend: Backend, plan: StepPlan, batch: PaddedBatch, fresh: PaddedBatch,
                          adv: torch.Tensor, *, proximal: torch.Tensor | None, reference: torch.Tensor | None,
                          version: int, keywords: dict[str, Any]) -> dict[str, float]:
    """`diagnostics.gradient_alignment` of the step's batch and `fresh`, at the step's starting weights."""
    lengths, mask, _ = _padded_parts(batch, plan)
    fresh_lengths, fresh_mask, fresh_adv = _padded_parts(fresh, plan)
    return diagnostics.gradient_alignment(
        lambda rows: _gradient(backend, plan, batch, rows, lengths, mask, adv, proximal=proximal,
                               reference=reference, version=version, keywords=keywords),
        lambda rows: _gradient(backend, plan, fresh, rows, fresh_lengths, fresh_mask, fresh_adv, proximal=None,
                               reference=None, version=version, keywords={}),
        len(lengths) // plan.group_size, plan.group_size, np.random.default_rng(version))


def _update_kl(backend: Backend, plan: StepPlan, fresh: PaddedBatch, before: torch.Tensor) -> dict[str, float]:
    """KL(before → after the step) on `fresh`, sampled by the weights before it; `before`: their log-probs."""
    mask = fresh.loss_mask[:, 1:]
    after = _every_rows_logprobs(backend, plan, fresh)
    return diagnostics.finish(diagnostics.update_kl_sums(before, after, mask.bool() & torch.isfinite(before)))


def data_diagnostics(batch: PaddedBatch, rows: np.ndarray, mask: torch.Tensor, proximal: torch.Tensor | None, *,
                     version: int, group_size: int) -> dict[str, float]:
    """`streamrl.trainer.diagnostics`' per-step sums over this rank's `rows` (whole groups)."""
    rows_t = torch.from_numpy(rows)
    if proximal is None:
        return diagnostics.group_signal(batch.rewards[rows_t], group_size)
    valid = _valid(batch, mask, proximal)[rows_t]
    behavior, prox = batch.behavior_logprobs[:, 1:][rows_t], proximal[rows_t]
    return {**diagnostics.group_signal(batch.rewards[rows_t], group_size, behavior=behavior, proximal=prox,
                                       valid=valid),
            **diagnostics.lag_kl_sums(behavior, prox, batch.versions[:, 1:][rows_t], valid, version)}


def _valid(batch: PaddedBatch, mask: torch.Tensor, proximal: torch.Tensor) -> torch.Tensor:
    return mask.bool() & torch.isfinite(batch.behavior_logprobs[:, 1:]) & torch.isfinite(proximal)


def _gradient(backend: Backend, plan: StepPlan, batch: PaddedBatch, rows: np.ndarray, lengths: np.ndarray,
              mask: torch.Tensor, adv: torch.Tensor, *, proximal: torch.Tensor | None,
              reference: torch.Tensor | None, version: int, keywords: dict[str, Any]) -> torch.Tensor:
    """The flat gradient of the loss of `rows` alone at the current weights (normalised by their own
    tokens or rows); the model's gradients are left zero."""
    tokens = int(mask[torch.from_numpy(rows)].sum())
    loss_of = _loss_of(plan, batch, mask, adv, proximal=proximal, reference=reference, version=version,
                       denominator=float(max(tokens, 1)) if plan.token_mean else float(len(rows)),
                       keywords=keywords)
    backend.zero_grad()
    backend.backward(batch, lengths, micro_batch_rows(lengths, rows, plan.micro_batch_tokens), loss_of)
    gradient = backend.flat_gradient()
    backend.zero_grad()
    return gradient


def _optimizer_step(backend: Backend, plan: StepPlan, batch: PaddedBatch, rows: np.ndarray, lengths: np.ndarray,
                    mask: torch.Tensor, adv: torch.Tensor, totals: dict[str, float], *, proximal: torch.Tensor | None,
                    reference: torch.Tensor | None, version: int, step_tokens: int, lr: float,
                    keywords: dict[str, Any]) -> float:
    """Accumulate the gradient of this rank's share of `rows` over micro-batches, clip, step; metrics
    into `totals` weighted by the mini-batch's share of the step's tokens. The loss is normalised by the
    whole mini-batch's tokens (or rows), so that data-parallel ranks' gradients sum to the one-rank
    gradient. Returns the gradient norm."""
    tokens = int(mask[torch.from_numpy(rows)].sum())
    share = tokens / max(step_tokens, 1)
    backend.zero_grad()
    recorded: list[tuple[np.ndarray, torch.Tensor, dict[str, torch.Tensor]]] = []

    def record(part: np.ndarray, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        recorded.append((part, loss.detach(), metrics))  # read once every backward pass is queued: a float()
        # here would make the host wait for the device before it could queue the next micro-batch

    loss_of = _loss_of(plan, batch, mask, adv, proximal=proximal, reference=reference, version=version,
                       denominator=float(max(tokens, 1)) if plan.token_mean else float(len(rows)),
                       keywords=keywords, record=record)
    mine = backend.shard(rows)
    backend.backward(batch, lengths, micro_batch_rows(lengths, mine, plan.micro_batch_tokens), loss_of)
    for part, loss, metrics in recorded:
        within = float(mask[torch.from_numpy(part)].sum()) / max(tokens, 1)
        accumulate(totals, metrics, share=share * within)
        totals["loss"] = totals.get("loss", 0.0) + share * float(loss)  # already over the whole mini-batch
    grad_norm = backend.clip_gradients(plan.grad_clip)
    if not torch.isfinite(grad_norm):
        backend.zero_grad()
        raise FloatingPointError(f"non-finite gradient norm at version {version}; the step was not taken")
    backend.optimizer_step(lr)
    return float(grad_norm)


def _loss_of(plan: StepPlan, batch: PaddedBatch, mask: torch.Tensor, adv: torch.Tensor, *,
             proximal: torch.Tensor | None, reference: torch.Tensor | None, version: int, denominator: float,
             keywords: dict[str, Any],
             record: Callable[[np.ndarray, torch.Tensor, dict[str, torch.Tensor]], None] | None = None) -> LossOf:
    """The loss of a micro-batch's rows given their θ log-probs, over `denominator` tokens (or rows);
    `record` sees each micro-batch's loss and metrics."""
    behavior, versions = batch.behavior_logprobs[:, 1:], batch.versions[:, 1:]

    def loss_of(part: np.ndarray, theta: torch.Tensor) -> torch.Tensor:
        rows_t, cut = torch.from_numpy(part), slice(0, theta.shape[1])
        if not plan.needs_proximal:
            prox = None
        else:
            prox = theta.detach() if proximal is None else proximal[rows_t, cut]
        loss, metrics = plan.loss_fn(
            PolicyBatch(logprobs=theta, behavior_logprobs=behavior[rows_t, cut], advantages=adv[rows_t, cut],
                        mask=mask[rows_t, cut], proximal_logprobs=prox, versions=versions[rows_t, cut],
                        ref_logprobs=None if reference is None else reference[rows_t, cut]),
            denominator=denominator, trainer_version=version, **keywords)
        if record is not None:
            record(part, loss, metrics)
        return loss

    return loss_of


def forward_logprobs(backend: Backend, batch: PaddedBatch, lengths: np.ndarray, rows: np.ndarray, token_budget: int,
                     *, reference: bool = False) -> torch.Tensor:
    """No-grad log-probs of `rows` in the batch's [N, L − 1] layout (the other rows and positions 0): p,
    when called before any mini-batch moved the weights; the reference policy's with `reference`."""
    out = torch.zeros_like(batch.behavior_logprobs[:, 1:])
    parts = micro_batch_rows(lengths, rows, token_budget)
    for part, logprobs in zip(parts, backend.logprobs(batch, lengths, parts, reference=reference)):
        out[torch.from_numpy(part), :logprobs.shape[1]] = logprobs
    return out


def _every_rows_logprobs(backend: Backend, plan: StepPlan, batch: PaddedBatch) -> torch.Tensor:
    lengths = (batch.prompt_lengths + batch.response_lengths).cpu().numpy()
    return forward_logprobs(backend, batch, lengths, np.arange(len(lengths)), plan.micro_batch_tokens)


def m2po_batch_cutoff(backend: Backend, batch: PaddedBatch, rows: np.ndarray, proximal: torch.Tensor,
                      adv: torch.Tensor, mask: torch.Tensor, m2_tau: float) -> float:
    """M2PO's mask threshold over the whole step's batch: the trust-region tokens of this rank's `rows`
    and every other data-parallel rank's, so that every micro-batch and rank masks as one batch would."""
    rows_t = torch.from_numpy(rows)
    behavior, prox = batch.behavior_logprobs[:, 1:][rows_t], proximal[rows_t]
    valid = mask[rows_t].bool() & torch.isfinite(behavior) & torch.isfinite(prox)
    values, _ = m2po_values(torch.where(valid, prox - behavior, 0.0), adv[rows_t], valid)
    every = np.concatenate(backend.all_gather(values.double().cpu().numpy()))
    return m2po_cutoff(torch.from_numpy(every), m2_tau)


# ---- the cut: mini-batches of whole groups, micro-batches within a token budget ---------------------------
def minibatch_rows(rows: int, group_size: int, minibatches: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Row indices of each mini-batch: whole groups, shuffled (`rng`), split as evenly as possible
    (never more mini-batches than groups; one mini-batch draws nothing from `rng`)."""
    groups = rows // group_size
    count = min(minibatches, groups)
    if count == 1:
        return [np.arange(rows)]
    order = rng.permutation(groups)
    return [(part[:, None] * group_size + np.arange(group_size)).ravel() for part in np.array_split(order, count)]


def micro_batches(lengths: np.ndarray, token_budget: int) -> Iterator[np.ndarray]:
    """Row indices, sorted by length, cut so that rows × longest row ≤ budget (a row longer than
    the budget goes alone)."""
    order = np.argsort(lengths, kind="stable")
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * lengths[order[end]] <= token_budget:
            end += 1
        yield order[start:end]
        start = end


def micro_batch_rows(lengths: np.ndarray, rows: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """`rows` cut into micro-batches within the token budget (the same cut on every rank)."""
    return [rows[local] for local in micro_batches(lengths[rows], token_budget)]


def advantages(rewards: torch.Tensor, group_size: int, kind: str) -> torch.Tensor:
    if kind == "grpo":
        return grpo_advantages(rewards, group_size)
    if kind == "drgrpo":
        return grpo_advantages(rewards, group_size, scale=False)
    if kind == "rloo":
        return rloo_advantages(rewards, group_size)
    raise ValueError(f"unknown advantage {kind!r}")


# ---- metrics: one rule for micro-batches and for ranks ---------------------------------------------------
def accumulate(totals: dict[str, float], metrics: dict[str, Any], *, share: float = 1.0) -> None:
    """Combine `metrics` into `totals`: extremes by min/max, counts and sums added, the rest added
    weighted by `share` (a micro-batch's share of the step's tokens; 1 for a rank's already weighted
    totals)."""
    for name, value in metrics.items():
        value = float(value)
        if name.endswith("_max"):
            totals[name] = max(totals.get(name, value), value)
        elif name.endswith("_min"):
            totals[name] = min(totals.get(name, value), value)
        elif name == "tokens" or name.endswith(("_sum", "_count")):
            totals[name] = totals.get(name, 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + share * value


def merge_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from every rank's (a rank may lack a key: it had no tokens)."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    merged: dict[str, float] = {}
    for totals in per_rank:
        accumulate(merged, totals)
    return merged


def mean_mismatch(totals: dict[str, float]) -> dict[str, float]:
    """`mismatch_kl` from the step's sum and count (see `streamrl.correction.losses._mismatch`); without
    a token of the trainer's own version in the step there is nothing to report."""
    total, count = totals.pop("mismatch_kl_sum", 0.0), totals.pop("mismatch_count", 0.0)
    if count:
        totals.update(mismatch_kl=total / count, mismatch_tokens=int(count))
    else:
        totals.pop("mismatch_abs_max", None)
    return totals


def whole_step_ess(totals: dict[str, float]) -> dict[str, float]:
    """`ess` of the step's importance weights, (Σw)² / (n Σw²) over every kept token of every
    micro-batch and rank, from the sums the loss reports (`tokens` is n)."""
    total, squares = totals.pop("ess_weight_sum", None), totals.pop("ess_weight_sq_sum", None)
    if total is not None and squares is not None:
        totals["ess"] = total ** 2 / (max(totals.get("tokens", 0.0), 1.0) * max(squares, 1e-30))
    return totals
