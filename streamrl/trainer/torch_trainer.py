"""The plain-torch trainer: one consumed batch of groups → `minibatches` optimizer steps → version + 1.

```
 Arrow table ─to_padded─► [N, L] tensors ─► group advantages (one per sample, broadcast to tokens)
   minibatches > 1: proximal log-probs p of every row (no grad), groups shuffled and split in mini-batches
   each mini-batch: rows sorted by length, cut into micro-batches of ≤ micro_batch_tokens padded tokens
     each micro-batch: forward ─► θ log-probs ─► loss(θ, b, p, A) / mini-batch tokens ─► backward
     clip the gradient norm ─► AdamW step
 version + 1 (the staleness contract: B groups per version, however many optimizer steps they make)
```
With `loss.kl_coef > 0` a frozen copy of the initial policy (the run's starting weights, also after a
resume) gives reference log-probs for the KL penalty: one more no-grad forward pass per step, through
the same micro-batches (and pipeline stages); `trainer.reference_offload` keeps that copy in host
memory between steps.

The proximal log-probs `p` are the trainer's weights at the start of the step. With one optimizer
step per consumed batch (the default) `p` equals θ's value in the same forward pass, so it is taken as
`θ.detach()` instead of paying for a second forward pass; then `decoupled_ppo` and `tis` coincide
(r = 1, nothing to clip). With several mini-batches (PPO's inner epochs: more learning per generated
sample) θ moves away from p within the step, the PPO clip bounds that move, and the correction bounds
the behaviour → proximal gap: the objectives differ as they do in the literature. A loss that does not
read `p` (`LossConfig.needs_proximal`: `ppo_bypass`, `reinforce`) never pays for that forward pass.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from streamrl.buffer.padded import to_padded
from streamrl.config import TrainerSection
from streamrl.correction import (
    LossConfig,
    PolicyBatch,
    broadcast_to_tokens,
    grpo_advantages,
    make_loss,
    rloo_advantages,
    token_logprobs,
)
from streamrl.engine.base import generate
from streamrl.engine.local_weights import LocalWeights
from streamrl.engine.torch_engine import TorchEngine
from streamrl.models.hf import autocast, default_device, load_policy
from streamrl.tasks import Task
from streamrl.trainer.schedule import lr_at
from streamrl.weights.arrays import state_arrays


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


def advantages(rewards: torch.Tensor, group_size: int, kind: str) -> torch.Tensor:
    if kind == "grpo":
        return grpo_advantages(rewards, group_size)
    if kind == "drgrpo":
        return grpo_advantages(rewards, group_size, scale=False)
    if kind == "rloo":
        return rloo_advantages(rewards, group_size)
    raise ValueError(f"unknown advantage {kind!r}")


class TorchTrainer:
    def __init__(self, model_dir: str | Path, *, trainer: TrainerSection, loss: LossConfig, group_size: int,
                 temperature: float = 1.0, version: int = 0, seed: int = 0, lr_horizon: int | None = None,
                 dtype: str = "float32", attention: str = "eager", reference_dir: str | Path | None = None):
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_policy(model_dir, train=True, dtype=dtype, attention=attention)
        self.model.to(default_device())
        self.compute_dtype, self.attention = dtype, attention  # weights and optimizer state stay float32
        if trainer.gradient_checkpointing:
            _enable_activation_checkpointing(self.model)
        self._setup(trainer, loss, group_size, temperature, version, seed, lr_horizon,
                    reference_dir=reference_dir or model_dir)

    def _setup(self, trainer: TrainerSection, loss: LossConfig, group_size: int, temperature: float, version: int,
               seed: int, lr_horizon: int | None = None, *, reference_dir: str | Path) -> None:
        """Everything but the model: loss, optimizer over `self.model`'s parameters, version, shuffle, the
        reference policy (from `reference_dir`, with a KL penalty). `lr_horizon`: the run's optimizer
        steps, where a decaying schedule ends unless `lr_decay_steps` says."""
        self.config, self.group_size, self.temperature = trainer, group_size, temperature
        self.reference = None
        if loss.kl_coef > 0:
            self.reference = self._load_reference(Path(reference_dir)).requires_grad_(False).eval()
            self.reference.to(torch.device("cpu") if trainer.reference_offload else self.device)
        self.lr_decay_steps = trainer.lr_decay_steps or lr_horizon
        self.optimizer_steps = 0  # taken so far: the schedule's position, saved with the checkpoint
        lr_at(0, **self._lr_schedule())  # a decaying schedule without a horizon fails here, not at its first step
        self.loss_name = loss.name
        self.loss_fn = make_loss(loss)
        self.needs_proximal = loss.needs_proximal
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=trainer.lr, betas=trainer.betas,
                                           weight_decay=trainer.weight_decay)
        self.version = version
        self._rng = np.random.default_rng(seed)  # the mini-batch shuffle

    def _load_reference(self, path: Path) -> torch.nn.Module:
        """The frozen reference policy: the same architecture as `self.model`, the weights at `path`."""
        model, _ = load_policy(path, train=True, dtype=self.compute_dtype, attention=self.attention)
        return model

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[None]:
        """Forward passes inside run the reference policy (on the trainer's device while they run)."""
        live, device = self.model, self.device
        self.reference.to(device)
        self.model = self.reference
        try:
            yield
        finally:
            self.model = live
            if self.config.reference_offload:
                self.reference.to("cpu")

    @torch.no_grad()
    def _reference_logprobs(self, batch, lengths: np.ndarray, mine: np.ndarray) -> torch.Tensor:
        """Reference log-probs for the rows `mine` (the others stay 0)."""
        with self._as_reference():
            return self._forward_logprobs(batch, lengths, mine)

    def _lr_schedule(self) -> dict[str, Any]:
        c = self.config
        return {"lr": c.lr, "schedule": c.lr_schedule, "warmup_steps": c.warmup_steps,
                "decay_steps": self.lr_decay_steps if c.lr_schedule != "constant" else None,
                "min_lr_ratio": c.min_lr_ratio}

    def _token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[n, w − 1] log-probs of tokens 1..w−1 (right padding: default positions are right)."""
        with autocast(self.device, self.compute_dtype):
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return token_logprobs(logits / self.temperature, input_ids[:, 1:])

    def train(self, table: pa.Table | pa.RecordBatch) -> dict[str, float]:
        """`minibatches` optimizer steps on a batch of complete groups (rows of a group adjacent), then
        version + 1. A non-finite gradient in any mini-batch rolls the whole step back and raises."""
        start = time.perf_counter()
        batch = to_padded(table, self.pad_id)
        lengths = (batch.prompt_lengths + batch.response_lengths).numpy()
        batch = batch.to(self.device)
        mask = batch.loss_mask[:, 1:]
        adv = broadcast_to_tokens(advantages(batch.rewards, self.group_size, self.config.advantage), mask)
        parts = self._minibatch_rows(len(lengths))
        # one optimizer step: p is θ in the same forward pass (see the module docstring)
        proximal = None if len(parts) == 1 or not self.needs_proximal else self._forward_logprobs(
            batch, lengths, np.sort(np.concatenate([self._shard(rows) for rows in parts])))
        reference = None if self.reference is None else self._reference_logprobs(
            batch, lengths, np.sort(np.concatenate([self._shard(rows) for rows in parts])))
        saved = None if len(parts) == 1 else (_host_copy(self.model.state_dict()),  # host memory, not the GPU's
                                              _host_copy(self.optimizer.state_dict()), self.optimizer_steps)
        self.model.train()
        totals: dict[str, float] = {}
        grad_norms = []
        tokens = int(mask.sum())
        for rows in parts:
            try:
                grad_norms.append(self._optimizer_step(batch, rows, lengths, mask, adv, proximal, totals,
                                                       step_tokens=tokens, reference=reference))
            except FloatingPointError:
                if saved is not None:  # earlier mini-batches of this step were applied: undo them
                    self.model.load_state_dict(saved[0])
                    self.optimizer.load_state_dict(saved[1])
                    self.optimizer_steps = saved[2]
                raise
        self.version += 1
        totals = _mean_mismatch(self._reduce_metrics(totals))
        totals.update(grad_norm=float(np.mean(grad_norms)), response_tokens=tokens, trained_tokens=int(lengths.sum()),
                      samples=len(lengths), optimizer_steps=len(parts),
                      lr=lr_at(self.optimizer_steps - 1, **self._lr_schedule()),  # the step's last optimizer step
                      train_s=time.perf_counter() - start)
        return totals

    def _minibatch_rows(self, rows: int) -> list[np.ndarray]:
        """Row indices of each mini-batch: whole groups, shuffled (seeded), split as evenly as possible."""
        groups = rows // self.group_size
        count = min(self.config.minibatches, groups)
        if count == 1:
            return [np.arange(rows)]
        order = self._rng.permutation(groups)
        return [(part[:, None] * self.group_size + np.arange(self.group_size)).ravel()
                for part in np.array_split(order, count)]

    def _reduce_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The loss metrics of the whole step from this rank's (the identity on a single rank)."""
        return totals

    def _shard(self, rows: np.ndarray) -> np.ndarray:
        """The rows of a mini-batch this rank trains on: all of them here; a data-parallel trainer
        takes its share of the whole groups."""
        return rows

    @torch.no_grad()
    def _forward_logprobs(self, batch, lengths: np.ndarray, mine: np.ndarray) -> torch.Tensor:
        """No-grad log-probs of the rows `mine` (the others stay 0): p, when called before any mini-batch
        moved the weights; the reference policy's inside `_as_reference`."""
        proximal = torch.zeros_like(batch.behavior_logprobs[:, 1:])
        parts = self._micro_batch_rows(lengths, mine)
        for rows, logprobs in zip(parts, self._forward_only(batch, lengths, parts)):
            proximal[torch.from_numpy(rows), :logprobs.shape[1]] = logprobs
        return proximal

    def _micro_batch_rows(self, lengths: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
        """`rows` cut into micro-batches within the token budget (the same cut on every rank)."""
        return [rows[local] for local in micro_batches(lengths[rows], self.config.micro_batch_tokens)]

    def _forward_only(self, batch, lengths: np.ndarray, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """θ log-probs of each micro-batch's rows (a pipeline's other stages than the last: none)."""
        return [self._micro_batch_logprobs(batch, lengths, rows) for rows in parts]

    def _micro_batch_logprobs(self, batch, lengths: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """[n, w − 1] θ log-probs of `rows`, cut to their longest row w."""
        width = int(lengths[rows].max())
        rows_t = torch.from_numpy(rows)
        return self._token_logprobs(batch.input_ids[rows_t, :width], batch.attention_mask[rows_t, :width])

    def _accumulate_gradients(self, batch, lengths: np.ndarray, parts: list[np.ndarray],
                              loss_of: Callable[[np.ndarray, torch.Tensor], torch.Tensor]) -> None:
        """Backward of each micro-batch's loss (`loss_of(rows, θ log-probs)`) into `.grad`."""
        for rows in parts:
            loss_of(rows, self._micro_batch_logprobs(batch, lengths, rows)).backward()

    def _optimizer_step(self, batch, rows: np.ndarray, lengths: np.ndarray, mask: torch.Tensor, adv: torch.Tensor,
                        proximal: torch.Tensor | None, totals: dict[str, float], *, step_tokens: int,
                        reference: torch.Tensor | None = None) -> float:
        """Accumulate the gradient of `rows` (this rank's share of them) over micro-batches, clip, step;
        metrics into `totals` weighted by the mini-batch's share of the step's tokens. The loss is
        normalised by the whole mini-batch's tokens (or rows), so that data-parallel ranks' gradients sum
        to the one-rank gradient. Returns the gradient norm."""
        behavior, versions = batch.behavior_logprobs[:, 1:], batch.versions[:, 1:]
        tokens = int(mask[torch.from_numpy(rows)].sum())
        share = tokens / max(step_tokens, 1)
        denominator = float(max(tokens, 1)) if self.loss_fn.keywords["aggregation"] == "token_mean" \
            else float(len(rows))
        self.optimizer.zero_grad(set_to_none=True)

        def loss_of(part: np.ndarray, theta: torch.Tensor) -> torch.Tensor:
            rows_t, cut = torch.from_numpy(part), slice(0, theta.shape[1])
            if not self.needs_proximal:
                prox = None
            else:
                prox = theta.detach() if proximal is None else proximal[rows_t, cut]
            loss, metrics = self.loss_fn(
                PolicyBatch(logprobs=theta, behavior_logprobs=behavior[rows_t, cut], advantages=adv[rows_t, cut],
                            mask=mask[rows_t, cut], proximal_logprobs=prox, versions=versions[rows_t, cut],
                            ref_logprobs=None if reference is None else reference[rows_t, cut]),
                denominator=denominator, trainer_version=self.version)
            within = float(mask[rows_t].sum()) / max(tokens, 1)
            _accumulate(totals, metrics, share=share * within, loss=share * float(loss.detach()))
            return loss

        mine = self._shard(rows)
        self._accumulate_gradients(batch, lengths, self._micro_batch_rows(lengths, mine), loss_of)
        grad_norm = self._clip_gradients()
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm at version {self.version}; the step was not taken")
        lr = lr_at(self.optimizer_steps, **self._lr_schedule())
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer_steps += 1
        return float(grad_norm)

    optimizer_file = "optimizer.pt"

    def offload(self) -> None:
        """Colocated with sglang servers: weights and optimizer state to host memory while the servers
        use the GPU (a no-op on a CPU-only process)."""
        self._move(torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        self._move(default_device())

    def _move(self, device: torch.device) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # the last step's gradients are not carried along
        self.model.to(device)
        if self.reference is not None and not self.config.reference_offload:
            self.reference.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":  # AdamW keeps `step` on the CPU
                    state[key] = value.to(device)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _clip_gradients(self) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)

    def hf_model(self):
        """The policy as a Hugging Face model with the current weights (for evaluation and checkpoints)."""
        return self.model

    def weights(self) -> dict[str, np.ndarray]:
        """Views of the live weights as numpy arrays, for a consumer that copies at once (`ray.put`)."""
        return state_arrays(self.model, copy=False)

    @torch.no_grad()
    def evaluate(self, task: Task, *, limit: int | None = None, max_new_tokens: int) -> dict[str, float]:
        """Greedy answers to the held-out prompts: mean reward and exact-match accuracy (reward 1)."""
        model = self.hf_model()  # first: a collective for a tensor-parallel trainer, on every rank alike
        prompts = task.eval_prompts(limit)
        if not prompts:
            return {}
        model.eval()
        engine = TorchEngine(LocalWeights(model, version=self.version), pad_id=self.pad_id,
                             stop_ids=task.stop_token_ids, max_new_tokens=max_new_tokens, capacity=len(prompts),
                             greedy=True)
        generation = generate(engine, prompts)
        rewards = np.array([task.eval_reward(i, generation.response(i)) for i in range(len(prompts))])
        return {"eval_reward": float(rewards.mean()), "eval_accuracy": float((rewards >= 1.0).mean()),
                "eval_prompts": len(prompts)}

    # ---- checkpoints -----------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.hf_model().save_pretrained(directory / "model")
        self.tokenizer.save_pretrained(directory / "model")
        torch.save(self.optimizer.state_dict(), directory / self.optimizer_file)
        (directory / "trainer.json").write_text(json.dumps(self.progress()))

    def progress(self) -> dict[str, Any]:
        """What trainer.json records beside the weights and optimizer state: the version, the schedule's
        position and the mini-batch shuffle's generator (a resumed run splits its batches as an
        uninterrupted one would)."""
        return {"version": self.version, "optimizer_steps": self.optimizer_steps,
                "shuffle": self._rng.bit_generator.state}

    def load_optimizer(self, directory: str | Path) -> None:
        """Restore the optimizer, version and schedule position saved next to the model this trainer
        was built from."""
        directory = Path(directory)
        self.optimizer.load_state_dict(torch.load(directory / self.optimizer_file, weights_only=True))
        saved = json.loads((directory / "trainer.json").read_text())
        self.version = saved["version"]
        # checkpoints written before schedules: every step took `minibatches` optimizer steps
        self.optimizer_steps = saved.get("optimizer_steps", self.version * self.config.minibatches)
        if "shuffle" in saved:
            self._rng.bit_generator.state = saved["shuffle"]


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward pass (the name changed in transformers 5.x)."""
    kwargs = {"use_reentrant": False}  # the non-reentrant form works with inputs that need no gradient
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _mean_mismatch(totals: dict[str, float]) -> dict[str, float]:
    """`mismatch_kl` from the step's sum and count (see `streamrl.correction.losses._mismatch`); without
    a token of the trainer's own version in the step there is nothing to report."""
    total, count = totals.pop("mismatch_kl_sum", 0.0), totals.pop("mismatch_count", 0.0)
    if count:
        totals.update(mismatch_kl=total / count, mismatch_tokens=int(count))
    else:
        totals.pop("mismatch_abs_max", None)
    return totals


def _host_copy(state):
    """A deep copy with every tensor in host memory (a step's rollback point)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return type(state)((k, _host_copy(v)) for k, v in state.items())
    if isinstance(state, list | tuple):
        return type(state)(_host_copy(v) for v in state)
    return copy.deepcopy(state)


def _accumulate(totals: dict[str, float], metrics: dict[str, torch.Tensor], *, share: float, loss: float) -> None:
    """Combine per-micro-batch metrics: extremes by min/max, the rest weighted by token share."""
    totals["loss"] = totals.get("loss", 0.0) + loss  # already divided by the whole batch's denominator
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
