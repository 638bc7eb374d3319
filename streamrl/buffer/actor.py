"""The replay queue as a named Ray actor.

```
 producer ──commit(batch)──► QueueActor: validate (zero-copy view of the argument)
                                         ray.put(batch) ─► object owned by the queue actor
                                         keeps the reference + metadata, never the bytes
 trainer  ──get(B)────────► TrainGroups whose payloads are references ─► ray.get, zero-copy slices
```
The actor puts each accepted batch itself, because an object belongs to the process that created
it: a batch the producer had `ray.put` would be lost with the producer. Blocking calls (`admit` with
a timeout, `get`) run on the actor's thread pool, so they never hold up other callers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from streamrl.buffer.checkpoint import load_queue, save_queue
from streamrl.buffer.config import QueueConfig
from streamrl.buffer.queue import OPERATOR_HOLD, Admission, ReplayQueue, Ticket, TrainGroups, assemble

NAMESPACE = "streamrl"


def queue_actor_name(run_name: str) -> str:
    return f"{run_name}/queue"


class QueueActor:
    def __init__(self, config: dict[str, Any], restore_from: str | None = None):
        cfg = QueueConfig(**config)
        self.queue = load_queue(restore_from, cfg, wrap=ray.put) if restore_from else ReplayQueue(cfg)

    def register_producer(self, producer_id: int) -> int:
        return self.queue.register_producer(producer_id)

    def admit(self, producer_id: int, max_groups: int, weights_version: int | None = None,
              timeout: float = 0.0, lease: int | None = None) -> Admission:
        return self.queue.admit(producer_id, max_groups, weights_version=weights_version, timeout=timeout,
                                lease=lease)

    def commit(self, batch: pa.RecordBatch | pa.Table) -> list[int]:
        return self.queue.commit(batch, to_payload=ray.put)

    def abandon(self, ticket_ids: list[int]) -> None:
        self.queue.abandon(ticket_ids)

    def abandon_producer(self, producer_id: int) -> list[int]:
        return self.queue.abandon_producer(producer_id)

    def get(self, num_groups: int | None = None, timeout: float | None = None) -> TrainGroups | None:
        return self.queue.get(num_groups, timeout)

    def set_version(self, version: int) -> None:
        self.queue.set_version(version)

    def pause(self, hold: str = OPERATOR_HOLD) -> bool:
        return self.queue.pause(hold)

    def resume(self, hold: str = OPERATOR_HOLD) -> bool:
        return self.queue.resume(hold)

    def close(self) -> None:
        self.queue.close()

    def status(self) -> dict[str, Any]:
        return self.queue.status()

    def pid(self) -> int:
        return os.getpid()  # for samplers of the actor's memory (benchmarks/soak.py)

    def running_tickets(self) -> list[Ticket]:
        return self.queue.running_tickets()

    def checkpoint(self, directory: str) -> str:
        return str(save_queue(self.queue, Path(directory), fetch=ray.get))


def create_queue_actor(run_name: str, config: QueueConfig, restore_from: str | None = None,
                       max_concurrency: int = 32) -> ray.actor.ActorHandle:
    """Start the named queue actor of a run (fails if one with that name is alive)."""
    cls = ray.remote(num_cpus=0, max_concurrency=max_concurrency)(QueueActor)
    return cls.options(name=queue_actor_name(run_name), namespace=NAMESPACE,
                       lifetime="non_detached").remote(config.model_dump(), restore_from)


def get_queue_actor(run_name: str) -> ray.actor.ActorHandle:
    """The queue actor of a running run; ValueError names the run when there is none."""
    try:
        return ray.get_actor(queue_actor_name(run_name), namespace=NAMESPACE)
    except ValueError as exc:
        raise ValueError(f"no running streamrl run named {run_name!r} (no actor "
                         f"{queue_actor_name(run_name)!r} in namespace {NAMESPACE!r})") from exc


def fetch_table(groups: TrainGroups) -> pa.Table:
    """The trainer's side of `get`: fetch each distinct payload once and slice out the groups."""
    unique = {id(g.payload): g.payload for g in groups.groups}
    batches = dict(zip(unique, ray.get(list(unique.values()))))
    return assemble(groups.groups, [batches[id(g.payload)] for g in groups.groups])
