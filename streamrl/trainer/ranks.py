"""A tensor-, data- and pipeline-parallel megatron trainer over Ray actors: rank 0 lives in the trainer
actor, ranks 1..N−1 (N = TP × DP × PP, numbered as in `streamrl.megatron.parallel`) in actors of their
own, and every call runs on all of them at once (the collectives and sends inside pair them).

```
 trainer actor (rank 0) ── train(table) ──┬─ local MegatronTrainer.train(table)
                          (ray.put once)  └─ rank r actor: .run("train", table)   (r = 1..N−1, same table)
 each rank trains on its DP rank's share of the table's groups; gradients are summed over DP
 weights / eval / checkpoint: each stage's DP rank 0 gathers over its TP group, the stages send theirs to
 rank 0, which keeps the result
```
Every rank gets the whole table and takes its share itself (`MegatronBackend.shard`): the table is
put in the object store once, is small next to the model, and the split then lives in one place, next
to the mini-batch shuffle it depends on. Rank actors are created by the trainer actor, so they die
with it (Ray's owner fate-sharing).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import ray

from streamrl import logs
from streamrl.config import RunConfig

if TYPE_CHECKING:
    from streamrl.trainer.megatron_trainer import MegatronTrainer


class MegatronRank:
    """Rank r > 0 of the trainer: the same MegatronTrainer, driven by rank 0."""

    def __init__(self, config: dict[str, Any], model_dir: str, resume_dir: str | None, rank: int, world_size: int,
                 master_addr: str, master_port: int, reference_dir: str | None = None):
        import torch

        from streamrl.models.hf import quiet_transformers
        from streamrl.trainer.megatron_trainer import MegatronTrainer

        quiet_transformers()
        logs.setup_actor_logging()
        cfg = RunConfig.model_validate(config)
        torch.set_num_threads(cfg.trainer.threads)
        self.trainer = MegatronTrainer(model_dir, trainer=cfg.trainer, loss=cfg.loss, group_size=cfg.queue.group_size,
                                       temperature=cfg.sampling.temperature, seed=cfg.run.seed, rank=rank,
                                       world_size=world_size, master_addr=master_addr, master_port=master_port,
                                       lr_horizon=cfg.optimizer_steps, reference_dir=reference_dir)
        if resume_dir is not None:
            self.trainer.load_optimizer(resume_dir)

    def ready(self) -> int:
        return os.getpid()

    def run(self, method: str, *args: Any) -> None:
        """Take part in `method` (the collectives inside pair the ranks); rank 0's result is the one used,
        so nothing is sent back."""
        getattr(self.trainer, method)(*args)


class RankGroup:
    """The learner (`streamrl.trainer.learner.Learner`) the trainer shell steps when the model is split
    over several ranks: every call runs on rank 0 here and on the others' actors."""

    def __init__(self, local: MegatronTrainer, remotes: list[ray.actor.ActorHandle]):
        self.local, self.remotes = local, remotes

    def _all(self, method: str, *args: Any, local_call=None) -> Any:
        shared = [ray.put(arg) for arg in args] if len(self.remotes) > 1 else args  # one copy for all ranks
        refs = [rank.run.remote(method, *shared) for rank in self.remotes]
        try:
            result = (local_call or getattr(self.local, method))(*args)
        except BaseException as local_error:
            # The others fail the same way (the norms are all-reduced) or finish: wait for them, but
            # report rank 0's error, not theirs.
            ray.wait(refs, num_returns=len(refs))
            raise local_error
        ray.get(refs)
        return result

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def tokenizer(self):
        return self.local.tokenizer

    def train(self, table) -> dict[str, Any]:
        return self._all("train", table)

    def weights(self):
        return self._all("weights")

    def evaluate(self, task, *, limit: int | None = None, max_new_tokens: int) -> dict[str, float]:
        # The others only join the all-gather of the weights; rank 0 generates alone.
        return self._all("hf_model", local_call=lambda: self.local.evaluate(task, limit=limit,
                                                                             max_new_tokens=max_new_tokens))

    def save(self, directory) -> None:
        self._all("save", str(directory))

    def load_optimizer(self, directory) -> None:
        self._all("load_optimizer", str(directory))

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")

    def close(self) -> None:
        self._all("close")
