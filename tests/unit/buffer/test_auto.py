"""`queue.max_staleness = "auto"`: the controller's decisions from step metrics, and the queue putting
an η in force (refused outside the range, a lowered η regenerating what it leaves over budget)."""

import numpy as np
import pytest

from harness.synthetic import synthetic_batch
from streamrl.buffer import QueueConfig, ReplayQueue
from streamrl.buffer.auto import AutoStaleness

AUTO = QueueConfig(group_size=2, groups_per_step=2, max_in_flight=8, max_staleness="auto", auto_min=1, auto_max=4,
                   auto_cooldown=2, auto_smoothing=1.0)  # no smoothing: each decision reads its own step
ON_POLICY = {"ess": 0.99, "kl_behavior_proximal": 0.001, "clipped_fraction": 0.01, "masked_fraction": 0.0}


def step(wait_s=0.5, step_s=1.0, **signals):
    return {**ON_POLICY, "trainer_wait_s": wait_s, "step_s": step_s, **signals}


def test_a_starved_trainer_raises_eta_one_step_per_cooldown_up_to_auto_max():
    auto = AutoStaleness(AUTO)
    assert auto.eta == AUTO.auto_min == AUTO.eta_start
    decisions = [auto.update(step()) for _ in range(10)]
    assert [d.eta for d in decisions] == [1, 2, 2, 3, 3, 4, 4, 4, 4, 4]
    assert [d.reason for d in decisions[:3]] == ["cooldown", "starved", "cooldown"]
    assert decisions[1].signals["wait_fraction"] == 0.5


@pytest.mark.parametrize("off", [{"ess": 0.5}, {"kl_behavior_proximal": 0.3}, {"masked_fraction": 0.2}])
def test_off_policy_data_lowers_eta_down_to_auto_min_even_while_starved(off):
    auto = AutoStaleness(AUTO, eta=4)
    decisions = [auto.update(step(**off)) for _ in range(8)]
    assert [d.eta for d in decisions] == [4, 3, 3, 2, 2, 1, 1, 1]
    assert {d.reason for d in decisions} <= {"off_policy", "cooldown"}


def test_a_fed_trainer_keeps_eta_and_a_step_without_timing_decides_nothing():
    auto = AutoStaleness(AUTO, eta=2)
    assert [auto.update(step(wait_s=0.0)).reason for _ in range(3)] == ["steady"] * 3 and auto.eta == 2
    fresh = AutoStaleness(AUTO, eta=2)  # nothing is decided before a step has said how long the trainer waited
    assert fresh.update({"ess": 0.1}).reason == "no_signal" and fresh.eta == 2


def test_a_fed_trainer_tries_one_less_every_probe_steps_down_to_auto_min():
    """A budget the trainer does not need only makes the data older: the controller lowers it."""
    auto = AutoStaleness(AUTO.model_copy(update={"auto_probe_steps": 3}), eta=4)
    decisions = [auto.update(step(wait_s=0.0)) for _ in range(12)]
    assert [d.eta for d in decisions] == [4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1]
    assert [d.reason for d in decisions if d.reason != "steady"] == ["idle", "idle", "idle"]
    assert AutoStaleness(AUTO, eta=4).update(step(wait_s=0.02)).reason == "steady"  # between wait_low and wait_min


def test_a_probe_that_starves_the_trainer_sets_a_floor_until_it_expires():
    config = AUTO.model_copy(update={"auto_probe_steps": 2, "auto_cooldown": 1})
    auto = AutoStaleness(config, eta=3)
    fed, starved = step(wait_s=0.0), step(wait_s=0.5)
    assert [auto.update(fed).eta for _ in range(2)] == [3, 2]  # a probe
    assert auto.update(starved).reason == "starved" and auto.eta == 3  # it starved: back, 3 is the floor
    floor_held = [auto.update(fed) for _ in range(10)]  # 5 × probe_steps
    assert {d.eta for d in floor_held} == {3} and {d.reason for d in floor_held} == {"steady"}
    assert auto.update(fed).reason == "idle" and auto.eta == 2  # expired: probed again
    again = AutoStaleness(config)
    again.restore(auto.state())
    assert again.state() == auto.state()


