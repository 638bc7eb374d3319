"""The one producer over the torch engine, against the real queue and weights registry (no Ray): valid
scored groups, failures that give prompts back, stale weights, expired tickets, doomed groups stopped."""

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from streamrl.buffer import QueueConfig, ReplayQueue, validate_batch
from streamrl.engine.local_weights import LocalWeights
from streamrl.engine.torch_engine import TorchEngine
from streamrl.models.hf import load_policy
from streamrl.rollout import RolloutProducer
from streamrl.tasks.reverse import EOS, ReverseDigits
from streamrl.weights.arrays import state_arrays
from streamrl.weights.receiver import WeightReceiver
from streamrl.weights.registry import WeightRegistry


def make_producer(model_dir, queue, registry, task=None, producer_id=0, groups=3, max_staleness=None,
                  admit_timeout=0.05):
    model, _ = load_policy(model_dir)
    receiver = WeightReceiver(lambda have, timeout: registry.acquire(producer_id, have, timeout), poll_s=0.05)
    engine = TorchEngine(LocalWeights(model, receiver), pad_id=0, stop_ids=[EOS], max_new_tokens=4,
                         capacity=groups * queue.config.group_size, seed=producer_id)
    return RolloutProducer(producer_id, queue=queue, engine=engine, task=task or ReverseDigits(2),
                           group_size=queue.config.group_size, max_staleness=max_staleness,
                           admit_timeout=admit_timeout)


@contextmanager
def running(producer):
    stop, errors = threading.Event(), []

    def run():
        try:
            producer.run(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()


def errors_once_failed(producer, timeout=30.0):
    """Run `producer` until a background call fails (or `timeout`); the errors `run` raised."""
    with running(producer) as errors:
        deadline = time.time() + timeout
        while not errors and time.time() < deadline:
            time.sleep(0.05)
    return errors


@pytest.fixture
def setup(tiny_model_dir):
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=3, max_staleness=1, max_in_flight=8, vocab_size=17))
    registry = WeightRegistry()
    model, _ = load_policy(tiny_model_dir)
    registry.publish(0, state_arrays(model))
    return queue, registry


def test_committed_groups_are_valid_scored_and_every_prompt_is_accounted_for(tiny_model_dir, setup):
    queue, registry = setup
    task = ReverseDigits(2)
    producer = make_producer(tiny_model_dir, queue, registry, task=task)
    with running(producer) as errors:
        got = queue.get(3, timeout=30)
    assert not errors and got is not None
    for group in got.groups:
        table = group.payload
        validate_batch(table, group_size=4, trainer_version=0)
        for row in table.slice(group.row_start, group.row_count).to_pylist():
            assert row["prompt_ids"] == task.prompt(row["prompt_id"])
            assert row["reward"] == pytest.approx(task.reward(row["prompt_id"], row["response_ids"]))
            assert set(row["versions"]) == {0}
    status = queue.status()
    assert status["running"] == 0  # stopped: what was running went back
    prompts = [g.prompt_id for g in got.groups] + [g.prompt_id for g in queue.queued_groups()] + queue.returned_prompts()
    assert sorted(prompts) == list(range(status["prompt_cursor"]))


def test_a_failed_reward_stops_the_producer_and_gives_its_prompts_back(tiny_model_dir, setup):
    queue, registry = setup

    class Exploding(ReverseDigits):
        def reward(self, prompt_id, response_ids):
            raise ArithmeticError("reward service down")

    producer = make_producer(tiny_model_dir, queue, registry, task=Exploding(2))
    errors = errors_once_failed(producer)
    assert len(errors) == 1 and "reward service down" in str(errors[0])
    status = queue.status()
    assert status["running"] == 0 and status["committed"] == 0
    assert sorted(queue.returned_prompts()) == list(range(status["prompt_cursor"]))
    healthy = make_producer(tiny_model_dir, queue, registry, producer_id=1)
    with running(healthy) as errors:
        got = queue.get(3, timeout=30)  # the same prompts, generated again first
    assert not errors and sorted(g.prompt_id for g in got.groups) == [0, 1, 2]


