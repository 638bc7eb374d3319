"""The megatron-core trainer: the torch trainer's step (mini-batches, micro-batches, the losses of
`streamrl.correction`, AdamW, rollback on a non-finite gradient) over a megatron-core `GPTModel`.

```
 HF model dir ─convert─► this rank's GPTModel shard      (streamrl.megatron.convert / .model)
 step:  θ log-probs vocabulary-parallel ─► loss ─► backward ─► gradient norm over the TP group ─► AdamW
 out:   every rank's shards ─all-gather over TP─► HF names ─► weights for the engines, checkpoints, eval
```
Weights enter and leave in Hugging Face names, so producers, checkpoints and `--resume` do not know
which trainer made them. Every rank of a tensor-parallel group runs the same calls on the same batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from streamrl.config import TrainerSection
from streamrl.correction import LossConfig
from streamrl.megatron import parallel
from streamrl.megatron.convert import hf_to_megatron, megatron_to_hf
from streamrl.megatron.model import build_model, token_logprobs
from streamrl.models.hf import default_device, load_policy
from streamrl.trainer.torch_trainer import TorchTrainer


class MegatronTrainer(TorchTrainer):
    def __init__(self, model_dir: str | Path, *, trainer: TrainerSection, loss: LossConfig, group_size: int,
                 temperature: float = 1.0, version: int = 0, seed: int = 0, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        parallel.initialize(rank=rank, world_size=world_size, tensor_parallel=trainer.tensor_parallel,
                            master_addr=master_addr, master_port=master_port, seed=seed,
                            timeout_s=trainer.collective_timeout_s)
        # The Hugging Face model stays as the mirror the weights are exported through (eval, save).
        self.mirror, self.tokenizer = load_policy(model_dir, train=False)
        self.model, self.layout = build_model(self.mirror.config)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        shard = hf_to_megatron(self.mirror.state_dict(), self.layout, rank=self.tp_rank, tp=self.tp)
        missing, unexpected = self.model.load_state_dict(shard, strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"converted weights do not fit the megatron model: missing {missing[:4]}, "
                               f"unexpected {unexpected[:4]}")
        self._setup(trainer, loss, group_size, temperature, version, seed)

    @property
    def optimizer_file(self) -> str:
        return "optimizer.pt" if self.tp == 1 else f"optimizer.tp{self.tp_rank}.pt"

    def _token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return token_logprobs(self.model, self.layout, input_ids, temperature=self.temperature)

    def _clip_gradients(self) -> torch.Tensor:
        """torch's `clip_grad_norm_` over the whole model: a sharded parameter's squares summed over the
        TP group, a replicated one counted once."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in self.model.parameters()
                   if p.grad is not None and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)]
        squares = torch.stack([g.detach().pow(2).sum() for g in counted]).sum()
        if self.tp > 1:
            dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        norm = squares.sqrt()
        scale = (self.config.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return norm

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The whole model in Hugging Face names, in host memory, on TP rank 0 (the other ranks return
        {}): a collective over the TP group, every rank calls it. Tensor by tensor, so no rank holds
        more than one gathered tensor on its device at a time."""
        local = {name: tensor.detach() for name, tensor in self.model.state_dict().items()
                 if isinstance(tensor, torch.Tensor)}
        if self.tp == 1:
            return {name: t.cpu() for name, t in megatron_to_hf([local], self.layout).items()}
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        group = parallel_state.get_tensor_model_parallel_group()
        root = parallel_state.get_tensor_model_parallel_src_rank()  # global rank of TP rank 0
        for name, tensor in local.items():
            gathered = [torch.empty_like(tensor) for _ in range(self.tp)] if self.tp_rank == 0 else None
            dist.gather(tensor.contiguous(), gathered, dst=root, group=group)
            if gathered is not None:
                for rank, part in enumerate(gathered):
                    shards[rank][name] = part.cpu()
        return megatron_to_hf(shards, self.layout) if self.tp_rank == 0 else {}

    @torch.no_grad()
    def hf_model(self):
        state = self.mirror.state_dict()
        for name, tensor in self.hf_state().items():
            state[name].copy_(tensor)
        return self.mirror

    def evaluate(self, task, *, limit: int | None = None, max_new_tokens: int) -> dict[str, float]:
        """Greedy eval on the mirror, moved onto this rank's device for the duration."""
        self.mirror.to(default_device())
        try:
            return super().evaluate(task, limit=limit, max_new_tokens=max_new_tokens)
        finally:
            self.mirror.to("cpu")

    def weights(self) -> dict[str, np.ndarray]:
        return {name: tensor.numpy() for name, tensor in self.hf_state().items()}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)  # every rank writes its optimizer state here
        model = self.hf_model()  # collective: before any rank-0-only work
        if self.tp_rank == 0:
            model.save_pretrained(directory / "model")
            self.tokenizer.save_pretrained(directory / "model")
            (directory / "trainer.json").write_text(json.dumps({"version": self.version}))
        torch.save(self.optimizer.state_dict(), directory / self.optimizer_file)

    def close(self) -> None:
        parallel.shutdown()
