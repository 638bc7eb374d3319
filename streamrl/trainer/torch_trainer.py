"""The plain-torch trainer: one consumed batch of groups → one optimizer step → version + 1.

```
 Arrow table ─to_padded─► [N, L] tensors ─► group advantages (one per sample, broadcast to tokens)
   rows sorted by length, cut into micro-batches of ≤ micro_batch_tokens padded tokens
   each micro-batch: forward ─► θ log-probs ─► loss(θ, b, p, A) / batch tokens ─► backward (accumulate)
 clip the gradient norm ─► AdamW step ─► version + 1
```
The proximal log-probs `p` are the trainer's weights at the start of the step. With one optimizer
step per consumed batch (the staleness contract: B groups per version) `p` equals θ's value in the
same forward pass, so it is taken as `θ.detach()` instead of paying for a second forward pass.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

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
from streamrl.engine.sampler import TorchSampler
from streamrl.models.hf import load_policy
from streamrl.tasks import Task
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
                 temperature: float = 1.0, version: int = 0, seed: int = 0):
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_policy(model_dir, train=True)
        self.config, self.group_size, self.temperature = trainer, group_size, temperature
        self.loss_name = loss.name
        self.loss_fn = make_loss(loss)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=trainer.lr, betas=trainer.betas,
                                           weight_decay=trainer.weight_decay)
        self.version = version

    def _token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[n, w − 1] log-probs of tokens 1..w−1 (right padding: default positions are right)."""
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return token_logprobs(logits / self.temperature, input_ids[:, 1:])

    def train(self, table: pa.Table | pa.RecordBatch) -> dict[str, float]:
        """One optimizer step on a batch of complete groups (rows of a group adjacent)."""
        start = time.perf_counter()
        batch = to_padded(table, self.pad_id)
        mask = batch.loss_mask[:, 1:]
        adv = broadcast_to_tokens(advantages(batch.rewards, self.group_size, self.config.advantage), mask)
        behavior, versions = batch.behavior_logprobs[:, 1:], batch.versions[:, 1:]
        lengths = (batch.prompt_lengths + batch.response_lengths).numpy()
        tokens = int(mask.sum())
        denominator = float(max(tokens, 1)) if self.loss_fn.keywords["aggregation"] == "token_mean" \
            else float(len(lengths))

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for rows in micro_batches(lengths, self.config.micro_batch_tokens):
            width = int(lengths[rows].max())
            rows_t = torch.from_numpy(rows)
            theta = self._token_logprobs(batch.input_ids[rows_t, :width], batch.attention_mask[rows_t, :width])
            cut = slice(0, width - 1)
            loss, metrics = self.loss_fn(
                PolicyBatch(logprobs=theta, behavior_logprobs=behavior[rows_t, cut], advantages=adv[rows_t, cut],
                            mask=mask[rows_t, cut], proximal_logprobs=theta.detach(), versions=versions[rows_t, cut]),
                denominator=denominator, trainer_version=self.version)
            loss.backward()
            _accumulate(totals, metrics, share=float(mask[rows_t].sum()) / max(tokens, 1), loss=float(loss.detach()))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm at version {self.version}; the step was not taken")
        self.optimizer.step()
        self.version += 1
        totals.update(grad_norm=float(grad_norm), response_tokens=tokens, trained_tokens=int(lengths.sum()),
                      samples=len(lengths),
                      train_s=time.perf_counter() - start)
        return totals

    def weights(self) -> dict[str, np.ndarray]:
        """Views of the live weights as numpy arrays, for a consumer that copies at once (`ray.put`)."""
        return state_arrays(self.model, copy=False)

    @torch.no_grad()
    def evaluate(self, task: Task, *, limit: int | None = None, max_new_tokens: int) -> dict[str, float]:
        """Greedy answers to the held-out prompts: mean reward and exact-match accuracy (reward 1)."""
        prompts = task.eval_prompts(limit)
        if not prompts:
            return {}
        self.model.eval()
        sampler = TorchSampler(self.model, pad_id=self.pad_id, stop_ids=task.stop_token_ids,
                               max_new_tokens=max_new_tokens)
        generation = sampler.generate(prompts, self.version, greedy=True)
        rewards = np.array([task.eval_reward(i, generation.response(i)) for i in range(len(prompts))])
        return {"eval_reward": float(rewards.mean()), "eval_accuracy": float((rewards >= 1.0).mean()),
                "eval_prompts": len(prompts)}

    # ---- checkpoints -----------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.model.save_pretrained(directory / "model")
        self.tokenizer.save_pretrained(directory / "model")
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "trainer.json").write_text(json.dumps({"version": self.version}))

    def load_optimizer(self, directory: str | Path) -> None:
        """Restore the optimizer and version saved next to the model this trainer was built from."""
        directory = Path(directory)
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        self.version = json.loads((directory / "trainer.json").read_text())["version"]


def _accumulate(totals: dict[str, float], metrics: dict[str, torch.Tensor], *, share: float, loss: float) -> None:
    """Combine per-micro-batch metrics: extremes by min/max, the rest weighted by token share."""
    totals["loss"] = totals.get("loss", 0.0) + loss  # already divided by the whole batch's denominator
    for name, value in metrics.items():
        value = float(value)
        if name.endswith("_max"):
            totals[name] = max(totals.get(name, value), value)
        elif name.endswith("_min"):
            totals[name] = min(totals.get(name, value), value)
        elif name == "tokens":
            totals[name] = totals.get(name, 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + share * value
