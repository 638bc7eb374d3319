"""Supervision: the run's actors as one record, and the producers watched, replaced and stopped.

```
 RunActors        queue · weights · trainer, and every actor created (what teardown kills)
 Producers.runs   one `run()` reference per producer, waited on beside every trainer call
   ended, died    its running tickets go back (queue.abandon_producer), its weights version is released,
                  its update groups in the trainer closed; a new producer (its own name and seed) replaces it
   ended, raised  ProducerFailed: a producer's own error is not something a restart mends; the run stops
                  with a checkpoint (the trainer and queue are whole) and then fails, naming the producer
 stop             each producer stops after its running generations commit; one that does not within
                  the timeout, or raises while it stops, is killed and released like a dead one
```
A producer is never a single point of failure: only queue, weights and trainer are (`RunFailed`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from streamrl.config import RunConfig
from streamrl.runtime.actors import ProducerActor, ProducerStatus
from streamrl.runtime.clients import create_actor, update_group_prefix
from streamrl.runtime.preflight import Plan
from streamrl.runtime.rundir import EVENTS_FILE, RunDir

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A part of the run that cannot be replaced died; the message says which, and how to resume."""


class ProducerFailed(RuntimeError):
    """A producer's `run()` raised (its own error, not its process dying) or returned while the run trained."""

    def __init__(self, pid: int, error: str):
        super().__init__(f"producer {pid} failed ({error})")
        self.pid = pid


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def last_line(exc: BaseException) -> str:
    """The innermost error of a Ray error, whose text ends with the failed task's traceback."""
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return (text[-1].strip() if text else type(exc).__name__)[:300]


def raised_in(exc: BaseException) -> str:
    """The actor method a Ray task error came from ("TrainerActor.step"): its text starts with
    `ray::NAME()` (the error Ray raises delegates attributes to the cause, so `function_name` is lost)."""
    found = re.search(r"ray::([\w.]+)\(", str(exc))
    return found.group(1) if found else "an actor"


def actor_died(exc: BaseException) -> bool:
    """The error says an actor's process is gone (killed, crashed, its node lost), not that its code raised."""
    while exc is not None:
        if isinstance(exc, ray.exceptions.ActorDiedError):  # not ActorUnavailableError: that may pass
            return True
        exc = exc.__cause__ if isinstance(exc, ray.exceptions.RayTaskError) else None
    return False


