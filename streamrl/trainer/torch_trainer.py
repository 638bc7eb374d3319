"""The plain-torch backend: a Hugging Face model in this process, stepped by `streamrl.trainer.step`.

```
 micro-batch rows ─► input ids and attention mask cut to their longest row ─► model ─► logits of 0..w−2 / T
   ─► θ log-probs of tokens 1..w−1 (under autocast to `dtype`; weights and AdamW state stay float32)
```
With `loss.kl_coef > 0` a frozen copy of the initial policy (the run's starting weights, also after a
resume) gives reference log-probs for the KL penalty: one more no-grad forward pass per step, through
the same micro-batches; `trainer.reference_offload` keeps that copy in host memory between steps.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import torch

from streamrl.buffer.padded import PaddedBatch
from streamrl.config import TrainerSection
from streamrl.correction import LossConfig, token_logprobs
from streamrl.models.hf import autocast, default_device, load_policy
from streamrl.trainer.learner import ModuleBackend, Trainer
from streamrl.trainer.step import LossOf
from streamrl.weights.arrays import state_arrays


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class TorchBackend(ModuleBackend):
    def __init__(self, model_dir: str | Path, *, config: TrainerSection, temperature: float = 1.0,
                 dtype: str = "float32", attention: str = "eager", reference_dir: str | Path | None = None):
        """`reference_dir`: the weights of the frozen reference policy (None: no KL penalty, no copy)."""
        self.config, self.temperature = config, temperature
        self.model, self.tokenizer = load_policy(model_dir, train=True, dtype=dtype, attention=attention)
        self.model.to(default_device())
        self.compute_dtype = dtype  # weights and optimizer state stay float32
        if config.gradient_checkpointing:
            _enable_activation_checkpointing(self.model)
        self.reference = None
        if reference_dir is not None:
            self.reference, _ = load_policy(reference_dir, train=True, dtype=dtype, attention=attention)
            self.reference.requires_grad_(False).eval()
            self.reference.to(torch.device("cpu") if config.reference_offload else self.device)
        self._init_optimizer()

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                       model: torch.nn.Module | None = None) -> torch.Tensor:
        """[n, w − 1] log-probs of tokens 1..w−1 under `model` (θ by default; right padding: default
        positions are right). The logits are computed for positions 0..w−2 only, where the model takes
        `logits_to_keep` (Hugging Face causal LMs do): sliced from all w, they were a view whose gradient
        autograd widens into a second [n, w, V] buffer."""
        model = model or self.model
        with autocast(self.device, self.compute_dtype):
            if _takes_logits_to_keep(model):
                keep = torch.arange(input_ids.shape[1] - 1, device=input_ids.device)
                logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
            else:
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return token_logprobs(logits, input_ids[:, 1:], temperature=self.temperature)

    def _micro_batch(self, model: torch.nn.Module, batch: PaddedBatch, lengths: np.ndarray,
                     rows: np.ndarray) -> torch.Tensor:
        width = int(lengths[rows].max())
        rows_t = torch.from_numpy(rows)
        return self.token_logprobs(batch.input_ids[rows_t, :width], batch.attention_mask[rows_t, :width], model=model)

    # ---- streamrl.trainer.step.Backend -------------------------------------------------------------------
    def shard(self, rows: np.ndarray) -> np.ndarray:
        return rows  # one rank trains on every row

    @torch.no_grad()
    def logprobs(self, batch: PaddedBatch, lengths: np.ndarray, parts: list[np.ndarray], *,
                 reference: bool = False) -> list[torch.Tensor]:
        with self._policy(reference) as model:
            return [self._micro_batch(model, batch, lengths, rows) for rows in parts]

    def backward(self, batch: PaddedBatch, lengths: np.ndarray, parts: list[np.ndarray], loss_of: LossOf) -> None:
        self.model.train()
        for rows in parts:
            loss_of(rows, self._micro_batch(self.model, batch, lengths, rows)).backward()

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def gather_metrics(self, totals: dict[str, float]) -> list[dict[str, float]]:
        return [totals]

    def all_gather(self, value: np.ndarray) -> list[np.ndarray]:
        return [value]

    def flat_gradient(self) -> torch.Tensor:
        return torch.cat([p.grad.detach().flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                          for p in self.model.parameters()]).float()

    # ---- model I/O ---------------------------------------------------------------------------------------
    def hf_model(self) -> torch.nn.Module:
        return self.model

    def weights(self) -> dict[str, np.ndarray]:
        """Views of the live weights as numpy arrays, for a consumer that copies at once (`ray.put`)."""
        return state_arrays(self.model, copy=False)


class TorchTrainer(Trainer):
    """The learner over a `TorchBackend`."""

    def __init__(self, model_dir: str | Path, *, trainer: TrainerSection, loss: LossConfig, group_size: int,
                 temperature: float = 1.0, version: int = 0, seed: int = 0, lr_horizon: int | None = None,
                 dtype: str = "float32", attention: str = "eager", reference_dir: str | Path | None = None):
        """`reference_dir`: the run's initial weights, the KL penalty's reference (default: `model_dir`)."""
        torch.manual_seed(seed)
        backend = TorchBackend(model_dir, config=trainer, temperature=temperature, dtype=dtype, attention=attention,
                               reference_dir=(reference_dir or model_dir) if loss.kl_coef > 0 else None)
        super().__init__(backend, trainer=trainer, loss=loss, group_size=group_size, version=version, seed=seed,
                         lr_horizon=lr_horizon)


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward pass (the name changed in transformers 5.x)."""
    kwargs = {"use_reentrant": False}  # the non-reentrant form works with inputs that need no gradient
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