def test_a_slow_reward_does_not_hold_up_generation(tiny_model_dir, setup):
    """Rewards were scored in the decode loop: a reward function that takes seconds (a verifier, a
    sandbox, up to its timeout) held every running sequence meanwhile. Now finished groups are scored
    on their own thread while the engine goes on with the next ones."""
    queue, registry = setup
    scoring, release = threading.Event(), threading.Event()

    class SlowToScore(ReverseDigits):
        def reward(self, prompt_id, response_ids):
            scoring.set()
            release.wait(10)
            return super().reward(prompt_id, response_ids)

    producer = make_producer(tiny_model_dir, queue, registry, task=SlowToScore(2))
    with running(producer) as errors:
        assert scoring.wait(30)
        steps = producer.stats.decode_steps
        time.sleep(0.5)
        steps_while_scoring = producer.stats.decode_steps - steps
        release.set()
        got = queue.get(3, timeout=30)
    assert not errors and got is not None
    assert steps_while_scoring > 0


def test_a_producer_with_stale_weights_waits_for_newer_ones(tiny_model_dir, setup):
    queue, registry = setup
    producer = make_producer(tiny_model_dir, queue, registry)
    queue.set_version(2)  # the trainer moved on; only version 0 is published (η = 1)
    with running(producer) as errors:
        time.sleep(0.5)
        assert producer.last_blocked_by == "stale_weights" and queue.status()["admitted"] == 0
        model, _ = load_policy(tiny_model_dir)
        registry.publish(2, state_arrays(model))
        got = queue.get(3, timeout=30)
    assert not errors and got is not None and producer.engine.weights.version == 2
    assert all(min(g.payload.column("versions").flatten().to_pylist()) == 2 for g in got.groups)
    # one update while generating, one stall; loading the first version held nothing up and is neither
    assert producer.stats.weight_updates == 1 and len(producer.stalls) == 1


class CountingQueue(ReplayQueue):
    def __init__(self, config):
        super().__init__(config)
        self.admit_calls = 0

    def admit(self, *args, **kwargs):
        self.admit_calls += 1
        return super().admit(*args, **kwargs)


def endless(producer):
    """No stop token in reach of an untrained model: its sequences run until stopped."""
    producer.engine.max_new_tokens = 10_000
    producer.engine._stop_ids = [99]
    return producer


def wait_until(condition, timeout=30.0):
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_producer_refused_for_stale_weights_asks_again_once_newer_ones_are_in_use(tiny_model_dir, monkeypatch):
    """Admission budgets on the version the engine generates with, not on one staged for its next decode
    step. The admit thread waited for newer *staged* weights: from the staging to the switch (up to a
    whole decode step) that wait returned at once, the queue refused again at once, and the producer
    asked the queue (over Ray, a round trip to the one queue actor) in a tight loop."""
    queue = CountingQueue(QueueConfig(group_size=2, groups_per_step=1, max_staleness=0, max_in_flight=4,
                                      vocab_size=17))
    registry = WeightRegistry()
    model, _ = load_policy(tiny_model_dir)
    registry.publish(0, state_arrays(model))
    producer = endless(make_producer(tiny_model_dir, queue, registry, groups=2))
    step, opened, held = producer.engine.step, threading.Event(), threading.Event()
    opened.set()

    def gated_step():  # a long decode step: the staged weights wait for its end
        if not opened.is_set():
            held.set()
            opened.wait(30)
        return step()

    monkeypatch.setattr(producer.engine, "step", gated_step)
    with running(producer) as errors:
        assert wait_until(lambda: queue.status()["admitted"] == 1)  # the budget at version 0: one group
        opened.clear()
        assert held.wait(30)  # the decode loop is inside a step
        queue.set_version(1)  # the trainer moved on: version 0 is stale (η = 0)
        registry.publish(1, state_arrays(model))
        assert wait_until(lambda: producer.engine.weights.status()["staged"] == 1)
        calls, started = queue.admit_calls, time.perf_counter()
        time.sleep(0.5)
        calls, elapsed = queue.admit_calls - calls, time.perf_counter() - started
        assert producer.engine.weights.version == 0 and producer.last_blocked_by == "stale_weights"
        opened.set()  # the step ends: version 1 into use, and the producer is admitted with it
        assert wait_until(lambda: queue.status()["admitted"] == 2)
    assert not errors and producer.engine.weights.version == 1
    assert calls <= elapsed / producer.admit_timeout + 3, f"{calls} admissions asked in {elapsed:.2f} s"


