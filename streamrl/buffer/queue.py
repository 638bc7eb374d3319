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

Every prompt id the cursor has handed out is, at every moment, exactly one of: running (in a
ticket), queued, consumed, or returned (waiting to be admitted again). `admitted_live`, the count
the staleness formula uses, is running + queued + consumed: abandoned and regenerated groups give
their slot back, otherwise every abandonment would permanently shrink the budget and the trainer
could starve. The class is thread-safe and holds no Ray: the actor wraps it and stores object
references as payloads.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa

from streamrl.buffer.config import QueueConfig
from streamrl.buffer.staleness import admission_budget, staleness, weights_fresh_enough
from streamrl.buffer.validate import BatchError, GroupSpan, validate_batch

# Ticket states, one byte per ticket id ever issued.
UNKNOWN, RUNNING, QUEUED, CONSUMED, ABANDONED, REGENERATED = range(6)
_STATE_NAMES = ("unknown", "running", "queued", "consumed", "abandoned", "regenerated")


class QueueClosed(RuntimeError):
    """The queue was closed: no more admissions or consumption."""


class Ticket(NamedTuple):
    """The right to generate one group for one prompt. Its id becomes the group's `group_id`."""

    ticket_id: int
    prompt_id: int
    producer_id: int
    admitted_version: int
    admitted_at: float


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
    seq: int  # commit order, to break ties between equal versions
    committed_at: float

    def sort_key(self) -> tuple[int, int]:
        return (self.min_version, self.seq)


@dataclass(frozen=True)
class TrainGroups:
    """Groups handed to the trainer at one version, with the staleness of each."""

    version: int
    groups: list[QueuedGroup]
    staleness: list[int]


