import itertools
import threading
import time

import numpy as np
import pytest

from harness.synthetic import synthetic_batch
from streamrl.buffer import LeaseRevoked, QueueClosed, QueueConfig, ReplayQueue
from streamrl.buffer.queue import TicketExpired, TrainGroups
from streamrl.buffer.staleness import admission_budget


def fill(queue, n, producer=0, version=None, rng=None):
    """Admit and commit n groups; returns their ids."""
    tickets = queue.admit(producer, n).tickets
    assert len(tickets) == n
    v = queue.version if version is None else version
    return queue.commit(synthetic_batch(tickets, queue.config.group_size, version=v, rng=rng))


def test_staleness_formula_bounds_admission():
    cfg = QueueConfig(group_size=1, groups_per_step=4, max_staleness=2, max_in_flight=1000)
    queue = ReplayQueue(cfg)
    assert len(queue.admit(0, 100).tickets) == (0 + 2 + 1) * 4
    assert queue.admit(0, 1).blocked_by == "staleness"
    assert admission_budget(trainer_version=1, max_staleness=2, groups_per_step=4, admitted_live=12) == 4


def test_groups_trained_in_admission_order_respect_the_budget(rng):
    # One producer always holding the newest weights: no consumed group is ever over budget.
    cfg = QueueConfig(group_size=2, groups_per_step=3, max_staleness=2, max_in_flight=1000)
    queue = ReplayQueue(cfg)
    worst = 0
    for _step in range(10):
        adm = queue.admit(0, 1000, weights_version=queue.version)
        if adm.tickets:
            queue.commit(synthetic_batch(adm.tickets, 2, version=queue.version, rng=rng))
        got = queue.get(timeout=0)
        worst = max(worst, *got.staleness)
        queue.set_version(queue.version + 1)
    assert worst == 2 and queue.status()["over_budget"] == 0


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_producers_with_lagging_weights_never_produce_over_budget_groups(eta):
    # Fast producers that load new weights late (w = v - lag) and race ahead; groups are stamped with
    # the weights they held and consumed oldest first. Budgeting on the trainer's version instead of
    # w would let such groups reach staleness eta + 1 (they would be regenerated: over_budget > 0).
    import numpy as np

    rng = np.random.default_rng(eta)
    cfg = QueueConfig(group_size=2, groups_per_step=4, max_staleness=eta, max_in_flight=1000)
    queue = ReplayQueue(cfg)
    consumed = 0
    for _step in range(60):
        for producer in range(3):
            held = max(0, queue.version - int(rng.integers(0, eta + 1)))
            adm = queue.admit(producer, int(rng.integers(1, 6)), weights_version=held)
            if adm.tickets:
                queue.commit(synthetic_batch(adm.tickets, 2, version=held, rng=rng))
        got = queue.get(timeout=0)
        if got is None:  # every producer was refused (stale weights): they load the newest and go on
            adm = queue.admit(0, cfg.groups_per_step, weights_version=queue.version)
            queue.commit(synthetic_batch(adm.tickets, 2, version=queue.version, rng=rng))
            got = queue.get(timeout=0)
        assert max(got.staleness) <= eta
        consumed += len(got.groups)
        queue.set_version(queue.version + 1)
    assert queue.status()["over_budget"] == 0 and consumed == 60 * cfg.groups_per_step


def test_a_producer_behind_on_weights_gets_fewer_slots():
    cfg = QueueConfig(group_size=1, groups_per_step=4, max_staleness=1, max_in_flight=1000)
    queue = ReplayQueue(cfg)
    queue.set_version(3)
    assert queue.admit(0, 100, weights_version=2).tickets.__len__() == (2 + 1 + 1) * 4
    started = time.monotonic()
    lagging = queue.admit(0, 100, weights_version=2, timeout=5.0)
    assert lagging.tickets == [] and lagging.blocked_by == "stale_weights"
    assert time.monotonic() - started < 1.0  # only newer weights help: refused at once, not after the timeout
    assert len(queue.admit(1, 100, weights_version=3).tickets) == 4  # the newest weights open more