def test_a_producer_waiting_for_newer_weights_wakes_for_them_and_for_a_stop(tiny_model_dir):
    """The wait for newer weights is bounded by `admit_timeout`, but neither the switch to newer weights
    nor a stop waits that long."""
    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=1, max_staleness=0, max_in_flight=4,
                                    vocab_size=17))
    registry = WeightRegistry()
    model, _ = load_policy(tiny_model_dir)
    registry.publish(0, state_arrays(model))
    producer = endless(make_producer(tiny_model_dir, queue, registry, groups=3, admit_timeout=60))
    with running(producer) as errors:  # its exit stops the producer and waits for it (up to 30 s)
        assert wait_until(lambda: queue.status()["admitted"] == 1)
        queue.set_version(1)
        assert wait_until(lambda: producer.last_blocked_by == "stale_weights")
        registry.publish(1, state_arrays(model))
        assert wait_until(lambda: queue.status()["admitted"] == 2)  # not a minute later
        queue.set_version(2)  # stale again, and no newer weights to come
        assert wait_until(lambda: producer.last_blocked_by == "stale_weights")
        stopped = time.perf_counter()
    assert not errors
    assert time.perf_counter() - stopped < 10  # not the rest of admit_timeout


def test_a_group_that_outlived_its_ticket_is_dropped_and_the_producer_goes_on(tiny_model_dir, setup, monkeypatch):
    """With `ticket_timeout_s` the queue takes a slow group's prompt back while it runs; its commit is
    then refused as expired. The producer gives the batch's other tickets back and carries on (it used
    to give back a ticket the queue already held, which raised and stopped the run)."""
    _, registry = setup
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=3, max_staleness=1, max_in_flight=8,
                                    vocab_size=17, ticket_timeout_s=0.3))
    producer = make_producer(tiny_model_dir, queue, registry)
    pack, slowed = producer._pack, []

    def slow_first_pack(groups):  # the first finished groups took longer than their tickets live
        if not slowed:
            slowed.append(len(groups))
            time.sleep(0.4)
        return pack(groups)

    monkeypatch.setattr(producer, "_pack", slow_first_pack)
    with running(producer) as errors:
        steps = [queue.get(3, timeout=30) for _ in range(2)]
    assert not errors and None not in steps
    assert producer.stats.expired_groups >= slowed[0] >= 1
    assert queue.status()["abandoned"] >= slowed[0]  # their prompts went back and were generated again
    # At version 0 the staleness budget admits 6 live groups in all, a prompt given back is admitted again
    # before any new one, and its slot is free again: the 6 trained groups include prompt 0, whichever
    # groups a slow machine let expire (the first 3 need not: others may have been committed first).
    assert 0 in [g.prompt_id for step in steps for g in step.groups]


def test_groups_certain_to_exceed_the_budget_are_stopped_when_weights_move_on(tiny_model_dir):
    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=1, max_staleness=0, max_in_flight=4,
                                    vocab_size=17))
    registry = WeightRegistry()
    model, _ = load_policy(tiny_model_dir)
    registry.publish(0, state_arrays(model))
    producer = make_producer(tiny_model_dir, queue, registry, groups=1, max_staleness=0)
    producer.engine.max_new_tokens = 10_000  # no stop token in reach of an untrained model: runs until stopped
    producer.engine._stop_ids = [99]
    with running(producer) as errors:
        deadline = time.time() + 30
        while producer.engine.active == 0 and time.time() < deadline:
            time.sleep(0.02)
        queue.set_version(1)  # as the trainer does before publishing
        registry.publish(1, state_arrays(model))
        while producer.stats.aborted_groups == 0 and time.time() < deadline:
            time.sleep(0.02)
    assert not errors and producer.stats.aborted_groups >= 1
    assert 0 in queue.returned_prompts() or queue.ticket_state(0) == "abandoned"
    assert np.isfinite(producer.stats.busy_slot_s)