class ReplayQueue:
    def __init__(self, config: QueueConfig):
        self.config = config
        # `with self._lock` directly: Condition.__enter__ is a Python-level wrapper around the same lock.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._version = 0
        self._paused = False
        self._closed = False
        self._states = bytearray()  # ticket id -> state
        self._running: OrderedDict[int, Ticket] = OrderedDict()  # admission order
        self._queued: dict[int, QueuedGroup] = {}
        self._heap: list[tuple[int, int, int]] = []  # (min_version, seq, group_id), lazily pruned
        self._queued_tokens = 0
        self._next_prompt = 0
        self._returned: deque[int] = deque()
        self._seq = 0
        self.counters = {"admitted": 0, "committed": 0, "consumed": 0, "abandoned": 0,
                         "over_budget": 0, "rejected_batches": 0}
        self._blocked_by: str | None = None

    # ---- admission -------------------------------------------------------------------------------
    def admit(self, producer_id: int, max_groups: int, *, weights_version: int | None = None,
              timeout: float = 0.0) -> Admission:
        """Admit up to `max_groups` groups; wait up to `timeout` seconds for at least one slot.

        `weights_version` is the policy version the producer holds; a producer more than η versions
        behind is refused until it loads newer weights (the bound is enforced where work starts).
        """
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        deadline = None
        with self._lock:
            while True:
                self._expire_tickets()
                if self._closed:
                    raise QueueClosed("queue closed")
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
                self._cond.wait(remaining)

    def _slots_available(self, weights_version: int | None) -> tuple[int, str | None]:
        cfg = self.config
        if self._paused:
            return 0, "paused"
        if weights_version is not None and not weights_fresh_enough(
                trainer_version=self._version, max_staleness=cfg.max_staleness,
                weights_version=weights_version):
            return 0, "stale_weights"
        if self._queued_tokens >= cfg.capacity_tokens:
            return 0, "capacity"
        in_flight = cfg.max_in_flight - len(self._running)
        rule = dict(trainer_version=self._version, max_staleness=cfg.max_staleness,
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
        return min(budget, in_flight), None

    def _issue(self, producer_id: int, count: int) -> list[Ticket]:
        now, version, tickets = time.time(), self._version, []
        for _ in range(count):
            if self._returned:  # prompts given back are generated again before fresh ones
                prompt_id = self._returned.popleft()
            else:
                prompt_id, self._next_prompt = self._next_prompt, self._next_prompt + 1
            ticket = Ticket(len(self._states), prompt_id, producer_id, version, now)
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
        for span in spans:
            state = self._states[span.group_id] if 0 <= span.group_id < len(self._states) else UNKNOWN
            if state != RUNNING:
                problem = {UNKNOWN: "is unknown", ABANDONED: "has expired (abandoned)",
                           REGENERATED: "has expired (regenerated)"}.get(state, "was already committed")
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

    def _enqueue(self, span: GroupSpan, payload: Any, now: float) -> None:
        del self._running[span.group_id]
        self._states[span.group_id] = QUEUED
        self._add_queued(QueuedGroup(span.group_id, span.prompt_id, span.producer_id, span.min_version,
                                     span.num_tokens, span.row_start, span.row_count, payload, self._seq, now))

    def _add_queued(self, group: QueuedGroup) -> None:
        self._seq = max(self._seq, group.seq) + 1
        self._queued[group.group_id] = group
        self._queued_tokens += group.num_tokens
        heapq.heappush(self._heap, (group.min_version, group.seq, group.group_id))

    def abandon(self, ticket_ids: list[int]) -> None:
        """Give running tickets back: their prompts will be generated again."""
        with self._lock:
            for ticket_id in ticket_ids:
                if ticket_id not in self._running:
                    state = self._states[ticket_id] if 0 <= ticket_id < len(self._states) else UNKNOWN
                    raise ValueError(f"ticket {ticket_id} is {_STATE_NAMES[state]}, not running")
            self._abandon_locked(ticket_ids)

    def abandon_producer(self, producer_id: int) -> list[int]:
        """Abandon every running ticket of a producer (it died or stopped); returns their ids."""
        with self._lock:
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
                    ages = [staleness(self._version, g.min_version) for g in groups]
                    self.counters["consumed"] += wanted
                    # Only reachable with over_budget="train": the others were regenerated above.
                    self.counters["over_budget"] += sum(age > self.config.max_staleness for age in ages)
                    self._cond.notify_all()
                    return TrainGroups(self._version, groups, ages)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _pop_oldest(self) -> QueuedGroup:
        while True:
            _, _, group_id = heapq.heappop(self._heap)
            group = self._queued.pop(group_id, None)
            if group is not None:  # defensive: every removal pops the heap, so none should linger
                self._queued_tokens -= group.num_tokens
                self._states[group_id] = CONSUMED
                return group

    def _handle_over_budget(self) -> None:
        if self.config.over_budget == "train":
            return  # counted when handed out, in get()
        limit = self._version - self.config.max_staleness
        while self._heap and self._heap[0][0] < limit:
            _, _, group_id = heapq.heappop(self._heap)
            group = self._queued.pop(group_id, None)
            if group is None:
                continue
            self._queued_tokens -= group.num_tokens
            self._states[group_id] = REGENERATED
            self._returned.append(group.prompt_id)
            self.counters["over_budget"] += 1
            self._cond.notify_all()

    def set_version(self, version: int) -> None:
        """The trainer finished optimizer step `version` (versions only grow)."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"version {version} is older than the current version {self._version}")
            self._version = version
            self._handle_over_budget()
            self._cond.notify_all()

    @property
    def version(self) -> int:
        return self._version

    # ---- operator controls -------------------------------------------------------------------------
    def pause(self) -> bool:
        """Stop new admissions; returns whether the queue was already paused."""
        with self._lock:
            was_paused, self._paused = self._paused, True
            return was_paused

    def resume(self, was_paused: bool = False) -> None:
        """Restore the state before a `pause()` (`was_paused=True` keeps it paused)."""
        with self._lock:
            self._paused = was_paused
            self._cond.notify_all()

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
                "paused": self._paused,
                "closed": self._closed,
                **self.counters,
                "running": len(self._running),
                "queued_groups": len(self._queued),
                "queued_tokens": self._queued_tokens,
                "admitted_live": self.admitted_live,
                "admission_budget": admission_budget(
                    trainer_version=self._version, max_staleness=self.config.max_staleness,
                    groups_per_step=self.config.groups_per_step, admitted_live=self.admitted_live),
                "blocked_by": self._blocked_by,
                "returned_prompts": len(self._returned),
                "prompt_cursor": self._next_prompt,
                "queued_staleness": dict(sorted(by_staleness.items())),
            }

    # ---- checkpoints -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the state for a checkpoint. Prompts of running groups are listed with
        the returned ones: after a restore they are generated again and their tickets have expired."""
        with self._lock:
            self._expire_tickets()
            return {
                "version": self._version,
                "paused": self._paused,
                "counters": dict(self.counters),
                "prompt_cursor": self._next_prompt,
                "returned_prompts": list(self._returned) + [t.prompt_id for t in self._running.values()],
                "ticket_states": bytes(self._states),
                "groups": sorted(self._queued.values(), key=QueuedGroup.sort_key),
            }

    @classmethod
    def from_snapshot(cls, config: QueueConfig, snap: dict[str, Any]) -> ReplayQueue:
        """Rebuild a queue. The admission counters are re-derived from what is restored (running
        groups are gone), so a resumed run cannot burst past the staleness bound."""
        queue = cls(config)
        queue._version = snap["version"]
        queue._paused = snap["paused"]
        queue.counters.update(snap["counters"])
        queue._next_prompt = snap["prompt_cursor"]
        queue._returned.extend(snap["returned_prompts"])
        states = bytearray(snap["ticket_states"])
        expired = states.count(RUNNING)
        queue._states = states.replace(bytes([RUNNING]), bytes([ABANDONED]))
        queue.counters["abandoned"] += expired
        for group in snap["groups"]:
            queue._add_queued(group)
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


def assemble(groups: list[QueuedGroup], batches: list[pa.RecordBatch] | None = None) -> pa.Table:
    """The rows of `groups` as one table (zero-copy slices). `batches[i]` is the fetched payload of
    `groups[i]` when payloads are references; by default the payloads are the batches."""
    batches = [g.payload for g in groups] if batches is None else batches
    return pa.Table.from_batches([b.slice(g.row_start, g.row_count) for g, b in zip(groups, batches)])
