"""The rollout producer: one loop over any engine (torch, sglang, sim), with no Ray in it.

```
 admit thread:   free slots ≥ G ─► queue.admit(free // G, weights version the engine holds) ─► tickets
                   └─ none: paused / in-flight / capacity / staleness ─► retry;
                            stale_weights ─► wait until the decode loop has switched to newer weights
 decode loop:    newer weights? switch (the stall is measured; the admit thread is woken) ─► admitted groups
                   join the engine ─► step
                   └─ a group's G samples all ended ─► score queue
 score thread:   rewards ─► Arrow batch ─► commit queue  (a failed reward: the prompts go back, raised in the loop)
 commit threads: queue.commit(batch), two at a time  (refused: the tickets are given back; an error is
                   re-raised in the loop, and every batch after it is given back)
 newer weights:  groups now certain to exceed the staleness budget are stopped and given back (unless the
                   queue trains over-budget groups: `max_staleness=None`)
 stop:           batches already made are committed; running and admitted groups are given back
```
A slot frees as soon as one sequence ends, so a long response holds one slot, not a whole batch: the
long tail costs throughput only through the staleness budget, not through idle slots. Admission,
scoring and commits run on their own threads, so neither a Ray call nor a reward function (user code: a
verifier or sandbox may take up to its timeout) holds up a decode step. The prompt cursor lives in
the queue and advances only by admission; a group that is never committed gives its prompt back, so
nothing is skipped and nothing is generated twice for training.
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from streamrl import failpoints
from streamrl.buffer.queue import Admission, QueueClosed, Ticket, TicketExpired
from streamrl.buffer.schema import build_batch
from streamrl.engine.base import Engine, Sample, to_generation
from streamrl.engine.generation import Generation
from streamrl.tasks import Task, group_rewards

log = logging.getLogger(__name__)

# Commits in flight at once. A commit over Ray is three hops around two passes over the batch (this
# process writing it into the object store, the queue validating it): with two in flight the queue
# validates one batch while the next is written (`streamrl bench buffer`: 0.37-0.44 of a plain put + get
# with one, 0.45-0.52 with two; three measured no better on two cores). The queue takes commits in any
# order: it serves groups by version and ticket, not by arrival.
COMMIT_THREADS = 2


class QueueClient(Protocol):
    """What a producer needs from the replay queue (the in-process queue or the Ray actor's client)."""

    def admit(self, producer_id: int, max_groups: int, *, weights_version: int | None = None,
              timeout: float = 0.0) -> Admission: ...

    def commit(self, batch: pa.RecordBatch) -> list[int]: ...

    def abandon(self, ticket_ids: list[int]) -> None: ...


def commit_or_give_back(queue: QueueClient, batch: pa.RecordBatch, ticket_ids: list[int]) -> list[int]:
    """Commit a batch of finished groups; returns the tickets queued. Groups whose tickets the queue had
    already taken back (expired while they ran) are left out and the rest committed: the run goes on,
    those prompts are generated again. Any other failure gives them all back and propagates."""
    try:
        queue.commit(batch)
        return list(ticket_ids)
    except TicketExpired as exc:
        expired = set(exc.expired)
        keep = [t for t in ticket_ids if t not in expired]
        log.info("the queue had taken back the tickets of groups %s while they ran: their prompts go back to be "
                 "generated again%s", sorted(expired), f"; groups {keep} are committed without them" if keep else "")
        if keep and expired:  # the finished siblings are not thrown away with them
            rest = batch.filter(pc.invert(pc.is_in(batch.column("group_id"), pa.array(sorted(expired)))))
            return commit_or_give_back(queue, rest, keep)
        queue.abandon(ticket_ids)
        return []
    except BaseException as exc:
        clean_up_after(exc, "giving the groups' tickets back", lambda: queue.abandon(ticket_ids))
        raise


def clean_up_after(error: BaseException | None, what: str, step: Callable[[], object]) -> None:
    """Run a clean-up step. While `error` is on its way out, a failure of the step is logged and noted on
    `error` instead of replacing it: the run's failure names the first cause, not the clean-up's."""
    if error is None:
        step()
        return
    try:
        step()
    except Exception as failed:  # noqa: BLE001 -- not swallowed: logged, and carried by the error raised
        log.error("%s failed while %s was raised: %s: %s", what, type(error).__name__, type(failed).__name__, failed)
        error.add_note(f"{what} failed as well: {type(failed).__name__}: {failed}")


def pack_groups(tickets: Sequence[Ticket], prompts: Sequence[Sequence[int]], generation: Generation,
                rewards: np.ndarray, *, group_size: int, producer_id: int, t_start: float,
                t_end: float) -> pa.RecordBatch:
    """One Arrow batch from whole groups: row r is sample r % G of ticket r // G."""
    n_rows = len(tickets) * group_size
    prompt_lengths = np.repeat([len(p) for p in prompts], group_size)
    prompt_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(prompt_lengths, out=prompt_offsets[1:])
    prompt_tokens = np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts for _ in range(group_size)])
    return build_batch(
        group_id=np.repeat([t.ticket_id for t in tickets], group_size),
        prompt_id=np.repeat([t.prompt_id for t in tickets], group_size),
        sample_index=np.tile(np.arange(group_size), len(tickets)),
        producer_id=producer_id,
        prompt_tokens=prompt_tokens,
        prompt_offsets=prompt_offsets,
        response_tokens=generation.tokens,
        response_offsets=generation.offsets,
        behavior_logprobs=generation.logprobs,
        versions=generation.versions,
        reward=rewards,
        finish_reason=generation.finish,
        t_start=t_start,
        t_end=t_end,
    )


