"""What the trainer actor steps (`Learner`), and the one learner over a model backend (`Trainer`).

```
 Learner      the protocol the trainer shell drives: Trainer, RankGroup (several megatron ranks), SimLearner
 Trainer      the step plan (`step.run_step`) + version + checkpoints + eval, over a ModuleBackend:
 ModuleBackend  one torch module under AdamW (float32 master weights), a frozen reference copy for a KL
                penalty; its model-specific half is the backend's own
                  TorchBackend     a Hugging Face model in this process           (torch_trainer)
                  MegatronBackend  this rank's megatron-core shard, TP × DP × PP   (megatron_trainer)
```
A checkpoint is the same whichever backend wrote it: `model/` (Hugging Face weights and tokenizer),
the optimizer state (`backend.optimizer_file`: one file per tensor-parallel rank and pipeline stage),
`trainer.json` (version, the schedule's position, the mini-batch shuffle's generator).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

from streamrl.buffer.padded import to_padded
from streamrl.buffer.schema import build_batch, list_offsets, list_values
from streamrl.config import TrainerSection
from streamrl.correction import LossConfig
from streamrl.engine.base import generate
from streamrl.engine.local_weights import LocalWeights
from streamrl.engine.torch_engine import TorchEngine
from streamrl.tasks import Task, group_rewards
from streamrl.trainer.step import StepPlan, run_step


class Learner(Protocol):
    """What the trainer shell steps and checkpoints. Every member runs on every rank of a multi-rank
    learner (the collectives inside pair them); the results are rank 0's."""

    version: int  # the number of steps taken: the version of the weights `weights()` returns
    tokenizer: Any  # the model's (None for the simulator, which has no model)

    def train(self, table: pa.Table) -> dict[str, Any]:
        """One step on `table`, version + 1; its metrics, `trained_tokens` among them."""

    def weights(self) -> dict[str, np.ndarray]:
        """The current weights in Hugging Face names, for a consumer that copies at once (`ray.put`)."""

    def evaluate(self, task: Task, *, limit: int | None = None, max_new_tokens: int) -> dict[str, float]:
        """Greedy answers to the task's held-out prompts."""

    def save(self, directory: str | Path) -> None: ...

    def load_optimizer(self, directory: str | Path) -> None:
        """Restore what `save` wrote beside the weights the learner was built from."""

    def offload(self) -> None:
        """Weights and optimizer state to host memory (colocated with sglang servers)."""

    def onload(self) -> None: ...

    def close(self) -> None: ...


