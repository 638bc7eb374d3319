"""The versioned replay queue: admission control, the ticket lifecycle and staleness-bounded `get`.

```
 producers ──admit(n)──►  [admission: closed? paused? weights fresh? in-flight? capacity? staleness?]
      ▲                         │ tickets (one per group, carrying a prompt id)
      │ returned prompts        ▼
      └──── abandon ◄──── RUNNING ──commit(batch)──► QUEUED (heap: oldest version first)
                                                       │ get(B)  ── blocks until B groups, or timeout
                                                       ▼
                                                    CONSUMED ──► trainer; set_version(v + 1)
```
Equal versions are consumed in admission (ticket) order, not commit order: commit order would hand
the trainer fast, short groups first and leave slow ones to go over budget and be regenerated (a
bias toward short rollouts), and the staleness argument in `staleness.py` assumes admission order.

Admission is stopped by named **holds** (`pause(hold)` / `resume(hold)`): the operator, the launcher's
shutdown, a colocated step each hold their own, and admission runs only while none is held, so
independent pausers never undo each other. A producer registers for a **lease** (`register_producer`);
abandoning a producer revokes it, so an `admit` the dead producer sent before it died, which Ray still
runs, is refused instead of issuing tickets nobody holds.

Every prompt id the cursor has handed out is, at every moment, exactly one of: running (in a
ticket), queued, consumed, or returned (waiting to be admitted again). `admitted_live`, the count
the staleness formula uses, is running + queued + consumed: abandoned and regenerated groups give
their slot back, otherwise every abandonment would permanently shrink the budget and the trainer
could starve. The class is thread-safe and holds no Ray: the actor wraps it and stores object
references as payloads.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from streamrl.buffer.config import QueueConfig
from streamrl.buffer.staleness import admission_budget, staleness, weights_fresh_enough
from streamrl.buffer.validate import BatchError, GroupSpan, validate_batch

# Ticket states, one byte per ticket id ever issued.
UNKNOWN, RUNNING, QUEUED, CONSUMED, ABANDONED, REGENERATED = range(6)
_STATE_NAMES = ("unknown", "running", "queued", "consumed", "abandoned", "regenerated")


OPERATOR_HOLD = "operator"  # the hold `streamrl admission pause|resume` takes and releases
_HOLD_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")


class QueueClosed(RuntimeError):
    """The queue was closed: no more admissions or consumption."""


class TicketExpired(BatchError):
    """A commit of groups whose tickets expired (`ticket_timeout_s`) or were given back when their producer
    was declared dead: the queue has already sent their prompts back to be generated again. `expired`
    names every such group of the batch, so that the others can be committed without them."""

    def __init__(self, column: str | None, row: int | None, problem: str, expired: tuple[int, ...] = ()):
        super().__init__(column, row, problem)
        self.expired = tuple(expired)

    def __reduce__(self):
        return type(self), (self.column, self.row, self.problem, self.expired)


class LeaseRevoked(RuntimeError):
    """An admission for a producer whose lease was revoked (it was declared dead) or never granted."""


class Ticket(NamedTuple):
    """The right to generate one group for one prompt. Its id becomes the group's `group_id`."""

    ticket_id: int
    prompt_id: int
    producer_id: int
    admitted_version: int
    admitted_at: float
    admitted_eta: int = 0  # the staleness budget in force when it was admitted


class Admission(NamedTuple):
    tickets: list[Ticket]
    blocked_by: str | None  # why no more were admitted: paused, stale_weights, in_flight, capacity, staleness, batch


class QueuedGroup(NamedTuple):
    """A committed group: where its rows are and what the scheduler needs to know about them."""

    group_id: int
    prompt_id: int
    producer_id: int
    min_version: int
    num_tokens: int
    row_start: int
    row_count: int
    payload: Any  # the RecordBatch in process; an object reference in the Ray actor
    committed_at: float
    admitted_eta: int = -1  # η in force at its admission (−1: unknown, a checkpoint older than the field)

    def sort_key(self) -> tuple[int, int]:
        """Oldest version first, ties in admission order (ticket ids are issued in admission order)."""
        return (self.min_version, self.group_id)


