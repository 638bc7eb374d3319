"""Ray clients: the run's actors by name, and the objects through which one actor calls another.

```
 actor_name / create_actor   every actor of a run is RUN/ROLE in namespace `streamrl` (the CLI and a
                             restarted driver find them by name)
 RemoteQueue                 a producer's queue (`streamrl.rollout.QueueClient`) over the queue actor
 remote_fetch                a producer's long poll on the weights actor (`streamrl.weights.receiver.Fetch`)
 RemoteHold                  a producer telling the weights actor it took a version the trainer offered
 RemoteSender                the trainer actor as rank 0 of the sglang update groups
```
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import ray

from streamrl import failpoints, logs
from streamrl.buffer.actor import NAMESPACE, Outbox
from streamrl.buffer.queue import Admission


def actor_name(run_name: str, role: str) -> str:
    return f"{run_name}/{role}"


def create_actor(cls: type, run_name: str, role: str, *args, num_cpus: float = 0, num_gpus: float = 0,
                 max_concurrency: int = 1, placement: tuple[Any, int] | None = None,
                 **kwargs) -> ray.actor.ActorHandle:
    """A named actor of the run (fails if one with that name is alive: another run has the name);
    `placement`: (placement group, bundle index) to run it in, or None."""
    remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=max_concurrency)(cls)
    options: dict[str, Any] = {"name": actor_name(run_name, role), "namespace": NAMESPACE,
                               "lifetime": "non_detached"}
    env = {**failpoints.actor_env(), **logs.actor_env(role)}
    if env:
        options["runtime_env"] = {"env_vars": env}
    if placement is not None and placement[0] is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement[0], placement_group_bundle_index=placement[1])
    return remote_cls.options(**options).remote(*args, **kwargs)


class RemoteQueue:
    """`streamrl.rollout.QueueClient` over the queue actor, for one producer actor: it registers for a
    lease that every admission carries, so that once the driver declares this producer dead (and gives
    its tickets back), an admission it had already sent cannot issue new ones. A commit leaves the batch
    in the `outbox` and the queue fetches it from this actor (`take_batch`): one copy, owned by the queue."""

    def __init__(self, handle: ray.actor.ActorHandle, producer_id: int):
        self.handle, self.producer_id = handle, producer_id
        self.lease = ray.get(handle.register_producer.remote(producer_id))
        self.outbox = Outbox()
        self._me = ray.get_runtime_context().current_actor  # the producer actor this client lives in

    def admit(self, producer_id: int, max_groups: int, *, weights_version: int | None = None,
              timeout: float = 0.0) -> Admission:
        if producer_id != self.producer_id:
            raise ValueError(f"this client admits for producer {self.producer_id}, not {producer_id}")
        return ray.get(self.handle.admit.remote(producer_id, max_groups, weights_version, timeout, self.lease))

    def commit(self, batch: pa.RecordBatch) -> list[int]:
        key = self.outbox.put(batch)
        try:
            return ray.get(self.handle.commit_from.remote(self._me, key))
        finally:
            self.outbox.drop(key)  # taken by the queue, or refused: either way not ours to keep

    def abandon(self, ticket_ids: list[int]) -> None:
        ray.get(self.handle.abandon.remote(ticket_ids))


OFFER_GRACE_S = 0.5  # a version the trainer's offer has not brought after this long is fetched by the long poll


def remote_fetch(weights: ray.actor.ActorHandle, holder: int, *, grace_s: float = 0.0):
    """Newer weights from the weights actor, held by `holder`, as `[object reference]`: read by the caller
    (`streamrl.weights.arrays.resolve`) only once it takes the version, so a version an offer is already
    fetching is not fetched twice. `grace_s`: the holder is offered versions directly; the long poll
    answers only those an offer missed."""
    def fetch(have: int | None, timeout: float) -> tuple[int, list[ray.ObjectRef]] | None:
        return ray.get(weights.acquire.remote(holder, have, timeout, grace_s))
    return fetch


class RemoteHold:
    """`hold(version)` for an engine's offers (`streamrl.engine.base.accept_offer`): tells the weights
    actor that `holder` took `version` without waiting for the answer, since it comes before the fetch
    and copy of the weights; the previous call's answer is read at the next, so a failure still surfaces."""

    def __init__(self, weights: ray.actor.ActorHandle, holder: int):
        self.weights, self.holder = weights, holder
        self._previous: ray.ObjectRef | None = None

    def __call__(self, version: int) -> None:
        previous, self._previous = self._previous, self.weights.hold.remote(self.holder, version)
        if previous is not None:
            ray.get(previous)


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