def test_in_flight_cap_capacity_and_stale_weights(rng):
    cfg = QueueConfig(group_size=2, groups_per_step=2, max_staleness=4, max_in_flight=3, capacity_tokens=100)
    queue = ReplayQueue(cfg)
    adm = queue.admit(0, 10)
    assert len(adm.tickets) == 3 and adm.blocked_by == "in_flight"
    queue.commit(synthetic_batch(adm.tickets, 2, prompt_len=10, response_len=10, rng=rng))  # 120 tokens
    assert queue.admit(0, 1).blocked_by == "capacity"
    queue.get(timeout=0)
    queue.set_version(5)
    assert queue.admit(0, 1, weights_version=0).blocked_by == "stale_weights"
    assert len(queue.admit(0, 1, weights_version=1).tickets) == 1


def test_a_capacity_below_one_steps_tokens_still_lets_a_batch_form(rng):
    """Admission stopped at the capacity with fewer groups queued than a step takes and none running:
    the trainer waited for a batch that could never form (`streamrl launch --set queue.capacity_tokens=1000`
    failed with NoBatchError after get_timeout_s; outside review)."""
    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=4, max_staleness=4, max_in_flight=8,
                                    capacity_tokens=50))
    first = queue.admit(0, 2).tickets
    queue.commit(synthetic_batch(first, 2, prompt_len=10, response_len=10, rng=rng))  # 80 tokens ≥ 50
    second = queue.admit(0, 8)
    assert len(second.tickets) == 2  # just what the step still lacks
    assert queue.admit(0, 1).blocked_by == "capacity"  # four groups queued or running: the step will form
    queue.commit(synthetic_batch(second.tickets, 2, prompt_len=10, response_len=10, rng=rng))
    assert len(queue.get(timeout=0).groups) == 4
    assert len(queue.admit(0, 8).tickets) == 8  # drained below the capacity: the in-flight cap binds


def test_pause_and_resume_act_on_one_named_hold_and_are_idempotent():
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1))
    assert queue.pause() is False and queue.pause() is True  # the operator's hold, taken twice
    assert queue.admit(0, 1).tickets == [] and queue.admit(0, 1).blocked_by == "paused"
    assert queue.status()["holds"] == ["operator"]
    assert queue.resume() is True and queue.resume() is False
    assert len(queue.admit(0, 1).tickets) == 1
    for bad in ("", "Operator", "has space", "x" * 65, 3):
        with pytest.raises(ValueError, match="admission hold name"):
            queue.pause(bad)
    assert queue.status()["holds"] == []


def _interleavings(pausers):
    """Every order of the events 'p takes its hold' and 'p releases it' (each take before its release)."""
    events = [(p, kind) for p in range(pausers) for kind in ("pause", "resume")]
    for order in itertools.permutations(events):
        if all(order.index((p, "pause")) < order.index((p, "resume")) for p in range(pausers)):
            yield order


@pytest.mark.parametrize("pausers", [2, 3])
def test_independent_holds_compose_in_every_interleaving(pausers):
    """The launcher's shutdown, the operator and a colocated step pause independently: admission is
    paused exactly while some hold is held, whatever the order (a saved-flag resume let the last
    pauser's resume undo another's pause)."""
    names = ["operator", "shutdown", "colocated-step"][:pausers]
    orders = list(_interleavings(pausers))
    assert len(orders) == {2: 6, 3: 90}[pausers]
    for order in orders:
        queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_in_flight=1000, max_staleness=1000))
        held = set()
        for pauser, kind in order:
            assert getattr(queue, kind)(names[pauser]) is (names[pauser] in held)
            (held.add if kind == "pause" else held.discard)(names[pauser])
            status = queue.status()
            assert status["paused"] is bool(held) and status["holds"] == sorted(held), order
            admitted = queue.admit(0, 1)
            assert (admitted.blocked_by == "paused") is bool(held) and len(admitted.tickets) == (not held), order


def test_abandoned_prompts_are_generated_again_and_free_their_slot(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=2, max_staleness=0, max_in_flight=2))
    first = queue.admit(0, 2).tickets
    assert queue.admit(0, 1).tickets == []
    queue.abandon([first[0].ticket_id])
    again = queue.admit(1, 1).tickets
    assert [t.prompt_id for t in again] == [first[0].prompt_id] and again[0].ticket_id != first[0].ticket_id
    assert queue.abandon_producer(0) == [first[1].ticket_id]
    assert queue.returned_prompts() == [first[1].prompt_id]
    queue.abandon([first[0].ticket_id, first[1].ticket_id])  # already taken back: nothing more happens
    assert queue.returned_prompts() == [first[1].prompt_id] and queue.status()["abandoned"] == 2