@dataclass(frozen=True)
class TrainGroups:
    """Groups handed to the trainer at one version, with the staleness of each."""

    version: int
    groups: list[QueuedGroup]
    staleness: list[int]
    max_staleness: int  # the bound they were held to: η in force, or a larger η one of them was admitted under

    def __reduce__(self):
        """Pickled as columns, each payload once: Ray pickles a return value through a Python hook it calls
        for every object, and a step's 512 groups as tuples took the queue actor 1-5 ms of its GIL per
        `get` (`streamrl bench buffer`, profiled), time in which it validated no commit. Columns: 0.3 ms."""
        groups, n = self.groups, len(self.groups)
        payload_ids = np.fromiter(map(id, map(_payload_of, groups)), np.uint64, count=n)
        _, first, index = np.unique(payload_ids, return_index=True, return_inverse=True)
        ints = np.fromiter(itertools.chain.from_iterable(map(_ints_of, groups)), np.int64, count=n * _NUM_INTS)
        committed_at = np.fromiter(map(_committed_at_of, groups), np.float64, count=n)
        return _train_groups_from_columns, (self.version, self.max_staleness, ints.reshape(n, _NUM_INTS),
                                            committed_at, [groups[i].payload for i in first.tolist()],
                                            index, np.array(self.staleness, np.int64))


# A QueuedGroup's integer fields: those before its payload, and admitted_eta.
_PAYLOAD = QueuedGroup._fields.index("payload")
_ints_of = operator.itemgetter(*range(_PAYLOAD), QueuedGroup._fields.index("admitted_eta"))
_NUM_INTS = _PAYLOAD + 1
_payload_of = operator.itemgetter(_PAYLOAD)
_committed_at_of = operator.itemgetter(QueuedGroup._fields.index("committed_at"))


def _train_groups_from_columns(version: int, max_staleness: int, ints: np.ndarray, committed_at: np.ndarray,
                               payloads: list[Any], index: np.ndarray, ages: np.ndarray) -> TrainGroups:
    groups = [QueuedGroup(*row[:_PAYLOAD], payload=payloads[i], committed_at=at, admitted_eta=row[-1])
              for row, i, at in zip(ints.tolist(), index.tolist(), committed_at.tolist())]
    return TrainGroups(version, groups, ages.tolist(), max_staleness)