def producer_seed(base: int, producer_id: int, start_version: int, restart: int = 0) -> int:
    key = f"{base}/{producer_id}/{start_version}" + (f"/{restart}" if restart else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


@dataclass
class RunActors:
    """The actors the driver calls, and every actor created so far (a start that fails half-way still
    leaves nothing behind)."""

    queue: ray.actor.ActorHandle | None = None
    weights: ray.actor.ActorHandle | None = None
    trainer: ray.actor.ActorHandle | None = None
    created: list[ray.actor.ActorHandle] = field(default_factory=list)

    def add(self, handle: ray.actor.ActorHandle) -> ray.actor.ActorHandle:
        self.created.append(handle)
        return handle

    def kill_all(self) -> None:
        for actor in self.created:
            ray.kill(actor)
        self.created.clear()

    def dead_core_actor(self) -> str | None:
        """The first of queue, weights and trainer whose process is gone (None: all three answer)."""
        for role, call in (("queue", lambda: self.queue.status.remote()),
                           ("weights", lambda: self.weights.status.remote()),
                           ("trainer", lambda: self.trainer.ready.remote())):
            try:
                ray.get(call(), timeout=30)
            except ray.exceptions.ActorDiedError:
                return role
            except ray.exceptions.GetTimeoutError:
                continue  # alive, only busy (a trainer's threads can all be in weight broadcasts)
        return None


class Producers:
    """The run's producers: created, watched through their `run()` references, replaced, stopped."""

    def __init__(self, config: RunConfig, plan: Plan, actors: RunActors, run_dir: RunDir, *, start_step: int,
                 model_dir: str, search_path: str, notify: Callable[[str], None] = lambda text: None):
        self.config, self.plan, self.actors, self.run_dir = config, plan, actors, run_dir
        self.name = config.run.name
        self.config_dict = config.model_dump(mode="json")
        self.start_step, self.model_dir, self.search_path = start_step, model_dir, search_path
        self.notify = notify  # a line for the user (the progress view), beside the log and events.jsonl
        self.handles: list[ray.actor.ActorHandle] = []
        self.runs: list[ray.ObjectRef] = []  # watched while the run trains; empty once stopped on purpose
        self.failed: dict[int, str] = {}  # producers whose run raised: not watched again, released at stop
        self.restarts = 0
        self.stats: list[ProducerStatus] = []  # each stopped producer's, for the summary
        self.weight_histories: list[list[tuple[float, int]]] = []

    def create_all(self) -> list[ray.actor.ActorHandle]:
        self.handles = [self._create(pid) for pid in range(self.config.producers.count)]
        return self.handles

    def start_all(self) -> None:
        self.runs = [p.run.remote() for p in self.handles]

    def _create(self, pid: int, restart: int = 0) -> ray.actor.ActorHandle:
        cfg = self.config
        seed = producer_seed(cfg.run.seed, pid, self.start_step, restart)
        work_dir = str(self.run_dir.path / "sglang") if cfg.producers.engine == "sglang" else None
        # A dead actor's name stays taken while handles to it live: a replacement gets its own name.
        role = f"producer-{pid}" + (f"-restart{restart}" if restart else "")
        return self.actors.add(create_actor(ProducerActor, self.name, role, self.name, pid, self.config_dict,
                                            self.model_dir, seed, self.search_path, work_dir,
                                            num_cpus=cfg.producers.num_cpus, num_gpus=cfg.producers.num_gpus,
                                            max_concurrency=self.plan.producer_concurrency))

    @property
    def watched(self) -> list[ray.ObjectRef]:
        """The runs to wait on beside a trainer call: every producer's, but one that failed."""
        return [run for pid, run in enumerate(self.runs) if pid not in self.failed]

    def ended(self, ref: ray.ObjectRef, *, step: int) -> None:
        """A producer's run returned or raised while the run was training: replaced if its process died
        (and queue, weights and trainer are alive); otherwise `ProducerFailed`, with its error."""
        pid = self.runs.index(ref)
        try:
            stats = ray.get(ref)
        except ray.exceptions.RayError as exc:
            if actor_died(exc) and self.actors.dead_core_actor() is None:
                self.replace(pid, exc, step=step)
                return
            if actor_died(exc):
                raise  # a core actor is gone too: the run's failure is that one (`Run.failure`)
            self.failed[pid] = last_line(exc)
        else:
            self.failed[pid] = f"its run returned while the run was training: {stats}"
        log.error("producer %s failed at step %s: %s", pid, step, self.failed[pid])
        self.run_dir.append(EVENTS_FILE, {"event": "producer_failed", "producer": pid, "step": step,
                                          "error": self.failed[pid], "at": time.time()})
        raise ProducerFailed(pid, self.failed[pid])

    def replace(self, pid: int, exc: BaseException, *, step: int) -> None:
        """A producer died: its running groups' prompts go back to the queue (its committed groups are the
        queue's and stay), it stops holding a weights version, and a new producer takes its place."""
        limit = self.config.producers.max_restarts
        if self.restarts >= limit:
            raise RunFailed(f"producer {pid} died and producers.max_restarts = {limit} replacements are used up "
                            f"({first_line(exc)})") from exc
        if self.config.trainer.colocated:  # the trainer takes GPU turns with the servers of these very actors
            raise RunFailed(f"producer {pid} died in a colocated run, which does not replace producers "
                            f"({first_line(exc)}); resume with: streamrl launch --resume {self.run_dir.path}") from exc
        self.restarts += 1
        returned, groups_closed = self.release(pid)
        old = self.handles[pid]
        ray.kill(old)  # already gone; this only makes sure
        self.actors.created.remove(old)
        self.handles[pid] = self._create(pid, restart=self.restarts)
        self.runs[pid] = self.handles[pid].run.remote()
        log.warning("producer %s died at step %s (%s); %s running groups go back, replaced by a new producer",
                    pid, step, first_line(exc), len(returned))
        self.run_dir.append(EVENTS_FILE, {"event": "producer_replaced", "producer": pid, "step": step,
                                          "prompts_returned": len(returned), "update_groups_closed": groups_closed,
                                          "error": first_line(exc), "at": time.time()})
        self.notify(f"producer {pid} died ({first_line(exc)}); {len(returned)} running groups go back "
                    f"to the queue, a new producer takes its place")

    def release(self, pid: int) -> tuple[list[int], int]:
        """What a dead producer held: its running tickets (their prompts go back), its weights version,
        and (weights by broadcast) its update groups in the trainer. The tickets, and the groups closed."""
        returned = ray.get(self.actors.queue.abandon_producer.remote(pid))
        ray.get(self.actors.weights.drop_holder.remote(pid))
        closed = ray.get(self.actors.trainer.close_update_groups.remote(update_group_prefix(self.name, pid))) \
            if self.plan.trainer_sends_weights else 0
        return returned, closed

    def stop_all(self, timeout: float) -> None:
        """Stop every producer and wait up to `timeout` for their running generations to commit; one still
        generating is killed and released. Admission is the caller's to hold."""
        for producer in self.handles:
            producer.stop.remote()
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        stopped = []
        for pid, run in enumerate(self.runs):
            try:
                ray.get(run, timeout=0)
                stopped.append(self.handles[pid])
            except ray.exceptions.ActorDiedError:  # died while stopping: its running groups go back
                self.release(pid)
            except ray.exceptions.RayTaskError as exc:  # raised, now or while the run trained: as a dead one
                if pid not in self.failed:
                    self.failed[pid] = last_line(exc)
                    log.error("producer %s failed while stopping: %s", pid, self.failed[pid])
                    self.run_dir.append(EVENTS_FILE, {"event": "producer_failed_at_stop", "producer": pid,
                                                      "error": self.failed[pid], "at": time.time()})
                ray.kill(self.handles[pid])
                self.release(pid)
            except ray.exceptions.GetTimeoutError:  # still generating after `timeout`: cut short
                ray.kill(self.handles[pid])
                self.release(pid)
                self.run_dir.append(EVENTS_FILE, {"event": "producer_killed_at_stop", "producer": pid,
                                                  "timeout_s": timeout, "at": time.time()})
        self.stats = ray.get([p.status.remote() for p in stopped])
        self.weight_histories = ray.get([p.weight_history.remote() for p in stopped])
        self.runs = []  # ended on purpose: no longer watched (the final evaluation)
