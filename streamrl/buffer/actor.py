"""The replay queue as a named Ray actor.

```
 producer: batch into its Outbox ──commit_from(producer, key)──► QueueActor
                                   ◄──── producer.take_batch(key) ──┘  the return value: one copy in the
 QueueActor: validate (zero-copy view) ─► keep the reference + metadata    object store, owned by the queue
 trainer  ──get(B)────────► TrainGroups whose payloads are references ─► ray.get, zero-copy slices
```
An object belongs to the process that created the reference, and dies with it: a batch the producer
`ray.put` (or passed as an argument) would be lost with the producer. The queue owns what its own calls
return, so it asks the producer for each batch: the bytes are written to the object store once and
survive the producer (a commit by argument, `commit`, wrote them twice: the argument, then the queue's
own `ray.put`). Blocking calls (`admit` with a timeout, `get`, `commit_from`) run on the actor's thread
pool, so they never hold up other callers.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from streamrl import logs
from streamrl.buffer.checkpoint import load_queue, save_queue
from streamrl.buffer.config import QueueConfig
from streamrl.buffer.queue import OPERATOR_HOLD, Admission, ReplayQueue, Ticket, TrainGroups, assemble

log = logging.getLogger(__name__)

NAMESPACE = "streamrl"

# Ray returns an object of up to this many bytes inline, into the caller's heap (`max_direct_call_object_size`,
# settable through the environment as every Ray config is).
INLINE_RETURN_LIMIT = int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))


def queue_actor_name(run_name: str) -> str:
    return f"{run_name}/queue"


class QueueActor:
    def __init__(self, config: dict[str, Any], restore_from: str | None = None):
        logs.setup_actor_logging()
        cfg = QueueConfig(**config)
        self.queue = load_queue(restore_from, cfg, wrap=ray.put) if restore_from else ReplayQueue(cfg)

    def register_producer(self, producer_id: int) -> int:
        return self.queue.register_producer(producer_id)

    def admit(self, producer_id: int, max_groups: int, weights_version: int | None = None,
              timeout: float = 0.0, lease: int | None = None) -> Admission:
        return self.queue.admit(producer_id, max_groups, weights_version=weights_version, timeout=timeout,
                                lease=lease)

    def commit(self, batch: pa.RecordBatch | pa.Table) -> list[int]:
        """A batch passed by value (tests, tools): copied again into an object this actor owns."""
        return self.queue.commit(batch, to_payload=ray.put)

    def commit_from(self, producer: ray.actor.ActorHandle, key: int) -> list[int]:
        """Commit the batch `producer` holds under `key` in its Outbox: fetched as the return value of
        this actor's own call, so it is stored once and owned here.

        A batch small enough for Ray to return inline is kept as an object of its own (`ray.put`)
        instead: Ray (2.60) holds such a return in this process's heap, not the object store, and never
        frees it when the last reference to go is a borrower's — the trainer holds a step's groups
        (`get`) past `set_version`, where the queue drops its own. The queue actor grew by every small
        batch it ever took (+37 MB/min in `streamrl bench soak`). A second copy costs little at that
        size; the large batches the one-copy path is for are never inline."""
        ref = producer.take_batch.remote(key)
        batch = ray.get(ref)
        if batch.nbytes <= 2 * INLINE_RETURN_LIMIT:  # pickled, a batch is ~nbytes: this takes every inline one
            return self.queue.commit(batch, to_payload=ray.put)
        return self.queue.commit(batch, to_payload=lambda _batch: ref)

    def abandon(self, ticket_ids: list[int]) -> None:
        self.queue.abandon(ticket_ids)
        log.info("tickets %s given back: their prompts are generated again", ticket_ids)

    def abandon_producer(self, producer_id: int) -> list[int]:
        returned = self.queue.abandon_producer(producer_id)
        log.warning("producer %s is gone: its running tickets %s go back", producer_id, returned)
        return returned

    def get(self, num_groups: int | None = None, timeout: float | None = None) -> TrainGroups | None:
        return self.queue.get(num_groups, timeout)

    def set_version(self, version: int) -> None:
        self.queue.set_version(version)

    def set_max_staleness(self, eta: int) -> None:
        before = self.queue.max_staleness
        self.queue.set_max_staleness(eta)
        if eta != before:
            log.info("max_staleness %s -> %s at version %s", before, eta, self.queue.version)

    def pause(self, hold: str = OPERATOR_HOLD) -> bool:
        was_held = self.queue.pause(hold)
        log.info("admission paused by %s%s", hold, " (already held)" if was_held else "")
        return was_held

    def resume(self, hold: str = OPERATOR_HOLD) -> bool:
        was_held = self.queue.resume(hold)
        log.info("%s's hold on admission lifted%s", hold, "" if was_held else " (it held none)")
        return was_held

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


class Outbox:
    """A producer's finished batches until the queue actor takes them (`QueueActor.commit_from`, which
    calls the producer's `take_batch(key)`). Thread-safe: the commit thread puts, an actor call takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: dict[int, pa.RecordBatch] = {}
        self._keys = itertools.count()

    def put(self, batch: pa.RecordBatch) -> int:
        with self._lock:
            key = next(self._keys)
            self._batches[key] = batch
            return key

    def take(self, key: int) -> pa.RecordBatch:
        with self._lock:
            if key not in self._batches:
                raise KeyError(f"no batch {key} is waiting to be committed (taken already, or dropped)")
            return self._batches.pop(key)

    def drop(self, key: int) -> None:
        with self._lock:
            self._batches.pop(key, None)


def create_queue_actor(run_name: str, config: QueueConfig, restore_from: str | None = None,
                       max_concurrency: int = 32) -> ray.actor.ActorHandle:
    """Start the named queue actor of a run (fails if one with that name is alive)."""
    cls = ray.remote(num_cpus=0, max_concurrency=max_concurrency)(QueueActor)
    env = logs.actor_env("queue")
    return cls.options(name=queue_actor_name(run_name), namespace=NAMESPACE, lifetime="non_detached",
                       **({"runtime_env": {"env_vars": env}} if env else {})).remote(config.model_dump(), restore_from)


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