def test_giving_back_a_ticket_that_is_not_running_is_refused_and_changes_nothing(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_staleness=3, max_in_flight=8))
    committed, running, consumed = queue.admit(0, 3).tickets
    queue.commit(synthetic_batch([consumed], 1, rng=rng))
    queue.get(timeout=0)
    queue.commit(synthetic_batch([committed], 1, rng=rng))
    before = queue.status()
    for ids, message in (([running.ticket_id, running.ticket_id], "name a ticket twice"),
                         ([running.ticket_id, committed.ticket_id], f"ticket {committed.ticket_id} is queued"),
                         ([consumed.ticket_id], f"ticket {consumed.ticket_id} is consumed"),
                         ([running.ticket_id, 99], "ticket 99 is unknown")):
        with pytest.raises(ValueError, match=message):
            queue.abandon(ids)
        assert queue.status() == before


def test_a_commit_of_an_expired_ticket_says_so_and_its_producer_can_give_the_rest_back(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_in_flight=8, ticket_timeout_s=0.2))
    (slow,) = queue.admit(0, 1).tickets
    time.sleep(0.3)
    (fresh,) = queue.admit(0, 1).tickets  # the slow ticket expired on the way
    with pytest.raises(TicketExpired, match=rf"tickets \[{slow.ticket_id}\] have expired") as refused:
        queue.commit(synthetic_batch([slow, fresh], 1, rng=rng))
    assert refused.value.expired == (slow.ticket_id,)
    assert fresh.prompt_id == slow.prompt_id  # the expired group's prompt was generated again first
    queue.abandon([slow.ticket_id, fresh.ticket_id])
    assert queue.returned_prompts() == [slow.prompt_id] and queue.status()["running"] == 0


def test_a_producer_commits_the_groups_whose_tickets_did_not_expire(rng):
    """One expired ticket sent its finished siblings back too: a batch's worth of generation lost."""
    from streamrl.rollout import commit_or_give_back

    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=2, max_in_flight=8, ticket_timeout_s=0.2))
    slow = queue.admit(0, 2).tickets
    time.sleep(0.3)
    fresh = queue.admit(0, 3).tickets  # the first two expired on the way, their prompts admitted again
    tickets = [*slow, *fresh]
    batch = synthetic_batch(tickets, 2, rng=rng)
    assert commit_or_give_back(queue, batch, [t.ticket_id for t in tickets]) == [t.ticket_id for t in fresh]
    status = queue.status()
    assert status["committed"] == 3 and status["running"] == 0 and status["abandoned"] == 2
    assert sorted(g.group_id for g in queue.queued_groups()) == [t.ticket_id for t in fresh]
    assert commit_or_give_back(queue, synthetic_batch(slow, 2, rng=rng), [t.ticket_id for t in slow]) == []


def test_ticket_timeout_expires_running_groups(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, ticket_timeout_s=0.05))
    tickets = queue.admit(0, 2).tickets
    time.sleep(0.1)
    assert queue.status()["running"] == 0 and queue.status()["abandoned"] == 2
    assert queue.ticket_state(tickets[0].ticket_id) == "abandoned"


def test_an_expiring_ticket_wakes_a_blocked_admitter(rng):
    """A ticket that times out frees its slot: an admitter blocked on the in-flight cap gets it then,
    not when its own wait runs out."""
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_in_flight=1, ticket_timeout_s=0.3))
    (stuck,) = queue.admit(0, 1).tickets
    started = time.monotonic()
    adm = queue.admit(1, 1, timeout=20)
    waited = time.monotonic() - started
    assert [t.prompt_id for t in adm.tickets] == [stuck.prompt_id] and queue.ticket_state(stuck.ticket_id) == "abandoned"
    assert waited < 10, f"the admitter waited {waited:.1f} s for a slot that opened after 0.3 s"


