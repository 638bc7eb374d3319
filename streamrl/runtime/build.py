"""The one factory module: what each actor runs, from the run config.

```
 make_engine   producers.engine   torch   the policy in the producer's process, continuous batching (TorchEngine)
                                  sim     the calibrated timing model (SimEngine), real weights of `sim.weights_mb`
                                  sglang  the producer's own sglang servers (`runtime.sglang_build`)
 make_learner  trainer.backend    torch   TorchTrainer in the trainer actor's process
                                  sim     SimLearner (the timing model's trainer)
                                  megatron  MegatronTrainer; TP × DP × PP > 1: a RankGroup, this process rank 0
                                            and the other ranks actors it owns
```
Weights reach every engine from the run's weights actor (`remote_fetch`): torch and sim through a
`WeightReceiver`, sglang through the weight path `producers.sglang.weights` names. This is the only
place that knows which engine a producer runs or which learner the trainer steps.
"""

from __future__ import annotations

import copy
from typing import Any

import ray

from streamrl.config import RunConfig
from streamrl.engine.base import Engine
from streamrl.engine.local_weights import LocalWeights
from streamrl.runtime.clients import (
    OFFER_GRACE_S,
    RemoteSender,
    actor_name,
    create_actor,
    remote_fetch,
    update_group_prefix,
)
from streamrl.tasks import Task
from streamrl.weights.receiver import WeightReceiver


def make_engine(cfg: RunConfig, *, run_name: str, producer_id: int, model_dir: str, seed: int,
                weights: ray.actor.ActorHandle, search_path: str | None = None,
                work_dir: str | None = None) -> tuple[Engine, Task]:
    """The engine `cfg.producers.engine` names, following the trainer's weights, and the task it serves.
    `work_dir`: sglang's server logs and "disk" weights."""
    kind = cfg.producers.engine
    if kind == "torch":
        return _torch_engine(cfg, producer_id, model_dir, seed, weights, search_path)
    if kind == "sim":
        return _sim_engine(cfg, producer_id, seed, weights)
    if kind == "sglang":
        from streamrl.buffer.actor import NAMESPACE
        from streamrl.runtime.sglang_build import sglang_engine

        sender = RemoteSender(ray.get_actor(actor_name(run_name, "trainer"), namespace=NAMESPACE)) \
            if cfg.producers.sglang.weights == "distributed" else None
        return sglang_engine(cfg, producer_id=producer_id, model_dir=model_dir, seed=seed,
                             fetch=remote_fetch(weights, producer_id), search_path=search_path,
                             work_dir=work_dir, sender=sender, group_prefix=update_group_prefix(run_name, producer_id),
                             node=ray.util.get_node_ip_address())
    raise ValueError(f"unknown engine {kind!r}")


def _receiver(cfg: RunConfig, producer_id: int, weights: ray.actor.ActorHandle, model: Any) -> WeightReceiver:
    standby = copy.deepcopy(model) if cfg.producers.double_buffer else None
    return WeightReceiver(remote_fetch(weights, producer_id, grace_s=OFFER_GRACE_S), poll_s=cfg.producers.weight_poll_s,
                          standby=standby)


def _torch_engine(cfg: RunConfig, producer_id: int, model_dir: str, seed: int, weights: ray.actor.ActorHandle,
                  search_path: str | None) -> tuple[Engine, Task]:
    import torch

    from streamrl.engine.torch_engine import TorchEngine
    from streamrl.models.hf import default_device, load_policy
    from streamrl.tasks import make_task

    torch.set_num_threads(cfg.producers.threads)
    model, tokenizer = load_policy(model_dir, dtype=cfg.model.dtype, attention=cfg.model.attention)
    model.to(default_device())
    task = make_task(cfg.task, tokenizer, seed=cfg.run.seed, search_path=search_path)
    engine = TorchEngine(LocalWeights(model, _receiver(cfg, producer_id, weights, model)),
                         pad_id=tokenizer.pad_token_id or 0, stop_ids=task.stop_token_ids,
                         max_new_tokens=cfg.sampling.max_new_tokens or task.max_new_tokens(),
                         capacity=cfg.producers.groups_per_batch * cfg.queue.group_size,
                         temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, seed=seed)
    return engine, task


def _sim_engine(cfg: RunConfig, producer_id: int, seed: int, weights: ray.actor.ActorHandle) -> tuple[Engine, Task]:
    from streamrl.engine.sim import SimEngine, sim_weights
    from streamrl.tasks.sim import SimTask

    work = cfg.sim_workload()
    model = sim_weights(work)
    return SimEngine(work, LocalWeights(model, _receiver(cfg, producer_id, weights, model)), seed=seed), SimTask(work)


def make_learner(run_name: str, cfg: RunConfig, config: dict[str, Any], model_dir: str, resume_dir: str | None,
                  rank_group: Any = None, *, reference_dir: str):
    """The torch trainer, the megatron trainer, or a megatron rank group (tensor parallel × data
    parallel > 1): this process is rank 0, the other ranks are actors it owns, each in its bundle of
    `rank_group` (the placement group that keeps them on this node) with the resources the trainer
    reserves each."""
    common = dict(trainer=cfg.trainer, loss=cfg.loss, group_size=cfg.queue.group_size,
                  temperature=cfg.sampling.temperature, seed=cfg.run.seed, lr_horizon=cfg.optimizer_steps,
                  reference_dir=reference_dir)
    if cfg.trainer.backend == "torch":
        from streamrl.trainer.torch_trainer import TorchTrainer

        return TorchTrainer(model_dir, dtype=cfg.model.dtype, attention=cfg.model.attention, **common)
    if cfg.trainer.backend == "sim":
        from streamrl.trainer.sim import SimLearner

        return SimLearner(cfg.sim_workload())
    from streamrl.net import free_port
    from streamrl.trainer.megatron_trainer import MegatronTrainer
    from streamrl.trainer.ranks import MegatronRank, RankGroup

    world = cfg.trainer.ranks
    if world == 1:
        return MegatronTrainer(model_dir, **common)
    address, port = ray.util.get_node_ip_address(), free_port()
    remotes = [create_actor(MegatronRank, run_name, f"trainer-rank{rank}", config, model_dir, resume_dir, rank,
                            world, address, port, reference_dir, num_cpus=cfg.trainer.num_cpus,
                            num_gpus=cfg.trainer.num_gpus,
                            placement=(rank_group, rank))
               for rank in range(1, world)]  # they wait in init_process_group until rank 0 joins
    local = MegatronTrainer(model_dir, rank=0, world_size=world, master_addr=address, master_port=port, **common)
    ray.get([rank.ready.remote() for rank in remotes])
    return RankGroup(local, remotes)