class ModuleBackend:
    """The half of a backend that any torch module under AdamW shares: the optimizer step, the
    rollback point, moving to and from host memory, the reference policy's device. A subclass sets
    `model`, `tokenizer`, `temperature`, `config`, `reference` (or None), calls `_init_optimizer`, and
    implements the rest of `streamrl.trainer.step.Backend` and the model I/O below."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    tokenizer: Any
    temperature: float
    config: TrainerSection
    optimizer_file = "optimizer.pt"
    writes_model = True  # this rank writes `model/` and trainer.json
    writes_optimizer = True  # this rank writes its optimizer state

    def _init_optimizer(self) -> None:
        c = self.config
        # Weight decay is applied in `optimizer_step`, to matrices only, as Megatron does: biases and norm
        # scales are not decayed. One parameter group keeps the optimizer state's layout whatever the decay.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=c.betas, weight_decay=0.0)
        self._decayed = [p for p in self.model.parameters() if p.ndim >= 2]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @contextlib.contextmanager
    def _policy(self, reference: bool) -> Iterator[torch.nn.Module]:
        """The model a no-grad pass runs: θ, or the reference policy (on the trainer's device meanwhile)."""
        if not reference:
            yield self.model
            return
        if self.reference is None:
            raise ValueError("no reference policy: the loss has no KL penalty (loss.kl_coef = 0)")
        self.reference.to(self.device)
        try:
            yield self.reference
        finally:
            if self.config.reference_offload:
                self.reference.to("cpu")

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.config.weight_decay:
            with torch.no_grad():  # AdamW's decoupled decay, before its update as in torch's
                for param in self._decayed:
                    if param.grad is not None:  # as AdamW, which skips a parameter without one
                        param.mul_(1.0 - lr * self.config.weight_decay)
        self.optimizer.step()

    def snapshot(self) -> tuple[dict, dict]:
        return _host_copy(self.model.state_dict()), _host_copy(self.optimizer.state_dict())  # host, not the GPU

    def restore(self, saved: tuple[dict, dict]) -> None:
        self.model.load_state_dict(saved[0])
        self.optimizer.load_state_dict(saved[1])

    def offload(self) -> None:
        """Weights, optimizer state and the reference copy to host memory (a no-op on a CPU-only process)."""
        self._move(torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        from streamrl.models.hf import default_device

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

    def close(self) -> None:
        """Leave whatever process groups the backend joined (none here)."""

    # ---- model I/O: the backend's own ---------------------------------------------------------------------
    def hf_model(self) -> torch.nn.Module:
        """The policy as a Hugging Face model with the current weights (a collective on several ranks)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def evaluation_model(self) -> Iterator[torch.nn.Module]:
        """The Hugging Face model on this rank's device, for greedy evaluation."""
        yield self.hf_model()

    def weights(self) -> dict[str, np.ndarray]:
        raise NotImplementedError


class Trainer:
    """The learner: `step.run_step` over a backend, the version (B groups per version, however many
    optimizer steps they make), the schedule's position and the mini-batch shuffle, checkpoints."""

    def __init__(self, backend: ModuleBackend, *, trainer: TrainerSection, loss: LossConfig, group_size: int,
                 version: int = 0, seed: int = 0, lr_horizon: int | None = None):
        self.backend, self.config, self.group_size = backend, trainer, group_size
        self.plan = StepPlan.of(trainer, loss, group_size, lr_horizon)
        self.version = version
        self.optimizer_steps = 0  # taken so far: the schedule's position, saved with the checkpoint
        self._rng = np.random.default_rng(seed)  # the mini-batch shuffle
        self._fresh: dict[str, Any] | None = None  # trainer.diagnose_every: how to sample a step's prompts again

    def diagnose_with(self, task: Task, *, max_new_tokens: int, temperature: float, top_p: float) -> None:
        """On diagnosed steps (`trainer.diagnose_every`), sample the step's prompts again with the current
        weights and score them by `task`: the fresh data the step's own is compared with."""
        self._fresh = {"task": task, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def train(self, table: pa.Table | pa.RecordBatch) -> dict[str, float]:
        """`minibatches` optimizer steps on a batch of complete groups (rows of a group adjacent), then
        version + 1. A non-finite gradient in any mini-batch rolls the whole step back and raises."""
        start = time.perf_counter()
        batch = to_padded(table, self.backend.pad_id).to(self.backend.device)
        every = self.plan.diagnose_every
        fresh = None
        if self._fresh is not None and every and self.version % every == 0:
            fresh = to_padded(self.sample_again(table), self.backend.pad_id).to(self.backend.device)
        metrics = run_step(self.backend, self.plan, batch, version=self.version, optimizer_steps=self.optimizer_steps,
                           rng=self._rng, fresh=fresh)
        self.optimizer_steps += metrics["optimizer_steps"]
        self.version += 1
        metrics["train_s"] = time.perf_counter() - start
        return metrics

    @torch.no_grad()
    def sample_again(self, table: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
        """The prompts of `table`'s groups (rows of a group adjacent), G samples each from the current
        weights, scored by the task given to `diagnose_with`: a batch of the same shape, never trained on."""
        fresh, g = self._fresh, self.group_size
        prompt_offsets = list_offsets(table.column("prompt_ids"))[::g]
        tokens = list_values(table.column("prompt_ids"))
        prompts = [tokens[a:b].tolist() for a, b in zip(prompt_offsets, list_offsets(table.column("prompt_ids"))[1::g])]
        prompt_ids = table.column("prompt_id").to_numpy()[::g]
        with self.backend.evaluation_model() as model:
            model.eval()
            engine = TorchEngine(LocalWeights(model, version=self.version), pad_id=self.backend.pad_id,
                                 stop_ids=fresh["task"].stop_token_ids, max_new_tokens=fresh["max_new_tokens"],
                                 capacity=len(prompts) * g, temperature=fresh["temperature"], top_p=fresh["top_p"],
                                 seed=self.version)
            generation = generate(engine, prompts, samples_per_prompt=g)
        rewards = np.concatenate([group_rewards(fresh["task"], int(pid), [generation.response(i * g + j)
                                                                          for j in range(g)])
                                  for i, pid in enumerate(prompt_ids)]).astype(np.float32)
        rows = len(prompts) * g
        prompt_lengths = np.repeat([len(p) for p in prompts], g)
        return build_batch(
            group_id=table.column("group_id").to_numpy(), prompt_id=np.repeat(prompt_ids, g),
            sample_index=np.tile(np.arange(g), len(prompts)), producer_id=-1,
            prompt_tokens=np.concatenate([np.asarray(p, np.int32) for p in prompts for _ in range(g)]),
            prompt_offsets=np.r_[0, np.cumsum(prompt_lengths)], response_tokens=generation.tokens,
            response_offsets=generation.offsets, behavior_logprobs=generation.logprobs, versions=generation.versions,
            reward=rewards, finish_reason=generation.finish[:rows])

    def weights(self) -> dict[str, np.ndarray]:
        return self.backend.weights()

    def hf_model(self) -> torch.nn.Module:
        return self.backend.hf_model()

    @torch.no_grad()
    def evaluate(self, task: Task, *, limit: int | None = None, max_new_tokens: int) -> dict[str, float]:
        """Greedy answers to the held-out prompts: mean reward and exact-match accuracy (reward 1)."""
        with self.backend.evaluation_model() as model:  # first: a collective on several ranks, every rank alike
            prompts = task.eval_prompts(limit)
            if not prompts:
                return {}
            model.eval()
            engine = TorchEngine(LocalWeights(model, version=self.version), pad_id=self.backend.pad_id,
                                 stop_ids=task.stop_token_ids, max_new_tokens=max_new_tokens, capacity=len(prompts),
                                 greedy=True)
            generation = generate(engine, prompts)
        rewards = np.array([task.eval_reward(i, generation.response(i)) for i in range(len(prompts))])
        return {"eval_reward": float(rewards.mean()), "eval_accuracy": float((rewards >= 1.0).mean()),
                "eval_prompts": len(prompts)}

    # ---- checkpoints ------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)  # several ranks may write their optimizer state here
        model = self.backend.hf_model()  # a collective on several ranks: before any one-rank work
        if self.backend.writes_model:
            model.save_pretrained(directory / "model")
            self.tokenizer.save_pretrained(directory / "model")
            (directory / "trainer.json").write_text(json.dumps(self.progress()))
        if self.backend.writes_optimizer:
            torch.save(self.backend.optimizer.state_dict(), directory / self.backend.optimizer_file)

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
        optimizer = self.backend.optimizer
        optimizer.load_state_dict(torch.load(directory / self.backend.optimizer_file, weights_only=True))
        # The settings configured now, not those saved: a resume may change them (lr is set every step;
        # the decay is the backend's, applied in its optimizer step, and zero in a checkpoint written since)
        for group in optimizer.param_groups:
            group["betas"], group["weight_decay"] = tuple(self.config.betas), 0.0
        saved = json.loads((directory / "trainer.json").read_text())
        self.version = saved["version"]
        # checkpoints written before schedules: every step took `minibatches` optimizer steps
        self.optimizer_steps = saved.get("optimizer_steps", self.version * self.config.minibatches)
        if "shuffle" in saved:
            self._rng.bit_generator.state = saved["shuffle"]

    def offload(self) -> None:
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    def close(self) -> None:
        self.backend.close()


def _host_copy(state):
    """A deep copy with every tensor in host memory (a step's rollback point)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return type(state)((k, _host_copy(v)) for k, v in state.items())
    if isinstance(state, list | tuple):
        return type(state)(_host_copy(v) for v in state)
    return copy.deepcopy(state)