def test_a_revoked_lease_refuses_admissions_even_one_already_waiting(rng):
    """A dead producer's admission that Ray still runs after the driver gave its tickets back must not
    issue tickets nobody holds (they would keep admission slots forever)."""
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_staleness=5, max_in_flight=1))
    lease = queue.register_producer(0)
    (first,) = queue.admit(0, 1, lease=lease).tickets
    outcome = {}

    def dead_producers_admit():  # sent before the producer died, waiting for a slot
        try:
            outcome["admission"] = queue.admit(0, 1, lease=lease, timeout=20)
        except LeaseRevoked as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=dead_producers_admit)
    waiter.start()
    time.sleep(0.1)
    assert queue.abandon_producer(0) == [first.ticket_id]  # frees the slot the waiter wants
    waiter.join(timeout=10)
    assert "lease" in str(outcome.get("error")) and queue.status()["running"] == 0
    with pytest.raises(LeaseRevoked, match="was declared dead"):
        queue.admit(0, 1, lease=lease)
    with pytest.raises(LeaseRevoked, match="was declared dead"):
        queue.admit(0, 1)  # a registered producer must show its lease
    replacement = queue.register_producer(0)
    assert [t.prompt_id for t in queue.admit(0, 1, lease=replacement).tickets] == [first.prompt_id]
    with pytest.raises(LeaseRevoked, match="no lease"):
        queue.admit(5, 1, lease=99)
    assert queue.admit(5, 1).blocked_by == "in_flight"  # a caller that never registered is not fenced


def test_equal_versions_are_consumed_in_admission_order(rng):
    """Commit order would favour fast, short groups; ties go to the group admitted first."""
    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=2, max_staleness=10, max_in_flight=100))
    t = queue.admit(0, 4).tickets
    queue.commit(synthetic_batch([t[1], t[2]], 2, rng=rng))
    assert [g.group_id for g in queue.get(2, timeout=0).groups] == [t[1].ticket_id, t[2].ticket_id]
    queue.set_version(1)
    t += queue.admit(0, 2, weights_version=1).tickets
    for ticket, version in ((t[5], 1), (t[4], 1), (t[3], 0)):
        queue.commit(synthetic_batch([ticket], 2, version=version, rng=rng))
    assert [g.group_id for g in queue.get(2, timeout=0).groups] == [t[3].ticket_id, t[4].ticket_id]


def test_the_slow_group_of_a_tie_is_not_the_one_regenerated(rng):
    """η = 2, B = 1: two groups of version 0 meet at version 2 and only one fits the budget. The one
    admitted first is trained; under commit order the slow one (admitted first, committed last) was
    thrown away every time."""
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_staleness=2, max_in_flight=100))
    slow, fast, first = queue.admit(0, 3).tickets
    queue.commit(synthetic_batch([first], 1, rng=rng))
    queue.get(timeout=0)
    queue.set_version(1)
    (later,) = queue.admit(1, 1, weights_version=1).tickets
    queue.commit(synthetic_batch([later], 1, version=1, rng=rng))
    queue.get(timeout=0)
    queue.set_version(2)
    queue.commit(synthetic_batch([fast], 1, rng=rng))
    queue.commit(synthetic_batch([slow], 1, rng=rng))
    got = queue.get(timeout=0)
    assert [g.group_id for g in got.groups] == [slow.ticket_id] and got.staleness == [2]
    queue.set_version(3)
    assert queue.ticket_state(fast.ticket_id) == "regenerated" and queue.returned_prompts() == [fast.prompt_id]


def test_get_takes_oldest_version_first(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=2, max_staleness=3, max_in_flight=100))
    queue.set_version(2)
    new = fill(queue, 2, version=2, rng=rng)
    old = fill(queue, 1, version=1, rng=rng)
    got = queue.get(timeout=0)
    assert [g.group_id for g in got.groups] == old + new[:1]
    assert got.staleness == [1, 0]


@pytest.mark.parametrize("policy", ["regenerate", "train"])
def test_over_budget_groups_are_counted_never_silent(rng, policy):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_staleness=1, over_budget=policy))
    ids = fill(queue, 2, rng=rng)
    queue.get(timeout=0)
    left_tokens = queue.status()["queued_tokens"]
    queue.set_version(2)  # the remaining group, sampled at 0, is now 2 versions old
    status = queue.status()
    if policy == "regenerate":
        assert status["over_budget"] == 1 and status["queued_groups"] == 0
        assert status["regenerated_tokens"] == left_tokens > 0  # how long the dropped groups were
        assert queue.returned_prompts() == [1] and queue.ticket_state(ids[1]) == "regenerated"
    else:
        got = queue.get(timeout=0)
        assert got.staleness == [2] and queue.status()["over_budget"] == 1


