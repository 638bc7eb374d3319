"""A rollout producer: the loop every engine runs, with no Ray in it.

```
 admit(up to groups_per_batch slots, weights version held) ──► tickets (prompt ids from the queue's cursor)
   └─ none: paused / in-flight / capacity / staleness ─► retry;  stale_weights ─► wait for newer weights
 sampler: G samples per prompt, weights refreshed at every decode-step boundary
 task.reward per sample ─► pack one Arrow batch (one row per sample, groups adjacent) ─► commit
   └─ generation, scoring or commit failed ─► abandon the tickets (their prompts are generated again), re-raise
```
The prompt cursor lives in the queue and advances only by admission; a group that is never
committed gives its prompt back, so nothing is skipped and nothing is generated twice for training.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa

from streamrl import failpoints
from streamrl.buffer.queue import Admission, Ticket, TicketExpired
from streamrl.buffer.schema import build_batch
from streamrl.engine.generation import Generation
from streamrl.tasks import Task
from streamrl.weights.receiver import WeightReceiver

if TYPE_CHECKING:
    from streamrl.engine.sampler import TorchSampler


class QueueClient(Protocol):
    """What a producer needs from the replay queue (the in-process queue or the Ray actor's client)."""

    def admit(self, producer_id: int, max_groups: int, *, weights_version: int | None = None,
              timeout: float = 0.0) -> Admission: ...

    def commit(self, batch: pa.RecordBatch) -> list[int]: ...

    def abandon(self, ticket_ids: list[int]) -> None: ...


def commit_or_give_back(queue: QueueClient, batch: pa.RecordBatch, ticket_ids: list[int]) -> bool:
    """Commit a batch of finished groups; True when it was queued. When the queue had already taken one
    of them back (its ticket expired while it ran), the others go back too and False is returned: the
    run goes on, the prompts are generated again. Any other failure gives them all back and propagates."""
    try:
        queue.commit(batch)
        return True
    except TicketExpired:
        queue.abandon(ticket_ids)
        return False
    except BaseException:
        queue.abandon(ticket_ids)
        raise


def pack_groups(tickets: Sequence[Ticket], prompts: Sequence[Sequence[int]], generation: Generation,
                rewards: np.ndarray, *, group_size: int, producer_id: int, t_start: float,
                t_end: float) -> pa.RecordBatch:
    """One Arrow batch: row r is sample r % G of ticket r // G (the sampler's row order)."""
    rows = len(tickets) * group_size
    prompt_lengths = np.repeat([len(p) for p in prompts], group_size)
    prompt_offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(prompt_lengths, out=prompt_offsets[1:])
    prompt_tokens = np.concatenate([np.tile(np.asarray(p, dtype=np.int32), group_size) for p in prompts])
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


class RolloutProducer:
    def __init__(self, producer_id: int, *, queue: QueueClient, receiver: WeightReceiver, sampler: TorchSampler,
                 task: Task, group_size: int, groups_per_batch: int):
        self.producer_id = producer_id
        self.queue, self.receiver, self.sampler, self.task = queue, receiver, sampler, task
        self.group_size, self.groups_per_batch = group_size, groups_per_batch
        self.stats = {"groups": 0, "samples": 0, "generated_tokens": 0, "generate_s": 0.0, "idle_s": 0.0,
                      "expired_groups": 0}
        self.last_blocked_by: str | None = None

    def refresh(self) -> int:
        """The decode-step boundary hook: switch to staged weights, return the version now in use."""
        self.sampler.model, version = self.receiver.apply(self.sampler.model)
        return version

    def run_once(self, timeout: float = 0.5) -> int:
        """One admit → generate → commit cycle; the number of groups committed (0 when not admitted)."""
        version = self.refresh()
        waited = time.perf_counter()
        admission = self.queue.admit(self.producer_id, self.groups_per_batch, weights_version=version,
                                     timeout=timeout)
        self.last_blocked_by = admission.blocked_by
        if not admission.tickets:
            if admission.blocked_by == "stale_weights":
                self.receiver.wait_newer(version, timeout)
            self.stats["idle_s"] += time.perf_counter() - waited
            return 0
        self.stats["idle_s"] += time.perf_counter() - waited
        tickets = admission.tickets
        ticket_ids = [t.ticket_id for t in tickets]
        try:
            failpoints.hit("producer.generate")
            batch = self.generate(tickets)
        except BaseException:
            self.queue.abandon(ticket_ids)  # the prompts go back; the error propagates
            raise
        if not commit_or_give_back(self.queue, batch, ticket_ids):
            self.stats["expired_groups"] += len(tickets)
            return 0
        failpoints.hit("producer.after_commit")  # committed: its tickets are the queue's now
        self.stats["groups"] += len(tickets)
        return len(tickets)

    def generate(self, tickets: Sequence[Ticket]) -> pa.RecordBatch:
        t_start = time.time()
        started = time.perf_counter()
        prompts = [self.task.prompt(t.prompt_id) for t in tickets]
        generation = self.sampler.generate(prompts, self.refresh, samples_per_prompt=self.group_size)
        rewards = np.array([self.task.reward(tickets[row // self.group_size].prompt_id, generation.response(row))
                            for row in range(len(tickets) * self.group_size)], dtype=np.float32)
        self.stats["generate_s"] += time.perf_counter() - started
        self.stats["samples"] += len(rewards)
        self.stats["generated_tokens"] += len(generation.tokens)
        return pack_groups(tickets, prompts, generation, rewards, group_size=self.group_size,
                           producer_id=self.producer_id, t_start=t_start, t_end=time.time())
