"""A continuous-batching producer: sequences join and leave the engine at every decode step, and the
control plane (admission, commits) never holds up a decode step.

```
 admit thread:  free slots ≥ G ─► queue.admit(free // G, weights version held) ─► admitted tickets
 decode loop:   switch weights if newer (a swap) ─► admitted tickets join the engine ─► engine.step()
                   └─ a group's G samples all done ─► rewards ─► Arrow batch ─► commit queue
 commit thread: queue.commit(batch)   (failure: the tickets are abandoned, the error re-raised in the loop)
 newer weights: groups now certain to exceed the staleness budget are stopped and given back
 stop:          batches already made are committed; running and admitted groups are abandoned
```
A slot frees as soon as one sequence ends, so a long response holds one slot, not a whole batch:
the long tail costs throughput only through the staleness budget, not through idle slots.
"""

from __future__ import annotations

import queue as stdlib_queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from streamrl.buffer.queue import QueueClosed, Ticket
from streamrl.engine.generation import Generation
from streamrl.rollout.producer import QueueClient, commit_or_give_back, pack_groups
from streamrl.tasks import Task
from streamrl.weights.receiver import WeightReceiver


class FinishedSample(NamedTuple):
    key: int  # the ticket id of its group
    index: int  # sample index within the group
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, behaviour log-prob per token
    versions: np.ndarray  # int32, policy version per token
    finish: int  # STOP or LENGTH


class StepEngine(Protocol):
    """An engine that generates one token for every active sequence per `step`."""

    capacity: int
    model: object  # the weights in use; the receiver swaps in newer ones between steps
    last_step_s: float  # device time of the last step (what the slots were busy for)

    @property
    def active(self) -> int: ...

    def add(self, key: int, prompt: Sequence[int], n: int) -> None: ...

    def step(self, version: int) -> list[FinishedSample]: ...

    def cancel(self, key: int) -> None: ...

    def abort(self) -> None: ...


class _Group:
    def __init__(self, ticket: Ticket, prompt: list[int], started: float, first_version: int):
        self.ticket, self.prompt, self.started = ticket, prompt, started
        self.first_version = first_version  # stamped on its first tokens: the group's behaviour version
        self.samples: dict[int, FinishedSample] = {}