def test_get_blocks_until_enough_groups_then_times_out(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=2, max_staleness=1))
    fill(queue, 1, rng=rng)
    t0 = time.monotonic()
    assert queue.get(timeout=0.1) is None
    assert time.monotonic() - t0 >= 0.09
    tickets = queue.admit(0, 1).tickets
    threading.Timer(0.05, lambda: queue.commit(synthetic_batch(tickets, 1, rng=rng))).start()
    got = queue.get(timeout=5)
    assert got is not None and len(got.groups) == 2


def test_close_wakes_every_waiter():
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_staleness=0, max_in_flight=1))
    queue.admit(0, 1)
    errors = []

    def wait(call):
        try:
            call()
        except QueueClosed as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(lambda: queue.get(timeout=30),)),
               threading.Thread(target=wait, args=(lambda: queue.admit(1, 1, timeout=30),))]
    for t in threads:
        t.start()
    time.sleep(0.05)
    queue.close()
    for t in threads:
        t.join(timeout=2)
    assert len(errors) == 2 and not any(t.is_alive() for t in threads)


def test_admit_waits_for_a_slot_freed_by_the_trainer(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, max_staleness=0, max_in_flight=4))
    fill(queue, 1, rng=rng)

    def train_one_step():
        queue.get(timeout=1)
        queue.set_version(1)

    threading.Timer(0.05, train_one_step).start()
    adm = queue.admit(0, 4, weights_version=1, timeout=5)
    assert len(adm.tickets) == 1 and adm.tickets[0].admitted_version == 1


def test_version_never_goes_back(queue):
    queue.set_version(3)
    with pytest.raises(ValueError, match="version 2 is older than the current version 3"):
        queue.set_version(2)


@pytest.mark.parametrize("version", [4.5, np.int64(4), True])
def test_a_version_that_is_not_an_int_is_refused_and_changes_nothing(queue, version):
    """Accepted, 4.5 made the admission budget a float (the next `admit` raised TypeError) and an
    np.int64 made the queue's snapshot unwritable as JSON."""
    queue.set_version(3)
    before = queue.status()
    with pytest.raises(TypeError, match="not an int"):
        queue.set_version(version)
    assert queue.status() == before and queue.admit(0, 1).tickets


def test_bad_arguments_are_refused(queue):
    with pytest.raises(ValueError, match="max_groups must be >= 1"):
        queue.admit(0, 0)
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        queue.get(0)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_staleness"):
        QueueConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="a synchronous step could never be filled"):
        QueueConfig(groups_per_step=8, max_in_flight=4, max_staleness=0)
    with pytest.raises(ValueError, match="max_stalness"):
        QueueConfig(max_stalness=1)


def test_per_step_admission_hands_out_whole_batches_behind_a_barrier(rng):
    cfg = QueueConfig(group_size=2, groups_per_step=4, max_staleness=1, max_in_flight=100, admission="per_step")
    queue = ReplayQueue(cfg)
    first = queue.admit(0, 3).tickets + queue.admit(1, 3).tickets
    assert len(first) == 4  # one step's batch, across producers
    blocked = queue.admit(0, 1)
    assert blocked.tickets == [] and blocked.blocked_by == "batch"
    queue.commit(synthetic_batch(first[:3], 2, rng=rng))
    assert queue.admit(0, 1).blocked_by == "batch"  # the straggler holds the next batch back
    queue.commit(synthetic_batch(first[3:], 2, rng=rng))
    second = queue.admit(0, 10).tickets
    assert len(second) == 4  # the next batch opens whole (η = 1 allows (0 + 1 + 1) · 4 groups)
    queue.commit(synthetic_batch(second, 2, rng=rng))
    assert queue.admit(0, 1).blocked_by == "staleness"  # and the staleness rule still applies