def accounted_for(queue) -> bool:
    """Every prompt the cursor handed out is queued, consumed or given back: none held by a ticket."""
    status = queue.status()
    committed = [g.prompt_id for g in queue.queued_groups()]
    return status["running"] == 0 and sorted(committed + queue.returned_prompts()) == list(range(status["prompt_cursor"]))


def test_a_prompt_the_task_cannot_build_stops_the_producer_and_gives_every_ticket_back(tiny_model_dir, setup):
    """The ticket whose prompt failed was out of the admitted list and not yet running: held for good."""
    queue, registry = setup

    class Unbuildable(ReverseDigits):
        def prompt(self, prompt_id):
            if prompt_id == 1:
                raise ValueError("prompt 1 tokenizes to nothing")
            return super().prompt(prompt_id)

    producer = make_producer(tiny_model_dir, queue, registry, task=Unbuildable(2))
    errors = errors_once_failed(producer)
    assert len(errors) == 1 and "tokenizes to nothing" in str(errors[0])
    assert accounted_for(queue) and 1 in queue.returned_prompts()


def test_a_failure_after_a_commit_gives_back_every_batch_still_waiting(tiny_model_dir, setup, monkeypatch, tmp_path):
    """The commit thread died with the failure and the batches queued behind it kept their tickets."""
    from streamrl import failpoints

    _, registry = setup

    class SlowQueue(ReplayQueue):
        def commit(self, batch, to_payload=None):
            time.sleep(0.2)  # a commit under load: finished batches wait behind it
            return super().commit(batch, to_payload)

    queue = SlowQueue(QueueConfig(group_size=4, groups_per_step=3, max_staleness=100, max_in_flight=8, vocab_size=17))
    monkeypatch.setenv(failpoints.ENV_SPEC, "producer.after_commit=raise@2")
    monkeypatch.setenv(failpoints.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(failpoints, "_hits", {})
    producer = make_producer(tiny_model_dir, queue, registry)
    errors = errors_once_failed(producer)
    assert len(errors) == 1 and isinstance(errors[0], failpoints.FailPointError)
    assert queue.status()["committed"] >= 2 and accounted_for(queue)


def test_a_refused_commit_stays_the_producers_error_when_giving_tickets_back_fails_too(tiny_model_dir, setup):
    """The give-back's error replaced the commit's, whose message names the column and row at fault."""
    from streamrl.buffer import BatchError

    _, registry = setup

    class Unreachable(ReplayQueue):
        def commit(self, batch, to_payload=None):
            raise BatchError("versions", 3, "a token newer than the trainer")

        def abandon(self, ticket_ids):
            raise ConnectionError("queue unreachable")

    queue = Unreachable(QueueConfig(group_size=4, groups_per_step=3, max_staleness=1, max_in_flight=8, vocab_size=17))
    errors = errors_once_failed(make_producer(tiny_model_dir, queue, registry))
    assert len(errors) == 1 and isinstance(errors[0], BatchError), errors
    assert "giving the groups' tickets back failed as well: ConnectionError: queue unreachable" in errors[0].__notes__


def test_a_producer_stopped_before_any_weights_were_published_returns_at_once(tiny_model_dir):
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=3, max_staleness=1, max_in_flight=8))
    producer = make_producer(tiny_model_dir, queue, WeightRegistry())
    stop, errors = threading.Event(), []

    def run():
        try:
            producer.run(stop, first_weights_timeout=60)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.2)
    stopped = time.perf_counter()
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors
    assert time.perf_counter() - stopped < 2  # it waited out first_weights_timeout, then raised TimeoutError
    assert queue.status()["admitted"] == 0