def test_signals_are_smoothed_so_one_bad_step_does_not_move_eta():
    auto = AutoStaleness(AUTO.model_copy(update={"auto_smoothing": 0.2}), eta=3)
    for _ in range(4):
        auto.update(step(wait_s=0.0))
    assert auto.update(step(wait_s=0.0, ess=0.7)).eta == 3  # smoothed ESS 0.93: within bounds


def test_the_controller_state_round_trips_and_an_impossible_eta_is_refused():
    auto = AutoStaleness(AUTO)
    for _ in range(3):
        auto.update(step())
    again = AutoStaleness(AUTO)
    again.restore(auto.state())
    assert again.state() == auto.state()
    assert [again.update(step()).eta for _ in range(3)] == [auto.update(step()).eta for _ in range(3)]
    with pytest.raises(ValueError, match=r"outside \[auto_min, auto_max\] = \[1, 4\]"):
        again.restore({**auto.state(), "eta": 9})


@pytest.mark.parametrize("field, bad, message", [
    ("since_change", "x", r"auto_staleness.since_change: 'x' is malformed"),
    ("smoothed", [1, 2], r"auto_staleness.smoothed: \[1, 2\] is malformed"),
    ("floor", None, r"auto_staleness.floor: None is malformed"),
    ("eta", None, r"auto_staleness: the saved state has no 'eta'"),
])
def test_a_malformed_saved_state_is_refused_naming_the_field_and_changes_nothing(field, bad, message):
    """η and the smoothed signals were set before a later field failed to parse, with int()'s own message."""
    saved = AutoStaleness(AUTO)
    saved.update(step(ess=0.5))
    auto = AutoStaleness(AUTO)
    before = auto.state()
    state = {**saved.state(), "eta": 3, field: bad}
    if bad is None and field == "eta":
        del state["eta"]
    with pytest.raises(ValueError, match=message):
        auto.restore(state)
    assert auto.state() == before


def test_the_queue_refuses_an_eta_outside_the_range_or_for_a_fixed_budget_and_changes_nothing():
    queue = ReplayQueue(AUTO)
    before = queue.status()
    for bad in (0, 5, 2.0, True, "3"):
        with pytest.raises(ValueError, match="outside"):
            queue.set_max_staleness(bad)
    assert queue.status() == before
    with pytest.raises(ValueError, match="fixed at 1"):
        ReplayQueue(QueueConfig(group_size=2, groups_per_step=2, max_staleness=1)).set_max_staleness(1)


def test_a_lowered_eta_recalls_nothing_and_holds_the_groups_admitted_after_it_to_the_new_budget():
    """Lowering η is an admission-side change: what was admitted under the old η keeps that budget (its
    generation is not thrown away); admission follows the new η at once, and so does what it admits."""
    queue = ReplayQueue(AUTO)
    queue.set_max_staleness(3)
    rng = np.random.default_rng(0)
    old = queue.admit(0, 2, weights_version=0).tickets  # long generations, started at version 0 under η = 3
    for version in (1, 2, 3):  # the trainer moves on without them (others feed it)
        fresh = queue.admit(1, 2, weights_version=version - 1).tickets
        queue.commit(synthetic_batch(fresh, 2, version=version - 1, rng=rng))
        assert queue.get(2, timeout=0) is not None
        queue.set_version(version)
    queue.set_max_staleness(1)
    assert queue.admit(1, 2, weights_version=1).blocked_by == "stale_weights"  # 2 versions behind: refused now
    late = queue.admit(1, 2, weights_version=3).tickets  # admitted under η = 1
    assert [t.admitted_eta for t in old] == [3, 3] and [t.admitted_eta for t in late] == [1, 1]
    queue.commit(synthetic_batch(old, 2, rng=rng))  # they end, 3 versions old: within the η they were admitted under
    status = queue.status()
    assert status["queued_staleness"] == {3: 2} and status["over_budget"] == 0 and queue.returned_prompts() == []
    got = queue.get(2, timeout=0)
    assert [g.group_id for g in got.groups] == [t.ticket_id for t in old] and got.max_staleness == 3
    queue.set_version(4)
    queue.commit(synthetic_batch(late, 2, version=2, rng=rng))  # sampled by version 2: 2 old, over η = 1
    status = queue.status()
    assert status["over_budget"] == 2 and status["queued_groups"] == 0  # held to the new budget: regenerated
    assert sorted(queue.returned_prompts()) == sorted(t.prompt_id for t in late)