class ContinuousProducer:
    def __init__(self, producer_id: int, *, queue: QueueClient, receiver: WeightReceiver, engine: StepEngine,
                 task: Task, group_size: int, max_staleness: int | None = None, admit_timeout: float = 0.2):
        if engine.capacity < group_size:
            raise ValueError(f"engine capacity {engine.capacity} cannot hold one group of {group_size}")
        self.producer_id = producer_id
        self.queue, self.receiver, self.engine, self.task = queue, receiver, engine, task
        self.group_size, self.admit_timeout = group_size, admit_timeout
        self.max_staleness = max_staleness  # None: never abort a group for its age
        self._cond = threading.Condition()
        self._admitted: deque[Ticket] = deque()  # admitted, not yet in the engine
        self._groups: dict[int, _Group] = {}  # in the engine, by ticket id
        self._commits: stdlib_queue.Queue[tuple[list[int], object] | None] = stdlib_queue.Queue()
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.stats = {"groups": 0, "samples": 0, "generated_tokens": 0, "decode_steps": 0, "busy_slot_s": 0.0,
                      "run_s": 0.0, "weight_updates": 0, "aborted_groups": 0, "expired_groups": 0}
        self.stalls: list[float] = []  # seconds each weight switch held up the decode loop
        self.last_blocked_by: str | None = None

    # ---- the decode loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Generate until `stop` is set or a background call fails (its error is raised here)."""
        started = time.perf_counter()
        threads = [threading.Thread(target=self._admit_loop, name="admit", daemon=True),
                   threading.Thread(target=self._commit_loop, name="commit", daemon=True)]
        for thread in threads:
            thread.start()
        try:
            while not stop.is_set():
                self._raise_background_error()
                version = self._refresh()
                self._start_admitted(version)
                if self.engine.active == 0:
                    with self._cond:
                        self._cond.wait_for(lambda: self._admitted or self._error is not None or stop.is_set(),
                                            timeout=0.05)
                    continue
                self._decode(version)
        finally:
            self._shutdown(threads)
            self.stats["run_s"] += time.perf_counter() - started
        self._raise_background_error()

    def _refresh(self) -> int:
        before = self.receiver.version
        t = time.perf_counter()
        self.engine.model, version = self.receiver.apply(self.engine.model)
        if version != before:
            self.stalls.append(time.perf_counter() - t)
            self.stats["weight_updates"] += 1
            self._abort_doomed(version)
        return version

    def _abort_doomed(self, version: int) -> None:
        """Stop groups that can no longer be trained within the staleness budget. The trainer is at
        least at `version`, so a group whose first tokens are more than η older would be regenerated
        at commit anyway: stopping now frees its slots for work that will be trained."""
        if self.max_staleness is None:
            return
        doomed = [key for key, g in self._groups.items() if version - g.first_version > self.max_staleness]
        for key in doomed:
            self.engine.cancel(key)
            del self._groups[key]
        if doomed:
            self.stats["aborted_groups"] += len(doomed)
            self._commits.put((doomed, None))  # the commit thread gives the prompts back

    def _start_admitted(self, version: int) -> None:
        with self._cond:
            while self._admitted:
                ticket = self._admitted.popleft()
                prompt = self.task.prompt(ticket.prompt_id)
                self.engine.add(ticket.ticket_id, prompt, self.group_size)
                self._groups[ticket.ticket_id] = _Group(ticket, prompt, time.time(), version)

    def _decode(self, version: int) -> None:
        active = self.engine.active
        finished = self.engine.step(version)
        self.stats["busy_slot_s"] += active * self.engine.last_step_s
        self.stats["decode_steps"] += 1
        self.stats["generated_tokens"] += active
        done = []
        for sample in finished:
            group = self._groups[sample.key]
            group.samples[sample.index] = sample
            if len(group.samples) == self.group_size:
                done.append(self._groups.pop(sample.key))
        if finished:
            with self._cond:
                self._cond.notify_all()  # slots opened for the admit thread
        if done:
            self._commits.put(([g.ticket.ticket_id for g in done], self._pack(done)))

    def _pack(self, groups: list[_Group]):
        samples = [g.samples[i] for g in groups for i in range(self.group_size)]
        lengths = [len(s.tokens) for s in samples]
        generation = Generation(
            tokens=np.concatenate([s.tokens for s in samples]),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            logprobs=np.concatenate([s.logprobs for s in samples]),
            versions=np.concatenate([s.versions for s in samples]),
            finish=np.array([s.finish for s in samples], dtype=np.int8),
        )
        rewards = np.array([self.task.reward(groups[row // self.group_size].ticket.prompt_id, generation.response(row))
                            for row in range(len(samples))], dtype=np.float32)
        self.stats["samples"] += len(samples)
        return pack_groups([g.ticket for g in groups], [g.prompt for g in groups], generation, rewards,
                           group_size=self.group_size, producer_id=self.producer_id,
                           t_start=min(g.started for g in groups), t_end=time.time())

    # ---- the control plane ---------------------------------------------------------------------------
    def _free_groups(self) -> int:
        used = self.engine.active + self.group_size * len(self._admitted)
        return (self.engine.capacity - used) // self.group_size

    def _admit_loop(self) -> None:
        try:
            while not self._done.is_set():
                with self._cond:
                    if not self._cond.wait_for(lambda: self._free_groups() > 0 or self._done.is_set(), timeout=0.5):
                        continue
                    free = self._free_groups()
                if free <= 0:
                    continue
                held = self.receiver.version
                admission = self.queue.admit(self.producer_id, free, weights_version=held,
                                             timeout=self.admit_timeout)
                self.last_blocked_by = admission.blocked_by
                if admission.tickets:
                    with self._cond:
                        self._admitted.extend(admission.tickets)
                        self._cond.notify_all()
                elif admission.blocked_by == "stale_weights":
                    self.receiver.wait_newer(held, self.admit_timeout)
        except BaseException as exc:
            self._fail(exc)

    def _commit_loop(self) -> None:
        try:
            while (item := self._commits.get()) is not None:
                ticket_ids, batch = item
                if self._error is None and batch is not None:
                    try:
                        committed = commit_or_give_back(self.queue, batch, ticket_ids)
                    except BaseException as exc:
                        self._fail(exc)  # given back
                        continue
                    self.stats["groups" if committed else "expired_groups"] += len(ticket_ids)
                    continue
                self.queue.abandon(ticket_ids)  # not committed: the prompts go back
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        """Commit what is finished, give back what is not, and stop the threads."""
        self._done.set()
        with self._cond:
            self._cond.notify_all()
        threads[0].join()  # no admission can land after this
        self._commits.put(None)
        threads[1].join()
        unfinished = [*self._groups, *(t.ticket_id for t in self._admitted)]
        self.engine.abort()
        self._groups.clear()
        self._admitted.clear()
        if unfinished and not isinstance(self._error, QueueClosed):
            self.queue.abandon(unfinished)