class _Group:
    def __init__(self, ticket: Ticket, prompt: list[int], started: float, first_version: int):
        self.ticket, self.prompt, self.started = ticket, prompt, started
        self.first_version = first_version  # the weights its first tokens come from: the group's behaviour version
        self.samples: dict[int, Sample] = {}
        self.ended = 0.0  # wall time its last sample ended, set in the decode loop (scored later, on another thread)


@dataclass
class ProducerCounters:
    """What a producer has done so far (`summary.json`'s per-producer figures)."""

    groups: int = 0  # committed
    samples: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    busy_slot_s: float = 0.0  # Σ active sequences × step time
    engine_s: float = 0.0  # Σ step time: the engine computing
    run_s: float = 0.0
    weight_updates: int = 0  # versions switched to after the first one loaded
    aborted_groups: int = 0  # stopped early: certain to exceed the staleness budget
    expired_groups: int = 0  # refused at commit (their tickets had expired)
    lost_groups: int = 0  # a server died under them (sglang): their prompts given back


class RolloutProducer:
    def __init__(self, producer_id: int, *, queue: QueueClient, engine: Engine, task: Task, group_size: int,
                 max_staleness: int | None = None, admit_timeout: float = 0.2):
        if engine.capacity < group_size:
            raise ValueError(f"engine capacity {engine.capacity} cannot hold one group of {group_size}")
        self.producer_id = producer_id
        self.queue, self.engine, self.task = queue, engine, task
        self.group_size, self.admit_timeout = group_size, admit_timeout
        self.max_staleness = max_staleness  # None: never stop a group for its age
        self._cond = threading.Condition()
        self._admitted: deque[Ticket] = deque()  # admitted, not yet in the engine
        self._groups: dict[int, _Group] = {}  # in the engine, by ticket id
        self._scoring: stdlib_queue.Queue[tuple[list[int], list[_Group]] | None] = stdlib_queue.Queue()
        self._commits: stdlib_queue.Queue[tuple[list[int], pa.RecordBatch | None] | None] = stdlib_queue.Queue()
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.stats = ProducerCounters()
        self.stalls: list[float] = []  # seconds each weight switch held up the decode loop
        self.last_blocked_by: str | None = None

    # ---- the decode loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event, first_weights_timeout: float = 120.0) -> None:
        """Generate until `stop` is set or a background call fails (its error is raised here). Weights
        are followed from the first published version on (waited for up to `first_weights_timeout`)."""
        weights = self.engine.weights
        weights.start()
        try:
            deadline = time.monotonic() + first_weights_timeout
            while weights.version is None and not weights.wait_newer(None, 0.1):
                if stop.is_set():
                    return  # stopped before there was anything to generate with
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no weights were published within {first_weights_timeout:g} s")
            self._generate(stop)
        finally:
            weights.stop()

    def _generate(self, stop: threading.Event) -> None:
        started = time.perf_counter()
        self._refresh()  # the first version into use before the admit thread reports what it holds
        threads = [threading.Thread(target=self._admit_loop, name="admit", daemon=True),
                   threading.Thread(target=self._score_loop, name="score", daemon=True),
                   *(threading.Thread(target=self._commit_loop, name=f"commit-{i}", daemon=True)
                     for i in range(COMMIT_THREADS))]
        self._done.clear()
        for thread in threads:
            thread.start()
        failure: BaseException | None = None
        try:
            while not stop.is_set():
                self._raise_background_error()
                self._refresh()
                self._start_admitted()
                if self.engine.active == 0:
                    with self._cond:
                        self._cond.wait_for(lambda: self._admitted or self._error is not None or stop.is_set(),
                                            timeout=0.05)
                    continue
                self._decode()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._shutdown(threads, failure)
            self.stats.run_s += time.perf_counter() - started
        self._raise_background_error()

    def _refresh(self) -> None:
        first = self.engine.weights.version is None
        stall = self.engine.weights.refresh()
        if stall is None:
            return
        if first:  # nothing was generating to be held up: not an update, and not a stall
            log.info("weights version %s loaded (%.3f s)", self.engine.weights.version, stall)
            return
        self.stalls.append(stall)
        self.stats.weight_updates += 1
        log.info("weights version %s in use (generation held up %.3f s)", self.engine.weights.version, stall)
        self._abort_doomed(self.engine.weights.version)
        with self._cond:
            self._cond.notify_all()  # an admit thread refused for stale weights asks again with these

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
            log.info("groups %s can no longer be trained within the staleness budget at version %s: stopped, "
                     "their prompts go back", doomed, version)
            self.stats.aborted_groups += len(doomed)
            self._commits.put((doomed, None))  # the commit thread gives the prompts back

    def _start_admitted(self) -> None:
        if not self._admitted:
            return
        failpoints.hit("producer.generate")  # groups are running in the engine (their tickets held here)
        version = self.engine.weights.version
        with self._cond:  # from `_admitted` into the engine in one move: the admit thread counts both
            while self._admitted:
                ticket = self._admitted[0]
                prompt = self.task.prompt(ticket.prompt_id)  # if it raises, the ticket is still held: given back
                self._groups[ticket.ticket_id] = _Group(ticket, prompt, time.time(), version)
                self._admitted.popleft()
                self.engine.add(ticket.ticket_id, prompt, self.group_size)

    def _decode(self) -> None:
        active = self.engine.active
        finished = self.engine.step()
        self.stats.busy_slot_s += active * self.engine.last_step_s
        self.stats.engine_s += self.engine.last_step_s
        self.stats.decode_steps += 1
        self.stats.generated_tokens = self.engine.generated_tokens
        lost = [key for key in self.engine.lost() if self._groups.pop(key, None) is not None]
        if lost:  # a server died under them: the prompts go back
            self.stats.lost_groups += len(lost)
            self._commits.put((lost, None))
        done = []
        for sample in finished:
            group = self._groups.get(sample.key)
            if group is None:
                continue  # stopped or lost while its last request was in flight
            group.samples[sample.index] = sample
            if len(group.samples) == self.group_size:
                group.ended = time.time()
                done.append(self._groups.pop(sample.key))
        if finished:
            with self._cond:
                self._cond.notify_all()  # slots opened for the admit thread
        if done:
            self._scoring.put(([g.ticket.ticket_id for g in done], done))

    def _pack(self, groups: list[_Group]) -> pa.RecordBatch:
        samples = [g.samples[i] for g in groups for i in range(self.group_size)]
        generation = to_generation(samples)
        g = self.group_size
        rewards = np.array([r for i, group in enumerate(groups)
                            for r in group_rewards(self.task, group.ticket.prompt_id,
                                                   [generation.response(row) for row in range(i * g, (i + 1) * g)])],
                           dtype=np.float32)
        self.stats.samples += len(samples)
        return pack_groups([g.ticket for g in groups], [g.prompt for g in groups], generation, rewards,
                           group_size=self.group_size, producer_id=self.producer_id,
                           t_start=min(g.started for g in groups), t_end=max(g.ended for g in groups))

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
                held = self.engine.weights.version
                admission = self.queue.admit(self.producer_id, free, weights_version=held,
                                             timeout=self.admit_timeout)
                if admission.blocked_by != self.last_blocked_by:
                    log.info("admission %s", f"held: {admission.blocked_by}" if admission.blocked_by else "open")
                self.last_blocked_by = admission.blocked_by
                if admission.tickets:
                    with self._cond:
                        self._admitted.extend(admission.tickets)
                        self._cond.notify_all()
                elif admission.blocked_by == "stale_weights":
                    self._wait_for_newer_in_use(held)
        except BaseException as exc:
            self._fail(exc)

    def _wait_for_newer_in_use(self, held: int | None) -> None:
        """Wait up to `admit_timeout` for the decode loop to switch from version `held` to newer weights
        (`_refresh` notifies), or for the producer to stop. Weights staged but not yet switched to do not
        count: the queue budgets on the version in use, and would refuse again at once until the switch
        at the end of the current decode step (`weights.wait_newer` returns as soon as they are staged)."""
        with self._cond:
            self._cond.wait_for(lambda: self.engine.weights.version != held or self._done.is_set()
                                or self._error is not None, timeout=self.admit_timeout)

    def _score_loop(self) -> None:
        # Drains until shutdown whatever fails, as the commit loop: every item reaches the commit thread.
        while (item := self._scoring.get()) is not None:
            ticket_ids, groups = item
            if self._error is not None:
                self._commits.put((ticket_ids, None))  # the producer is stopping: the prompts go back
                continue
            try:
                batch = self._pack(groups)
            except BaseException as exc:  # scoring failed: the prompts go back, the error stops the producer
                self._commits.put((ticket_ids, None))
                self._fail(exc)
                continue
            self._commits.put((ticket_ids, batch))

    def _commit_loop(self) -> None:
        # Drains until shutdown whatever fails: an item left in `_commits` would hold its tickets for good.
        while (item := self._commits.get()) is not None:
            try:
                self._commit_or_abandon(*item)
            except BaseException as exc:
                self._fail(exc)

    def _commit_or_abandon(self, ticket_ids: list[int], batch: pa.RecordBatch | None) -> None:
        if self._error is not None or batch is None:
            self.queue.abandon(ticket_ids)  # not committed: the prompts go back
            return
        committed = commit_or_give_back(self.queue, batch, ticket_ids)  # refused or failed: given back
        with self._cond:  # counted under the lock: the other commit thread counts too
            self.stats.groups += len(committed)
            self.stats.expired_groups += len(ticket_ids) - len(committed)
        if committed:
            failpoints.hit("producer.after_commit")  # committed: its tickets are the queue's now

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _shutdown(self, threads: list[threading.Thread], failure: BaseException | None) -> None:
        """Commit what is finished, give back what is not, and stop the threads (while `failure` stops
        the producer, a clean-up step's own failure is noted on it)."""
        self._done.set()
        with self._cond:
            self._cond.notify_all()
        threads[0].join()  # no admission can land after this
        self._scoring.put(None)
        threads[1].join()  # finished groups scored and packed
        commit_threads = threads[2:]
        for _ in commit_threads:
            self._commits.put(None)  # one each: a thread takes one and leaves
        for commit_thread in commit_threads:
            commit_thread.join()
        unfinished = [*self._groups, *(t.ticket_id for t in self._admitted)]
        clean_up_after(failure, "stopping the engine's sequences", self.engine.abort)
        self._groups.clear()
        self._admitted.clear()
        if unfinished and not isinstance(self._error, QueueClosed):
            clean_up_after(failure, "giving unfinished groups' tickets back", lambda: self.queue.abandon(unfinished))
