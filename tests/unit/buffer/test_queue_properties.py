"""Property-based schedules of several producers and one trainer against the real ReplayQueue.

After every step: each prompt ever handed out is exactly one of running, queued, consumed (trained or
in training) or returned; the in-flight cap and the staleness formula hold; consumed groups are within η
unless counted, and taken oldest version first, ties in admission order; admission is paused exactly
while some independent hold is held; a checkpoint-restore round trip at any point, between `get` and
`set_version` included, changes nothing but what a crash must change and loses or duplicates no prompt.
"""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.synthetic import synthetic_batch
from streamrl.buffer import BatchError, QueueConfig, ReplayQueue, assemble, load_queue, save_queue

PRODUCERS = 3
HOLDS = ["operator", "shutdown", "colocated-step"]


class _Fixed:
    """Stands in for hypothesis' `data` when a rule calls another rule with a fixed choice."""

    def __init__(self, value):
        self.value = value

    def draw(self, _strategy):
        return self.value


class QueueSchedule(RuleBasedStateMachine):
    @initialize(
        group_size=st.integers(1, 3), groups_per_step=st.integers(1, 4), max_staleness=st.integers(0, 3),
        extra_in_flight=st.integers(0, 6), capacity_tokens=st.sampled_from([40, 200, 100_000]),
        over_budget=st.sampled_from(["regenerate", "train"]), seed=st.integers(0, 2**16),
        admission=st.sampled_from(["continuous", "per_step"]), auto=st.booleans(), auto_span=st.integers(0, 3),
    )
    def setup(self, group_size, groups_per_step, max_staleness, extra_in_flight, capacity_tokens, over_budget, seed,
              admission, auto, auto_span):
        # auto: η moves within [auto_min, auto_max] = [max_staleness, max_staleness + auto_span] (`set_eta`)
        self.cfg = QueueConfig(group_size=group_size, groups_per_step=groups_per_step,
                               max_staleness="auto" if auto else max_staleness, auto_min=max_staleness,
                               auto_max=max_staleness + auto_span,
                               max_in_flight=groups_per_step + extra_in_flight, capacity_tokens=capacity_tokens,
                               over_budget=over_budget, vocab_size=32, admission=admission)
        self.eta = self.eta_ever = max_staleness  # in force, and the largest ever in force
        self.admitted_eta = {}  # ticket id -> η in force when it was admitted
        self.queue = ReplayQueue(self.cfg)
        self.rng = np.random.default_rng(seed)
        self.held = {p: {} for p in range(PRODUCERS)}  # producer -> ticket id -> ticket
        self.weights = dict.fromkeys(range(PRODUCERS), 0)
        self.expired = []  # tickets a restore invalidated: committing them must fail
        self.consumed_prompts = []  # trained, or taken by the trainer at the current version
        self.in_training = []  # (group, counted over budget) taken at the current version, not trained yet
        self.consumed_over_budget = 0
        self.tmp = Path(tempfile.mkdtemp(prefix="streamrl-prop-"))
        self.checkpoints = 0
        self.holds = set()

    def teardown(self):
        if hasattr(self, "tmp"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- producers -----------------------------------------------------------------------------
    @rule(producer=st.integers(0, PRODUCERS - 1), n=st.integers(1, 5))
    def admit(self, producer, n):
        paused = self.queue.status()["paused"]
        adm = self.queue.admit(producer, n, weights_version=self.weights[producer])
        if paused:
            assert adm.tickets == [] and adm.blocked_by == "paused"
        if adm.tickets:  # the staleness formula for the η in force, with the producer's weights
            base = min(self.queue.version, self.weights[producer])
            assert self.queue.status()["admitted_live"] <= (base + self.eta + 1) * self.cfg.groups_per_step
        for ticket in adm.tickets:
            self.held[producer][ticket.ticket_id] = ticket
            self.admitted_eta[ticket.ticket_id] = self.eta
            assert ticket.admitted_eta == self.eta

    @rule(producer=st.integers(0, PRODUCERS - 1), k=st.integers(1, 3), data=st.data())
    def commit(self, producer, k, data):
        tickets = list(self.held[producer].values())[:k]
        if not tickets:
            return
        # Tokens carry versions between the producer's weights and the trainer's (in-flight updates).
        newest = data.draw(st.integers(self.weights[producer], self.queue.version))
        batch = synthetic_batch(tickets, self.cfg.group_size, version=self.weights[producer],
                                prompt_len=(1, 4), response_len=(1, 6), rng=self.rng)
        if newest > self.weights[producer]:
            versions = batch.column("versions").values.to_numpy().copy()
            versions[len(versions) // 2:] = newest
            col = batch.column("versions")
            batch = batch.set_column(batch.schema.get_field_index("versions"), batch.schema.field("versions"),
                                     pa.ListArray.from_arrays(col.offsets, pa.array(versions)))
        assert self.queue.commit(batch) == [t.ticket_id for t in tickets]
        for t in tickets:
            del self.held[producer][t.ticket_id]

    @rule(producer=st.integers(0, PRODUCERS - 1))
    def commit_corrupted(self, producer):
        tickets = list(self.held[producer].values())[:1]
        if not tickets:
            return
        batch = synthetic_batch(tickets, self.cfg.group_size, version=self.queue.version + 1, rng=self.rng)
        before = self.queue.status()
        with pytest.raises(BatchError):
            self.queue.commit(batch)
        after = self.queue.status()
        after["rejected_batches"] -= 1
        assert after == before

    @precondition(lambda self: self.expired)
    @rule()
    def commit_expired(self):
        ticket = self.expired.pop()
        with pytest.raises(BatchError, match="expired"):
            self.queue.commit(synthetic_batch([ticket], self.cfg.group_size, rng=self.rng))

    @rule(producer=st.integers(0, PRODUCERS - 1))
    def abandon_one(self, producer):
        if self.held[producer]:
            ticket_id = next(iter(self.held[producer]))
            self.queue.abandon([ticket_id])
            del self.held[producer][ticket_id]

    @rule(producer=st.integers(0, PRODUCERS - 1))
    def producer_dies(self, producer):
        assert sorted(self.queue.abandon_producer(producer)) == sorted(self.held[producer])
        self.held[producer].clear()

    @rule(producer=st.integers(0, PRODUCERS - 1))
    def fetch_weights(self, producer):
        self.weights[producer] = self.queue.version

    @rule(rounds=st.integers(1, 4))
    def fast_producer_overtakes(self, rounds):
        # The last producer keeps up with the trainer while the others sit on their tickets: long
        # generations finishing out of order, the way groups end up over the staleness budget.
        fast = PRODUCERS - 1
        for _ in range(rounds):
            self.fetch_weights(fast)
            self.admit(fast, 5)
            while self.held[fast]:
                self.commit(fast, 3, _Fixed(self.weights[fast]))
            self.train_step()

    @rule(rounds=st.integers(1, 4))
    def straggler(self, rounds):
        # A group started early finishes after the trainer moved on: it must be over budget or within it.
        self.admit(0, 1)
        self.fast_producer_overtakes(rounds)
        self.commit(0, 1, _Fixed(self.weights[0]))
        self.train_step()

    def budget(self, group_id):
        """A group may reach the η in force at its admission, or the η in force now if larger (lowering η
        is an admission-side change: it recalls nothing)."""
        return max(self.admitted_eta[group_id], self.eta)

    # ---- trainer and operator ------------------------------------------------------------------
    @precondition(lambda self: not self.in_training)
    @rule()
    def take_step(self):
        queued = [(g.min_version, g.group_id) for g in self.queue.queued_groups()]
        got = self.queue.get(timeout=0)
        if got is None:
            return
        assert got.version == self.queue.version and len(got.groups) == self.cfg.groups_per_step
        # oldest version first, equal versions in admission (ticket) order, whatever the commit order
        eligible = sorted(k for k in queued if self.cfg.over_budget == "train"
                          or self.queue.version - k[0] <= self.budget(k[1]))
        assert [(g.min_version, g.group_id) for g in got.groups] == eligible[:len(got.groups)]
        assert got.max_staleness == max(self.budget(g.group_id) for g in got.groups)  # the bound they are held to
        for group, age in zip(got.groups, got.staleness):
            over = age > self.budget(group.group_id)
            self.consumed_prompts.append(group.prompt_id)
            self.consumed_over_budget += over
            self.in_training.append((group, over))
        assert assemble(got.groups).num_rows == self.cfg.groups_per_step * self.cfg.group_size

    @precondition(lambda self: self.in_training)
    @rule()
    def finish_step(self):
        self.in_training.clear()
        self.queue.set_version(self.queue.version + 1)

    @rule()
    def train_step(self):
        if not self.in_training:
            self.take_step()
        if self.in_training:
            self.finish_step()

    @precondition(lambda self: self.cfg.auto)
    @rule(data=st.data())
    def set_eta(self, data):
        """The auto controller moves η (any η of the range, at any moment: between get and set_version too)."""
        self.eta = data.draw(st.integers(self.cfg.auto_min, self.cfg.auto_max))
        self.queue.set_max_staleness(self.eta)
        self.eta_ever = max(self.eta_ever, self.eta)
        assert self.queue.status()["max_staleness"] == self.eta

    @rule(name=st.sampled_from(HOLDS))
    def pause(self, name):
        assert self.queue.pause(name) is (name in self.holds)
        self.holds.add(name)

    @rule(name=st.sampled_from(HOLDS))
    def resume(self, name):
        assert self.queue.resume(name) is (name in self.holds)
        self.holds.discard(name)

    @rule()
    def checkpoint_and_restore(self):
        before = self.queue.status()
        queued = self.queue.queued_groups()
        running = sum(len(h) for h in self.held.values())
        taken = len(self.in_training)
        taken_over = sum(over for _, over in self.in_training)
        path = save_queue(self.queue, self.tmp / f"ckpt-{self.checkpoints}")
        self.checkpoints += 1
        self.queue = load_queue(path)
        after = self.queue.status()
        # A restore is a crash: running groups are gone, their prompts come back, their tickets expire;
        # groups the trainer took but had not trained are queued again (the weights saved lack them).
        expected = dict(before, running=0, abandoned=before["abandoned"] + running,
                        returned_prompts=before["returned_prompts"] + running,
                        admitted_live=before["admitted_live"] - running,
                        consumed=before["consumed"] - taken, in_training=0,
                        queued_groups=before["queued_groups"] + taken,
                        queued_tokens=before["queued_tokens"] + sum(g.num_tokens for g, _ in self.in_training),
                        over_budget=before["over_budget"] - taken_over,
                        queued_staleness=after["queued_staleness"],
                        admission_budget=after["admission_budget"], blocked_by=after["blocked_by"])
        assert after == expected
        restored = self.queue.queued_groups()
        requeued = sorted([*queued, *(g for g, _ in self.in_training)], key=lambda g: (g.min_version, g.group_id))
        assert [g.group_id for g in restored] == [g.group_id for g in requeued]
        assert [g.admitted_eta for g in restored] == [g.admitted_eta for g in requeued]  # budgets survive
        if requeued:
            assert assemble(restored).equals(assemble(requeued))
        for group, over in self.in_training:
            self.consumed_prompts.remove(group.prompt_id)
            self.consumed_over_budget -= over
        self.in_training.clear()
        for held in self.held.values():
            self.expired.extend(held.values())
            held.clear()

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def every_prompt_is_in_exactly_one_place(self):
        if not hasattr(self, "queue"):
            return
        running = [t.prompt_id for t in self.queue.running_tickets()]
        assert sorted(running) == sorted(t.prompt_id for h in self.held.values() for t in h.values())
        queued = [g.prompt_id for g in self.queue.queued_groups()]
        places = running + queued + self.consumed_prompts + self.queue.returned_prompts()
        assert sorted(places) == list(range(self.queue.status()["prompt_cursor"]))

    @invariant()
    def paused_exactly_while_some_hold_is_held(self):
        if not hasattr(self, "queue"):
            return
        s = self.queue.status()
        assert s["paused"] is bool(self.holds) and s["holds"] == sorted(self.holds)

    @invariant()
    def admission_limits_hold(self):
        if not hasattr(self, "queue"):
            return
        s = self.queue.status()
        assert s["running"] <= self.cfg.max_in_flight
        # admitted under the largest η in force so far (a lowered η closes admission, it recalls nothing)
        assert s["admitted_live"] <= (s["version"] + self.eta_ever + 1) * self.cfg.groups_per_step
        assert s["max_staleness"] == self.eta
        if self.cfg.admission == "per_step":  # running groups never span two steps' batches
            assert s["running"] <= self.cfg.groups_per_step

    @invariant()
    def staleness_over_budget_is_counted(self):
        if not hasattr(self, "queue"):
            return
        s = self.queue.status()
        if self.cfg.over_budget == "train":
            assert self.consumed_over_budget == s["over_budget"]
        else:
            assert self.consumed_over_budget == 0
        if self.cfg.over_budget == "regenerate":  # every queued group within the budget it is held to
            for group in self.queue.queued_groups():
                assert self.queue.version - group.min_version <= self.budget(group.group_id)


QueueSchedule.TestCase.settings = settings(
    max_examples=500, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_queue_schedules = QueueSchedule.TestCase