class ReplayQueue:
    def __init__(self, config: QueueConfig):
        self.config = config
        # `with self._lock` directly: Condition.__enter__ is a Python-level wrapper around the same lock.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._version = 0
        self._holds: set[str] = set()  # admission runs only while empty
        self._closed = False
        self._states = bytearray()  # ticket id -> state
        self._running: OrderedDict[int, Ticket] = OrderedDict()  # admission order
        self._queued: dict[int, QueuedGroup] = {}
        self._heap: list[tuple[int, int]] = []  # QueuedGroup.sort_key of each queued group
        # Handed to the trainer at the current version, not trained yet (set_version clears): a snapshot
        # taken now queues them again, since the weights they would have trained are not in it.
        self._in_training: list[QueuedGroup] = []
        self._in_training_over = 0  # of them, counted over budget when handed out (over_budget="train")
        self._eta = config.eta_start  # the staleness budget in force (`set_max_staleness` moves it)
        self._queued_tokens = 0
        self._next_prompt = 0
        self._returned: deque[int] = deque()
        self._leases: dict[int, int | None] = {}  # producer id -> its lease (None: revoked)
        self._next_lease = 0
        # regenerated_tokens: prompt + response tokens of the groups regenerated for being over budget
        # (against the trained groups' mean it shows whether staleness drops the long ones)
        self.counters = {"admitted": 0, "committed": 0, "consumed": 0, "abandoned": 0,
                         "over_budget": 0, "regenerated_tokens": 0, "rejected_batches": 0}
        self._blocked_by: str | None = None

    # ---- admission -------------------------------------------------------------------------------
    def register_producer(self, producer_id: int) -> int:
        """A producer starts: its lease, which every `admit` of it must carry from then on. A new lease
        replaces the old one (a replacement producer takes over the id of a dead one)."""
        with self._lock:
            self._next_lease += 1
            self._leases[producer_id] = self._next_lease
            return self._next_lease

    def admit(self, producer_id: int, max_groups: int, *, weights_version: int | None = None,
              timeout: float = 0.0, lease: int | None = None) -> Admission:
        """Admit up to `max_groups` groups; wait up to `timeout` seconds for at least one slot.

        `weights_version` is the policy version the producer holds; a producer more than η versions
        behind is refused until it loads newer weights (the bound is enforced where work starts).
        A producer that registered must pass its `lease`; one whose lease was revoked gets `LeaseRevoked`.
        """
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        deadline = None
        with self._lock:
            while True:
                self._expire_tickets()
                if self._closed:
                    raise QueueClosed("queue closed")
                self._check_lease(producer_id, lease)  # again after every wait: it may have been revoked
                allowed, reason = self._slots_available(weights_version)
                if allowed:
                    tickets = self._issue(producer_id, min(allowed, max_groups))
                    if len(tickets) < max_groups:
                        _, reason = self._slots_available(weights_version)
                    self._blocked_by = reason
                    return Admission(tickets, reason)
                self._blocked_by = reason
                if reason == "stale_weights":
                    return Admission([], reason)  # only the producer loading newer weights helps: no wait
                if deadline is None:  # the clock is read only when there is something to wait for
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return Admission([], reason)
                self._cond.wait(min(remaining, self._until_next_expiry()))

    def _check_lease(self, producer_id: int, lease: int | None) -> None:
        if producer_id not in self._leases:
            if lease is None:
                return  # a caller that never registered (in-process use): nothing to fence
            raise LeaseRevoked(f"producer {producer_id} has no lease (register_producer first)")
        current = self._leases[producer_id]
        if lease is None or lease != current:
            raise LeaseRevoked(f"producer {producer_id}'s lease {lease} is not its current one ({current}): "
                               "it was declared dead and its tickets given back")

    def _until_next_expiry(self) -> float:
        """Seconds until the oldest running ticket expires (a slot opens then: a blocked admitter wakes)."""
        timeout = self.config.ticket_timeout_s
        if timeout is None or not self._running:
            return float("inf")
        oldest = next(iter(self._running.values()))
        return max(0.0, oldest.admitted_at + timeout - time.time()) + 1e-3

    def _slots_available(self, weights_version: int | None) -> tuple[int, str | None]:
        cfg = self.config
        if self._holds:
            return 0, "paused"
        if weights_version is not None and not weights_fresh_enough(
                trainer_version=self._version, max_staleness=self._eta,
                weights_version=weights_version):
            return 0, "stale_weights"
        # The capacity bounds memory, but never below one step's batch: with fewer groups queued and
        # running than a step takes, the trainer would wait for a batch that admission never lets form.
        capacity_room = (cfg.groups_per_step - len(self._queued) - len(self._running)
                         if self._queued_tokens >= cfg.capacity_tokens else None)  # None: under the capacity
        if capacity_room is not None and capacity_room <= 0:
            return 0, "capacity"
        in_flight = cfg.max_in_flight - len(self._running)
        rule = dict(trainer_version=self._version, max_staleness=self._eta,
                    groups_per_step=cfg.groups_per_step, admitted_live=self.admitted_live)
        budget = admission_budget(**rule, weights_version=weights_version)
        if budget <= 0:
            # Newer weights would open slots that the trainer's version already allows.
            return 0, "stale_weights" if admission_budget(**rule) > 0 else "staleness"
        if in_flight <= 0:
            return 0, "in_flight"
        if cfg.admission == "per_step":
            left_in_batch = -self.admitted_live % cfg.groups_per_step
            if left_in_batch == 0 and self._running:
                return 0, "batch"  # the previous step's batch still has groups generating
            budget = min(budget, left_in_batch or cfg.groups_per_step)
        if capacity_room is not None:
            budget = min(budget, capacity_room)
        return min(budget, in_flight), None

    def _issue(self, producer_id: int, count: int) -> list[Ticket]:
        now, version, tickets = time.time(), self._version, []
        for _ in range(count):
            if self._returned:  # prompts given back are generated again before fresh ones
                prompt_id = self._returned.popleft()
            else:
                prompt_id, self._next_prompt = self._next_prompt, self._next_prompt + 1
            ticket = Ticket(len(self._states), prompt_id, producer_id, version, now, self._eta)
            self._states.append(RUNNING)
            self._running[ticket.ticket_id] = ticket
            tickets.append(ticket)
        self.counters["admitted"] += count
        return tickets

    @property
    def admitted_live(self) -> int:
        return len(self._running) + len(self._queued) + self.counters["consumed"]

    def _expire_tickets(self) -> None:
        timeout = self.config.ticket_timeout_s
        if timeout is None or not self._running:
            return
        cutoff = time.time() - timeout
        expired = []
        for ticket in self._running.values():  # admission order: the oldest come first
            if ticket.admitted_at > cutoff:
                break
            expired.append(ticket.ticket_id)
        if expired:
            self._abandon_locked(expired)

    # ---- producers give work back ------------------------------------------------------------------
    def commit(self, batch: pa.RecordBatch | pa.Table,
               to_payload: Callable[[pa.RecordBatch], Any] | None = None) -> list[int]:
        """Validate a batch of complete groups and queue them; returns their group ids.

        `to_payload(batch)` makes what the queue keeps for the rows once the batch is valid (default:
        the batch itself; the Ray actor stores an object reference). The whole batch is accepted or,
        with a `BatchError`, nothing changes.
        """
        cfg = self.config
        try:
            # Versions only grow, so a batch valid at the version read here is valid later too.
            batch, spans = validate_batch(batch, group_size=cfg.group_size,
                                          trainer_version=self.version, vocab_size=cfg.vocab_size)
            payload = to_payload(batch) if to_payload else batch
            with self._lock:
                self._expire_tickets()  # a ticket past its timeout has expired, swept or not
                self._check_tickets(spans)
                now = time.time()
                for span in spans:
                    self._enqueue(span, payload, now)
                self.counters["committed"] += len(spans)
                self._handle_over_budget()  # a straggler that arrives already too old goes back at once
                self._cond.notify_all()
                return [span.group_id for span in spans]
        except BatchError:
            with self._lock:
                self.counters["rejected_batches"] += 1
            raise

    def _check_tickets(self, spans: list[GroupSpan]) -> None:
        expired = []
        for span in spans:
            state = self._states[span.group_id] if 0 <= span.group_id < len(self._states) else UNKNOWN
            if state == ABANDONED:
                expired.append(span)
                continue
            if state != RUNNING:
                problem = {UNKNOWN: "is unknown", REGENERATED: "has expired (regenerated)"}.get(
                    state, "was already committed")
                raise BatchError("group_id", span.row_start, f"ticket {span.group_id} {problem}")
            ticket = self._running[span.group_id]
            if ticket.prompt_id != span.prompt_id:
                raise BatchError("prompt_id", span.row_start,
                                 f"group {span.group_id} has prompt {span.prompt_id}, "
                                 f"its ticket prompt {ticket.prompt_id}")
            if ticket.producer_id != span.producer_id:
                raise BatchError("producer_id", span.row_start,
                                 f"group {span.group_id} comes from producer {span.producer_id}, "
                                 f"its ticket was given to {ticket.producer_id}")
        if expired:
            ids = [span.group_id for span in expired]
            raise TicketExpired("group_id", expired[0].row_start, f"tickets {ids} have expired (abandoned)",
                                expired=tuple(ids))

    def _enqueue(self, span: GroupSpan, payload: Any, now: float) -> None:
        ticket = self._running.pop(span.group_id)
        self._states[span.group_id] = QUEUED
        self._add_queued(QueuedGroup(span.group_id, span.prompt_id, span.producer_id, span.min_version,
                                     span.num_tokens, span.row_start, span.row_count, payload, now,
                                     ticket.admitted_eta))

    def _add_queued(self, group: QueuedGroup) -> None:
        self._queued[group.group_id] = group
        self._queued_tokens += group.num_tokens
        heapq.heappush(self._heap, group.sort_key())

    def abandon(self, ticket_ids: list[int]) -> None:
        """Give running tickets back: their prompts will be generated again. A ticket the queue already
        took back (expired, or its producer declared dead) is skipped: its owner cannot know that. Any
        other ticket that is not running is refused, and then nothing changes."""
        with self._lock:
            if len(set(ticket_ids)) != len(ticket_ids):
                raise ValueError(f"tickets {sorted(ticket_ids)} name a ticket twice")
            running = []
            for ticket_id in ticket_ids:
                state = self._states[ticket_id] if 0 <= ticket_id < len(self._states) else UNKNOWN
                if state == RUNNING:
                    running.append(ticket_id)
                elif state != ABANDONED:
                    raise ValueError(f"ticket {ticket_id} is {_STATE_NAMES[state]}, not running")
            self._abandon_locked(running)

    def abandon_producer(self, producer_id: int) -> list[int]:
        """Abandon every running ticket of a producer (it died or stopped) and revoke its lease, so that
        an admission it sent before dying cannot issue tickets after this; returns the ticket ids."""
        with self._lock:
            if producer_id in self._leases:
                self._leases[producer_id] = None
            ids = [t.ticket_id for t in self._running.values() if t.producer_id == producer_id]
            self._abandon_locked(ids)
            return ids

    def _abandon_locked(self, ticket_ids: list[int]) -> None:
        for ticket_id in ticket_ids:
            ticket = self._running.pop(ticket_id)
            self._states[ticket_id] = ABANDONED
            self._returned.append(ticket.prompt_id)
            self.counters["abandoned"] += 1
        if ticket_ids:
            self._cond.notify_all()

    # ---- the trainer -------------------------------------------------------------------------------
    def get(self, num_groups: int | None = None, timeout: float | None = None) -> TrainGroups | None:
        """Take `num_groups` (default B) queued groups, oldest version first.

        Blocks until enough are queued; returns None after `timeout` seconds. Groups over the
        staleness budget are handled by `config.over_budget` and counted, never silently.
        """
        wanted = self.config.groups_per_step if num_groups is None else num_groups
        if wanted < 1:
            raise ValueError(f"num_groups must be >= 1, got {wanted}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._closed:
                    raise QueueClosed("queue closed")
                self._handle_over_budget()
                if len(self._queued) >= wanted:
                    groups = [self._pop_oldest() for _ in range(wanted)]
                    self._in_training.extend(groups)
                    ages = [staleness(self._version, g.min_version) for g in groups]
                    budgets = [self.budget_of(g) for g in groups]
                    self.counters["consumed"] += wanted
                    # Only reachable with over_budget="train": the others were regenerated above.
                    over = sum(age > budget for age, budget in zip(ages, budgets))
                    self.counters["over_budget"] += over
                    self._in_training_over += over
                    self._cond.notify_all()
                    return TrainGroups(self._version, groups, ages, max(budgets))
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _pop_oldest(self) -> QueuedGroup:
        _, group_id = heapq.heappop(self._heap)  # every removal from _queued pops the heap: no stale entries
        group = self._queued.pop(group_id)
        self._queued_tokens -= group.num_tokens
        self._states[group_id] = CONSUMED
        return group

    def budget_of(self, group: QueuedGroup) -> int:
        """The staleness a group may reach: the η in force when it was admitted, or the η in force now if
        larger. Lowering η is an admission-side change: groups admitted before keep their budget (nothing
        generated under the old rule is thrown away); raising it relaxes every group's."""
        return max(group.admitted_eta, self._eta)

    def _handle_over_budget(self) -> None:
        if self.config.over_budget == "train":
            return  # counted when handed out, in get()
        limit = self._version - self._eta
        within = []  # older than η allows, but admitted under a larger η that they still keep to
        while self._heap and self._heap[0][0] < limit:  # only groups older than η can be over budget
            _, group_id = heapq.heappop(self._heap)
            group = self._queued[group_id]
            if staleness(self._version, group.min_version) <= self.budget_of(group):
                within.append(group.sort_key())
                continue
            del self._queued[group_id]
            self._queued_tokens -= group.num_tokens
            self._states[group_id] = REGENERATED
            self._returned.append(group.prompt_id)
            self.counters["over_budget"] += 1
            self.counters["regenerated_tokens"] += group.num_tokens
            self._cond.notify_all()
        for key in within:
            heapq.heappush(self._heap, key)

    def set_version(self, version: int) -> None:
        """The trainer finished optimizer step `version` (versions only grow)."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version {version!r} is a {type(version).__name__}, not an int")
        with self._lock:
            if version < self._version:
                raise ValueError(f"version {version} is older than the current version {self._version}")
            if version > self._version:
                self._in_training.clear()  # trained: the new weights contain them
                self._in_training_over = 0
            self._version = version
            self._handle_over_budget()
            self._cond.notify_all()

    def set_max_staleness(self, eta: int) -> None:
        """Put η in force (`queue.max_staleness = "auto"`: within [auto_min, auto_max]). Admission follows
        the new η at once; groups admitted before keep the budget they were admitted under (`budget_of`),
        so a lowered η throws nothing away: it takes effect as the groups admitted under it arrive."""
        cfg = self.config
        if not cfg.auto:
            raise ValueError(f"queue.max_staleness is fixed at {cfg.max_staleness}; "
                             "only queue.max_staleness = \"auto\" lets it move")
        if isinstance(eta, bool) or not isinstance(eta, int) or not cfg.auto_min <= eta <= cfg.auto_max:
            raise ValueError(f"max_staleness {eta!r} is outside [auto_min, auto_max] = "
                             f"[{cfg.auto_min}, {cfg.auto_max}]")
        with self._lock:
            self._eta = eta
            self._handle_over_budget()
            self._cond.notify_all()

    @property
    def max_staleness(self) -> int:
        """The η in force."""
        return self._eta

    @property
    def version(self) -> int:
        return self._version

    # ---- admission holds ---------------------------------------------------------------------------
    def pause(self, hold: str = OPERATOR_HOLD) -> bool:
        """Take the named hold: no new admissions while any hold is held. Returns whether `hold` was
        already held (taking it again changes nothing). Running groups finish and are queued."""
        _check_hold_name(hold)
        with self._lock:
            was_held = hold in self._holds
            self._holds.add(hold)
            return was_held

    def resume(self, hold: str = OPERATOR_HOLD) -> bool:
        """Release the named hold; returns whether it was held. Other holds are untouched: admission
        runs again only once none is held."""
        _check_hold_name(hold)
        with self._lock:
            was_held = hold in self._holds
            self._holds.discard(hold)
            self._cond.notify_all()
            return was_held

    @property
    def holds(self) -> list[str]:
        with self._lock:
            return sorted(self._holds)

    def close(self) -> None:
        """Wake every waiter; later admit/get raise QueueClosed. Commits are still accepted."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self._lock:
            self._expire_tickets()
            by_staleness: dict[int, int] = {}
            for group in self._queued.values():
                s = staleness(self._version, group.min_version)
                by_staleness[s] = by_staleness.get(s, 0) + 1
            return {
                "version": self._version,
                "max_staleness": self._eta,
                "paused": bool(self._holds),
                "holds": sorted(self._holds),
                "closed": self._closed,
                **self.counters,
                "running": len(self._running),
                "queued_groups": len(self._queued),
                "queued_tokens": self._queued_tokens,
                "in_training": len(self._in_training),
                "admitted_live": self.admitted_live,
                "admission_budget": admission_budget(
                    trainer_version=self._version, max_staleness=self._eta,
                    groups_per_step=self.config.groups_per_step, admitted_live=self.admitted_live),
                "blocked_by": self._blocked_by,
                "returned_prompts": len(self._returned),
                "prompt_cursor": self._next_prompt,
                "queued_staleness": dict(sorted(by_staleness.items())),
            }

    # ---- checkpoints -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the state for a checkpoint. Prompts of running groups are listed with
        the returned ones: after a restore they are generated again and their tickets have expired.
        Groups handed to the trainer at this version but not trained yet (a snapshot between `get` and
        `set_version`) are queued in the copy, as before that `get`: the checkpoint's weights lack them."""
        with self._lock:
            self._expire_tickets()
            states, counters = bytearray(self._states), dict(self.counters)
            for group in self._in_training:
                states[group.group_id] = QUEUED
            counters["consumed"] -= len(self._in_training)
            # over_budget="train" counted them when handed out; they will be counted again then
            counters["over_budget"] -= self._in_training_over
            return {
                "version": self._version,
                "max_staleness": self._eta,
                "holds": sorted(self._holds),
                "counters": counters,
                "prompt_cursor": self._next_prompt,
                "returned_prompts": list(self._returned) + [t.prompt_id for t in self._running.values()],
                "ticket_states": bytes(states),
                "groups": sorted([*self._queued.values(), *self._in_training], key=QueuedGroup.sort_key),
            }

    @classmethod
    def from_snapshot(cls, config: QueueConfig, snap: dict[str, Any]) -> ReplayQueue:
        """Rebuild a queue. Running groups are gone (their tickets expire, their prompts are generated
        again), and the counters are re-derived from the ticket states and checked against the saved
        ones, so a resumed run cannot burst past the staleness bound; a snapshot whose parts disagree
        raises ValueError naming what disagrees."""
        queue = cls(config)
        for hold in snap["holds"]:
            _check_hold_name(hold)
        queue._version = snap["version"]
        if config.auto and "max_staleness" in snap:  # a fixed η is the config's, frozen on resume
            queue.set_max_staleness(snap["max_staleness"])
        queue._holds = set(snap["holds"])
        queue._next_prompt = snap["prompt_cursor"]
        queue._returned.extend(snap["returned_prompts"])
        queue._states = bytearray(snap["ticket_states"]).replace(bytes([RUNNING]), bytes([ABANDONED]))
        queue.counters = _restored_counters(snap["counters"], bytes(snap["ticket_states"]))
        for group in snap["groups"]:
            queue._add_queued(group)
        _check_restored(queue, snap["groups"])
        return queue

    # ---- introspection (tests, checkpoints) --------------------------------------------------------
    def running_tickets(self) -> list[Ticket]:
        with self._lock:
            return list(self._running.values())

    def queued_groups(self) -> list[QueuedGroup]:
        """Queued groups in the order `get` would take them."""
        with self._lock:
            return sorted(self._queued.values(), key=QueuedGroup.sort_key)

    def returned_prompts(self) -> list[int]:
        with self._lock:
            return list(self._returned)

    def ticket_state(self, ticket_id: int) -> str:
        with self._lock:
            return _STATE_NAMES[self._states[ticket_id]] if 0 <= ticket_id < len(self._states) else "unknown"


def _check_hold_name(hold: str) -> None:
    if not isinstance(hold, str) or not _HOLD_NAME.fullmatch(hold):
        raise ValueError(f"admission hold name {hold!r}: expected lower-case letters, digits, '-' or '_' "
                         "(1-64 characters, starting with a letter)")


def _restored_counters(saved: dict[str, int], states: bytes) -> dict[str, int]:
    """The counters a restored queue starts with: those the ticket states determine are derived from
    them (running tickets become abandoned) and must agree with the saved ones."""
    running, queued, consumed, abandoned, regenerated = (states.count(s) for s in
                                                         (RUNNING, QUEUED, CONSUMED, ABANDONED, REGENERATED))
    derived = {"admitted": len(states), "committed": queued + consumed + regenerated, "consumed": consumed,
               "abandoned": abandoned}
    for name, value in derived.items():
        if saved.get(name) != value:
            raise ValueError(f"counters.{name} = {saved.get(name)!r}, but the ticket states give {value}")
    if not isinstance(saved.get("over_budget"), int) or saved["over_budget"] < regenerated:
        raise ValueError(f"counters.over_budget = {saved.get('over_budget')!r}, but {regenerated} groups "
                         "were regenerated for being over budget")
    return {"regenerated_tokens": 0, **saved, **derived, "abandoned": abandoned + running}  # older checkpoints lack it


def _check_restored(queue: ReplayQueue, groups: list[QueuedGroup]) -> None:
    """Every prompt the cursor handed out is in exactly one place: queued, consumed or to be generated
    again; the queued groups are those whose tickets say so; none is newer than the queue."""
    queued_ids = sorted(g.group_id for g in groups)
    expected = [i for i, state in enumerate(queue._states) if state == QUEUED]
    if queued_ids != expected:
        raise ValueError(f"the queued groups {queued_ids[:8]} are not the tickets in state queued {expected[:8]}")
    newer = [g.group_id for g in groups if g.min_version > queue._version]
    if newer:
        raise ValueError(f"groups {newer[:8]} were sampled by versions newer than the queue's {queue._version}")
    returned = list(queue._returned)
    places = returned + [g.prompt_id for g in groups]
    if len(set(places)) != len(places) or any(not 0 <= p < queue._next_prompt for p in places):
        raise ValueError(f"returned and queued prompts must be distinct ids below the cursor {queue._next_prompt}")
    consumed = queue.counters["consumed"]
    if len(places) + consumed != queue._next_prompt:
        raise ValueError(f"the cursor handed out {queue._next_prompt} prompts, but {len(groups)} are queued, "
                         f"{consumed} consumed and {len(returned)} to be generated again")


def assemble(groups: list[QueuedGroup], batches: list[pa.RecordBatch] | None = None) -> pa.Table:
    """The rows of `groups`, in order, as one table of zero-copy slices. `batches[i]` is the fetched
    payload of `groups[i]` when payloads are references; by default the payloads are the batches.

    Groups that follow each other in the same batch become one slice: a step's groups mostly come a
    batch at a time, and a table of one chunk per group (512 in a large step) costs every later pass
    over it (`Table.nbytes` of 512 slices: 15 ms, against 0.3 ms for one)."""
    batches = [g.payload for g in groups] if batches is None else batches
    runs: list[list] = []  # [batch, first row, row count]
    for group, batch in zip(groups, batches):
        if runs and runs[-1][0] is batch and runs[-1][1] + runs[-1][2] == group.row_start:
            runs[-1][2] += group.row_count
        else:
            runs.append([batch, group.row_start, group.row_count])
    return pa.Table.from_batches([batch.slice(start, count) for batch, start, count in runs])
