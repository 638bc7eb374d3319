import threading
import time

import pytest

from streamrl.buffer import QueueClosed, QueueConfig, ReplayQueue
from streamrl.buffer.staleness import admission_budget
from streamrl.buffer.synthetic import synthetic_batch


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


def test_pause_returns_previous_state_and_resume_restores_it():
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1))
    assert queue.pause() is False
    assert queue.admit(0, 1).tickets == [] and queue.admit(0, 1).blocked_by == "paused"
    was_paused = queue.pause()
    assert was_paused is True
    queue.resume(was_paused)  # an inner pause/resume pair must not unpause the outer one
    assert queue.status()["paused"] is True
    queue.resume()
    assert len(queue.admit(0, 1).tickets) == 1


def test_abandoned_prompts_are_generated_again_and_free_their_slot(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=2, max_staleness=0, max_in_flight=2))
    first = queue.admit(0, 2).tickets
    assert queue.admit(0, 1).tickets == []
    queue.abandon([first[0].ticket_id])
    again = queue.admit(1, 1).tickets
    assert [t.prompt_id for t in again] == [first[0].prompt_id] and again[0].ticket_id != first[0].ticket_id
    assert queue.abandon_producer(0) == [first[1].ticket_id]
    assert queue.returned_prompts() == [first[1].prompt_id]
    with pytest.raises(ValueError, match="ticket 0 is abandoned, not running"):
        queue.abandon([0])


def test_ticket_timeout_expires_running_groups(rng):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1, ticket_timeout_s=0.05))
    tickets = queue.admit(0, 2).tickets
    time.sleep(0.1)
    assert queue.status()["running"] == 0 and queue.status()["abandoned"] == 2
    assert queue.ticket_state(tickets[0].ticket_id) == "abandoned"


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
    queue.set_version(2)  # the remaining group, sampled at 0, is now 2 versions old
    status = queue.status()
    if policy == "regenerate":
        assert status["over_budget"] == 1 and status["queued_groups"] == 0
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