def test_continuous_admission_has_no_barrier(rng):
    cfg = QueueConfig(group_size=2, groups_per_step=4, max_staleness=1, max_in_flight=100)
    queue = ReplayQueue(cfg)
    tickets = queue.admit(0, 4).tickets
    queue.commit(synthetic_batch(tickets[:3], 2, rng=rng))
    assert len(queue.admit(0, 10).tickets) == 4  # a straggler does not hold anyone back


def test_assemble_keeps_group_order_and_joins_neighbouring_rows_into_one_slice(rng):
    """The table holds every group's rows in the order given, as the groups' own slices would; groups
    that follow each other in one batch share a slice, any other boundary starts a new one."""
    import pyarrow as pa

    from streamrl.buffer import assemble

    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=8, max_staleness=10, max_in_flight=100))
    tickets = queue.admit(0, 8).tickets
    queue.commit(synthetic_batch(tickets[:5], 2, rng=rng))
    queue.commit(synthetic_batch(tickets[5:], 2, rng=rng))
    groups = {g.group_id: g for g in queue.queued_groups()}
    ids = [t.ticket_id for t in tickets]
    for order, slices in (
        (ids, 2),  # two batches, each in row order
        ([ids[0], ids[1], ids[3], ids[4], ids[5]], 3),  # a gap in the first batch
        ([ids[2], ids[1], ids[6], ids[7]], 3),  # rows out of order, then the second batch
        ([ids[4], ids[5]], 2),
    ):
        chosen = [groups[i] for i in order]
        table = assemble(chosen)
        one_slice_each = pa.Table.from_batches([g.payload.slice(g.row_start, g.row_count) for g in chosen])
        assert table.equals(one_slice_each)
        assert table.column("group_id").to_pylist() == [i for i in order for _ in range(2)]
        assert table.column("response_ids").num_chunks == slices


def test_groups_handed_to_the_trainer_cross_a_process_boundary_unchanged_with_each_batch_sent_once(rng):
    """`get`'s answer is pickled as columns (the queue actor's return value): every field of every group
    comes back, in order, and the groups of one batch share one payload, as they did in the queue."""
    import pickle

    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=5, max_staleness=10, max_in_flight=100))
    tickets = queue.admit(0, 5).tickets
    queue.commit(synthetic_batch(tickets[:3], 2, rng=rng))
    queue.set_version(1)
    queue.commit(synthetic_batch(tickets[3:], 2, rng=rng))
    handed = queue.get(timeout=0)
    back = pickle.loads(pickle.dumps(handed))
    assert back == handed  # every field; payloads compared with RecordBatch.equals
    assert back.staleness == [1] * 5 and all(isinstance(g.group_id, int) for g in back.groups)
    assert len({id(g.payload) for g in back.groups}) == 2
    empty = TrainGroups(3, [], [], 2)
    assert pickle.loads(pickle.dumps(empty)) == empty


@pytest.mark.parametrize(("budget", "over_budget", "after"), [(2, "regenerate", 2), ("auto", "regenerate", 8),
                                                             (2, "train", None), ("auto", "train", None)])
def test_a_running_group_is_untrainable_past_the_budget_only_when_over_budget_groups_are_regenerated(
        budget, over_budget, after):
    """Producers stop running groups older than this; under over_budget = "train" the queue trains them,
    so stopping them threw away exactly what the setting keeps."""
    config = QueueConfig(group_size=1, groups_per_step=1, max_staleness=budget, auto_max=8, over_budget=over_budget)
    assert config.untrainable_after == after


def test_the_queue_actor_logs_whether_a_hold_was_already_held_the_right_way_round(caplog):
    """The log read `pause`'s "was it held before" as "did it change": every run's queue.log began with
    "admission paused by shutdown (already held)"."""
    import logging

    from streamrl.buffer.actor import QueueActor

    actor = QueueActor(QueueConfig(group_size=1, groups_per_step=1).model_dump())
    with caplog.at_level(logging.INFO, logger="streamrl"):
        assert [actor.pause("shutdown"), actor.pause("shutdown"), actor.resume("shutdown"),
                actor.resume("shutdown")] == [False, True, True, False]
    assert [r.getMessage() for r in caplog.records] == [
        "admission paused by shutdown", "admission paused by shutdown (already held)",
        "shutdown's hold on admission lifted", "shutdown's hold on admission lifted (it held none)"]
