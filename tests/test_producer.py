import time

import pytest

from streamrl.buffer import QueueConfig, ReplayQueue, validate_batch
from streamrl.engine.sampler import TorchSampler
from streamrl.models.hf import load_policy
from streamrl.rollout import RolloutProducer
from streamrl.tasks.reverse import EOS, ReverseDigits
from streamrl.weights.arrays import state_arrays
from streamrl.weights.receiver import WeightReceiver
from streamrl.weights.registry import WeightRegistry


def make_producer(model_dir, queue, registry, task=None, producer_id=0, groups_per_batch=3):
    model, _ = load_policy(model_dir)
    receiver = WeightReceiver(lambda have, timeout: registry.acquire(producer_id, have, timeout))
    receiver.fetch_now()
    sampler = TorchSampler(model, pad_id=0, stop_ids=[EOS], max_new_tokens=4, seed=producer_id)
    return RolloutProducer(producer_id, queue=queue, receiver=receiver, sampler=sampler,
                           task=task or ReverseDigits(2), group_size=queue.config.group_size,
                           groups_per_batch=groups_per_batch)


@pytest.fixture
def setup(tiny_model_dir):
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=3, max_staleness=1, max_in_flight=8, vocab_size=17))
    registry = WeightRegistry()
    model, _ = load_policy(tiny_model_dir)
    registry.publish(0, state_arrays(model))
    return queue, registry


def test_committed_batches_are_valid_scored_groups_in_cursor_order(tiny_model_dir, setup):
    queue, registry = setup
    task = ReverseDigits(2)
    producer = make_producer(tiny_model_dir, queue, registry, task=task)
    assert producer.run_once() == 3
    got = queue.get(3, timeout=0)
    table = got.groups[0].payload
    validate_batch(table, group_size=4, trainer_version=0)
    assert sorted(g.prompt_id for g in got.groups) == [0, 1, 2]
    for row in table.to_pylist():
        assert row["prompt_ids"] == task.prompt(row["prompt_id"])
        assert row["reward"] == pytest.approx(task.reward(row["prompt_id"], row["response_ids"]))
        assert set(row["versions"]) == {0}


def test_a_failed_generation_gives_the_prompts_back(tiny_model_dir, setup):
    queue, registry = setup

    class Exploding(ReverseDigits):
        def reward(self, prompt_id, response_ids):
            raise ArithmeticError("reward service down")

    producer = make_producer(tiny_model_dir, queue, registry, task=Exploding(2))
    with pytest.raises(ArithmeticError, match="reward service down"):
        producer.run_once()
    status = queue.status()
    assert status["running"] == 0 and status["abandoned"] == 3 and status["returned_prompts"] == 3
    healthy = make_producer(tiny_model_dir, queue, registry, producer_id=1)
    assert healthy.run_once() == 3  # the same prompts, generated again
    assert sorted(g.prompt_id for g in queue.get(3, timeout=0).groups) == [0, 1, 2]


def test_a_producer_with_stale_weights_waits_for_newer_ones(tiny_model_dir, setup):
    queue, registry = setup
    producer = make_producer(tiny_model_dir, queue, registry)
    queue.set_version(2)  # the trainer moved on; the producer still holds version 0 (η = 1)
    assert producer.run_once(timeout=0.05) == 0 and producer.last_blocked_by == "stale_weights"
    model, _ = load_policy(tiny_model_dir)
    registry.publish(2, state_arrays(model))
    producer.receiver.fetch_now()
    assert producer.run_once() > 0
    assert producer.receiver.version == 2


def test_a_group_that_outlived_its_ticket_is_dropped_and_the_producer_goes_on(tiny_model_dir, setup, monkeypatch):
    """With `ticket_timeout_s` the queue takes a slow group's prompt back while it runs; its commit is
    then refused as expired. The producer gives the batch's other tickets back and carries on (it used
    to give back a ticket the queue already held, which raised and stopped the run)."""
    _, registry = setup
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=3, max_staleness=1, max_in_flight=8,
                                    vocab_size=17, ticket_timeout_s=0.2))
    producer = make_producer(tiny_model_dir, queue, registry)
    generate = producer.generate

    def slow_first_batch(tickets):
        monkeypatch.setattr(producer, "generate", generate)
        time.sleep(0.3)  # every ticket of this batch expires meanwhile
        return generate(tickets)

    monkeypatch.setattr(producer, "generate", slow_first_batch)
    assert producer.run_once() == 0 and producer.stats["expired_groups"] == 3
    assert queue.status()["running"] == 0 and queue.status()["returned_prompts"] == 3
    assert producer.run_once() == 3  # the same prompts, generated again
    assert sorted(g.prompt_id for g in queue.get(3, timeout=0).groups) == [0, 1, 2]
