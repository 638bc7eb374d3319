"""The megatron-core backend: the step of `streamrl.trainer.step` (mini-batches, micro-batches, the
losses of `streamrl.correction`, AdamW, rollback on a non-finite gradient) over a megatron-core
`GPTModel`, this rank's shard of it.

```
 HF model dir ─convert─► this rank's GPTModel shard: its TP slice of its stage's layers  (.convert / .model)
 step:  this DP rank's groups of the mini-batch ─► micro-batches through the stages (1F1B, .pipeline)
        ─► θ log-probs vocabulary-parallel on the last stage ─► loss / mini-batch tokens (all DP ranks')
        ─► backward ─► gradients summed over DP (and a tied embedding's two copies) ─► norm over TP and
        PP ─► AdamW
 out:   DP rank 0's shards ─gather over each stage's TP group─► HF names ─► stages sent to rank 0
        ─► weights for the engines, checkpoints, eval
```
Weights enter and leave in Hugging Face names, so producers, checkpoints and `--resume` do not know
which trainer made them. Every rank runs the same calls on the same batch; the ranks of a
tensor-parallel group compute on the same rows, each data-parallel rank on its own share of whole
groups, each pipeline stage on its layers of the same micro-batches. The DP ranks start from the same
weights and apply the same summed gradient, so they hold identical weights and optimizer state:
exports and checkpoints come from DP rank 0 alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from streamrl.config import TrainerSection
from streamrl.correction import LossConfig
from streamrl.megatron import parallel
from streamrl.megatron.convert import Stage, hf_names, hf_to_megatron, megatron_to_hf
from streamrl.megatron.model import attention_inputs, build_model, logits_logprobs, release_scratch, token_logprobs
from streamrl.megatron.pipeline import PipelineGroup, Schedule, sum_tied_embedding_grads
from streamrl.models.hf import default_device, load_policy
from streamrl.trainer.learner import ModuleBackend, Trainer
from streamrl.trainer.step import LossOf

_BUCKET_ELEMENTS = 1 << 25  # 32 Mi gradient elements (128 MiB in float32) per data-parallel all-reduce


class MegatronBackend(ModuleBackend):
    def __init__(self, model_dir: str | Path, *, config: TrainerSection, group_size: int, temperature: float = 1.0,
                 seed: int = 0, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, reference_dir: str | Path | None = None):
        """Joins the run's TP × DP × PP process groups as `rank` of `world_size`; `reference_dir`: the
        frozen reference policy's weights (None: no KL penalty, no copy)."""
        parallel.initialize(rank=rank, world_size=world_size, tensor_parallel=config.tensor_parallel,
                            data_parallel=config.data_parallel, pipeline_parallel=config.pipeline_parallel,
                            master_addr=master_addr, master_port=master_port,
                            seed=seed, timeout_s=config.collective_timeout_s)
        self.config, self.group_size, self.temperature = config, group_size, temperature
        # The Hugging Face model stays as the mirror the weights are exported through (eval, save).
        self.mirror, self.tokenizer = load_policy(model_dir, train=False)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp = parallel_state.get_data_parallel_world_size()
        self.pipeline = PipelineGroup.current()
        self.model = self._stage_model(self.mirror.state_dict())
        self.reference = None
        if reference_dir is not None:
            reference, _ = load_policy(reference_dir)
            self.reference = self._stage_model(reference.state_dict()).requires_grad_(False).eval()
            self.reference.to(torch.device("cpu") if config.reference_offload else self.device)
        # DP ranks hold identical weights and optimizer state: DP rank 0 writes them (its TP and PP ranks
        # each their optimizer shard), global rank 0 the Hugging Face weights and trainer.json
        self.writes_optimizer = self.dp_rank == 0
        self.writes_model = self.dp_rank == 0 and self.tp_rank == 0 and self.pipeline.first
        self._init_optimizer()

    def _stage_model(self, hf_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """This rank's part of the model (its tensor-parallel shard of its pipeline stage) with `hf_state`."""
        model, self.layout, self.stage = build_model(self.mirror.config)
        shard = hf_to_megatron(hf_state, self.layout, rank=self.tp_rank, tp=self.tp, stage=self.stage)
        missing, unexpected = model.load_state_dict(shard, strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"converted weights do not fit the megatron model: missing {missing[:4]}, "
                               f"unexpected {unexpected[:4]}")
        return model

    @property
    def optimizer_file(self) -> str:
        """This rank's optimizer state: one file per tensor-parallel rank and pipeline stage."""
        parts = ([f"tp{self.tp_rank}"] if self.tp > 1 else []) + ([f"pp{self.pipeline.rank}"]
                                                                 if self.pipeline.size > 1 else [])
        return ".".join(["optimizer", *parts, "pt"])

    # ---- micro-batches: one after another on a single stage, through the stages in 1F1B order otherwise --
    def _micro_batch(self, model: torch.nn.Module, batch, lengths: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """θ log-probs of `rows` on a single stage (the whole model)."""
        input_ids = batch.input_ids[torch.from_numpy(rows), :int(lengths[rows].max())]
        return token_logprobs(model, self.layout, input_ids, temperature=self.temperature)

    def _schedule(self, lengths: np.ndarray, parts: list[np.ndarray]) -> Schedule:
        shapes = [(int(lengths[rows].max()), len(rows), self.layout.hidden) for rows in parts]
        return Schedule(self.pipeline, shapes, device=self.device, dtype=torch.float32)

    def _stage_forward(self, model: torch.nn.Module, batch, lengths: np.ndarray, rows: np.ndarray,
                       received: torch.Tensor | None) -> torch.Tensor:
        """This stage's output for `rows`: hidden states for the next stage, or (last stage) θ log-probs."""
        input_ids = batch.input_ids[torch.from_numpy(rows), :int(lengths[rows].max())]
        model.set_input_tensor(received)  # the previous stage's activations (None on the first)
        output = model(input_ids, *attention_inputs(input_ids))
        if not self.stage.post:
            return output
        return logits_logprobs(output, self.layout, input_ids, temperature=self.temperature)

    # ---- streamrl.trainer.step.Backend -------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch, lengths: np.ndarray, parts: list[np.ndarray], *,
                 reference: bool = False) -> list[torch.Tensor]:
        with self._policy(reference) as model:
            if self.pipeline.size == 1:
                return [self._micro_batch(model, batch, lengths, rows) for rows in parts]
            return self._schedule(lengths, parts).forward_only(
                lambda i, received: self._stage_forward(model, batch, lengths, parts[i], received))

    def backward(self, batch, lengths: np.ndarray, parts: list[np.ndarray], loss_of: LossOf) -> None:
        self.model.train()
        if self.pipeline.size == 1:
            for rows in parts:
                loss_of(rows, self._micro_batch(self.model, batch, lengths, rows)).backward()
            return

        def forward(i: int, received: torch.Tensor | None) -> torch.Tensor:
            output = self._stage_forward(self.model, batch, lengths, parts[i], received)
            return loss_of(parts[i], output) if self.stage.post else output

        self._schedule(lengths, parts).forward_backward(forward)

    def shard(self, rows: np.ndarray) -> np.ndarray:
        """Groups d, d + DP, d + 2·DP, ... of the mini-batch for DP rank d: whole groups (a mini-batch's
        rows are whole groups back to back), the same split on every rank since every rank draws the
        same shuffle from the same seed."""
        if self.dp == 1:
            return rows
        return rows.reshape(-1, self.group_size)[self.dp_rank::self.dp].ravel()

    def gather_metrics(self, totals: dict[str, float]) -> list[dict[str, float]]:
        """The loss and its metrics are computed on the last pipeline stage: sent to the other stages
        first, then gathered over the DP group (`step.merge_ranks` sums them: each rank's are already
        weighted by its share of the step's tokens). Sent as objects: a dozen floats, once per step."""
        if self.pipeline.size > 1:
            carried = [totals]
            dist.broadcast_object_list(carried, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
            totals = carried[0]
        return self.all_gather(totals)

    def flat_gradient(self):
        raise NotImplementedError("trainer.diagnose_every: the megatron backend's gradient is sharded over ranks")

    def all_gather(self, value):
        """Over this stage's data-parallel group (the TP ranks of a group hold the same value)."""
        if self.dp == 1:
            return [value]
        gathered = [None] * self.dp
        dist.all_gather_object(gathered, value, group=parallel_state.get_data_parallel_group())
        return gathered

    def _reduce_gradients(self) -> None:
        """Sum the gradients over the DP group (each rank's loss is divided by the whole mini-batch's
        tokens, so the sum is the one-rank gradient), flattened into buckets of at most
        `_BUCKET_ELEMENTS`: a few large collectives instead of one per parameter, and at most one
        bucket's extra memory. A parameter this rank's rows did not reach gets a zero gradient."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        group = parallel_state.get_data_parallel_group()
        bucket: list[torch.Tensor] = []
        size = 0
        for i, p in enumerate(params):
            bucket.append(p.grad)
            size += p.grad.numel()
            if size >= _BUCKET_ELEMENTS or i == len(params) - 1:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=group)
                for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                    grad.copy_(part.view_as(grad))
                bucket, size = [], 0

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """torch's `clip_grad_norm_` over the whole model, after the gradients are summed over the DP
        group (and a tied embedding's two copies over the pipeline's ends): a sharded parameter's
        squares summed over the TP group, each stage's over the pipeline, a replicated one and the
        tied copy counted once. Every rank sees the same norm, so all take the step or all roll back;
        the non-finite flag is all-reduced over every rank all the same, so that no rank can step alone."""
        sum_tied_embedding_grads(self.model, tied=self.layout.tied)
        if self.dp > 1:
            self._reduce_gradients()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in self.model.parameters()
                   if p.grad is not None and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
                   and not getattr(p, "shared", False)]
        squares = torch.stack([g.detach().pow(2).sum() for g in counted]).sum()
        if self.tp > 1:
            dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        if self.pipeline.size > 1:
            dist.all_reduce(squares, group=parallel_state.get_pipeline_model_parallel_group())
        norm = squares.sqrt()
        if self.tp * self.dp * self.pipeline.size > 1:
            bad = (~torch.isfinite(norm)).to(norm.dtype)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                return torch.full_like(norm, float("nan"))
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return norm

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The whole model in Hugging Face names, in host memory, on global rank 0 (the other ranks
        return {}): every rank calls it. DP rank 0 of each stage gathers its TP group's shards; the
        other DP ranks hold the same weights and return at once; later stages send theirs to rank 0.
        Tensor by tensor, so no rank holds more than one gathered tensor on its device at a time."""
        if self.dp_rank != 0:
            return {}
        state = self._stage_hf_state()
        if self.pipeline.size == 1 or self.tp_rank != 0:
            return state
        return self._collect_stages(state)

    def _stage_hf_state(self) -> dict[str, torch.Tensor]:
        """This stage's tensors in HF names on its TP rank 0 (the other TP ranks return {})."""
        local = {name: tensor.detach() for name, tensor in self.model.state_dict().items()
                 if isinstance(tensor, torch.Tensor)}
        if self.tp == 1:
            return {name: t.cpu() for name, t in megatron_to_hf([local], self.layout, self.stage).items()}
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        group = parallel_state.get_tensor_model_parallel_group()
        root = parallel_state.get_tensor_model_parallel_src_rank()  # global rank of TP rank 0
        for name, tensor in local.items():
            gathered = [torch.empty_like(tensor) for _ in range(self.tp)] if self.tp_rank == 0 else None
            dist.gather(tensor.contiguous(), gathered, dst=root, group=group)
            if gathered is not None:
                for rank, part in enumerate(gathered):
                    shards[rank][name] = part.cpu()
        return megatron_to_hf(shards, self.layout, self.stage) if self.tp_rank == 0 else {}

    def _collect_stages(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage s > 0's TP-and-DP rank 0 sends its tensors to global rank 0, one at a time in
        `hf_names` order; rank 0 knows their shapes from its Hugging Face mirror."""
        pipeline_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        if not self.pipeline.first:
            for name in hf_names(self.layout, self.stage):
                dist.send(state[name].to(self.device), dst=pipeline_ranks[0])
            return {}
        mirror = self.mirror.state_dict()
        for stage_rank in range(1, self.pipeline.size):
            for name in hf_names(self.layout, Stage.of(self.layout, stage_rank, self.pipeline.size)):
                received = torch.empty(mirror[name].shape, dtype=torch.float32, device=self.device)
                dist.recv(received, src=pipeline_ranks[stage_rank])
                state[name] = received.cpu()
        return state

    @torch.no_grad()
    def hf_model(self) -> torch.nn.Module:
        state = self.mirror.state_dict()
        for name, tensor in self.hf_state().items():
            state[name].copy_(tensor)
        return self.mirror

    @contextlib.contextmanager
    def evaluation_model(self) -> Iterator[torch.nn.Module]:
        """The mirror with the current weights, on this rank's device for the duration."""
        self.mirror.to(default_device())
        try:
            yield self.hf_model()
        finally:
            self.mirror.to("cpu")

    def weights(self) -> dict[str, np.ndarray]:
        return {name: tensor.numpy() for name, tensor in self.hf_state().items()}

    def offload(self) -> None:
        super().offload()  # parameters, buffers, optimizer state and the reference copy
        release_scratch(*(model for model in (self.model, self.reference) if model is not None))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        parallel.shutdown()


class MegatronTrainer(Trainer):
    """The learner over a `MegatronBackend` (rank `rank` of TP × DP × PP = `world_size`)."""

    def __init__(self, model_dir: str | Path, *, trainer: TrainerSection, loss: LossConfig, group_size: int,
                 temperature: float = 1.0, version: int = 0, seed: int = 0, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None, lr_horizon: int | None = None,
                 reference_dir: str | Path | None = None):
        """`reference_dir`: the run's initial weights, the KL penalty's reference (default: `model_dir`)."""
        backend = MegatronBackend(model_dir, config=trainer, group_size=group_size, temperature=temperature, seed=seed,
                                  rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                                  reference_dir=(reference_dir or model_dir) if loss.kl_coef > 0 else None)
        super().__init__(backend, trainer=trainer, loss=loss, group_size=group_size, version=version, seed=seed,
                         lr_horizon=lr_horizon)
