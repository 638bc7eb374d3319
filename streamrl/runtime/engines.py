"""The one factory that builds a producer's engine and task from the run config (`producers.engine`).

```
 torch   the policy loaded in this process, continuous batching (TorchEngine), weights by WeightReceiver
 sim     the calibrated timing model (SimEngine), real weights of `sim.weights_mb` by WeightReceiver
 sglang  the producer's own sglang servers (see `streamrl.engine.sglang`)
```
Weights reach every engine from the run's weights actor (`remote_fetch`); this is the only place that
knows which engine a producer runs.
"""

from __future__ import annotations

import copy
from typing import Any

import ray

from streamrl.config import RunConfig
from streamrl.engine.base import Engine
from streamrl.engine.local_weights import LocalWeights
from streamrl.tasks import Task
from streamrl.weights.receiver import WeightReceiver

OFFER_GRACE_S = 0.5  # a version the trainer's offer has not brought after this long is fetched by the long poll


def remote_fetch(weights: ray.actor.ActorHandle, holder: int, *, by_reference: bool = False,
                 grace_s: float = 0.0):
    """Newer weights from the weights actor, held by `holder`: their arrays (read-only views of the
    object store), or with `by_reference` `[object reference]` (`streamrl.weights.arrays.resolve`).
    `grace_s`: the holder is offered versions directly; the long poll fetches only those an offer missed."""
    def fetch(have: int | None, timeout: float) -> tuple[int, Any] | None:
        got = ray.get(weights.acquire.remote(holder, have, timeout, grace_s))
        if got is None:
            return None
        version, refs = got
        return version, refs if by_reference else ray.get(refs[0])
    return fetch


def update_group_prefix(run_name: str, producer_id: int) -> str:
    """The names of producer `producer_id`'s update groups start with this (a replacement's too)."""
    return f"streamrl-{run_name}-p{producer_id}-"


class RemoteSender:
    """The trainer actor as rank 0 of the sglang update groups (`streamrl.weights.broadcast.Sender`):
    the weights go from the trainer's GPU straight to the servers."""

    def __init__(self, trainer: ray.actor.ActorHandle):
        self.trainer = trainer

    def open_group(self, name: str, world: int, *, server: tuple[str, int], node: str | None,
                   timeout_s: float) -> tuple[str, int, str]:
        return tuple(ray.get(self.trainer.open_update_group.remote(name, world, server, node, timeout_s)))

    def joined(self, name: str, timeout_s: float) -> None:
        ray.get(self.trainer.join_update_group.remote(name, timeout_s))

    def manifest(self, weights: Any) -> dict[str, Any]:
        return ray.get(self.trainer.weights_manifest.remote(weights))  # the trainer reads its own put

    def broadcast(self, name: str, weights: Any, names: list[str], timeout_s: float) -> None:
        ray.get(self.trainer.broadcast_weights.remote(name, weights, names, timeout_s))  # weights: [ref]

    def close_group(self, name: str) -> None:
        ray.get(self.trainer.close_update_group.remote(name), timeout=60)


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

        sender = RemoteSender(ray.get_actor(f"{run_name}/trainer", namespace=NAMESPACE)) \
            if cfg.producers.sglang.weights == "distributed" else None
        return sglang_engine(cfg, producer_id=producer_id, model_dir=model_dir, seed=seed,
                             fetch=remote_fetch(weights, producer_id, by_reference=True), search_path=search_path,
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
    import torch

    from streamrl.engine.sim import SimEngine, weights_module
    from streamrl.tasks.sim import SimTask

    torch.set_num_threads(1)
    work = cfg.sim_workload()
    model = weights_module(work)
    return SimEngine(work, LocalWeights(model, _receiver(cfg, producer_id, weights, model)), seed=seed), SimTask(work)
