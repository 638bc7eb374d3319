"""The queue as a named Ray actor: producers and a trainer in separate processes."""

import os
import signal
import time

import pytest
import ray

from streamrl.buffer import QueueConfig
from streamrl.buffer.actor import INLINE_RETURN_LIMIT, create_queue_actor, fetch_table, get_queue_actor

pytestmark = pytest.mark.ray


def make_producer_class():
    # Defined in a function so that Ray ships the class by value (workers cannot import tests/).
    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, run_name, producer_id, group_size):
            from streamrl.buffer.actor import get_queue_actor

            self.queue = get_queue_actor(run_name)
            self.producer_id, self.group_size = producer_id, group_size

        def run(self, max_groups, per_batch):
            """Generate until the queue closes or `max_groups` are committed; returns committed ids.

            Tokens are stamped with the version current at admission, as a producer that loads the
            newest weights before each batch would."""
            import numpy as np

            from harness.synthetic import synthetic_batch
            from streamrl.buffer import QueueClosed

            rng, done = np.random.default_rng(self.producer_id), []
            try:
                while len(done) < max_groups:
                    wanted = min(per_batch, max_groups - len(done))
                    adm = ray.get(self.queue.admit.remote(self.producer_id, wanted, timeout=1.0))
                    if adm.tickets:
                        versions = [t.admitted_version for t in adm.tickets]
                        batch = synthetic_batch(adm.tickets, self.group_size, version=versions, rng=rng,
                                                response_len=(4, 64))
                        done += ray.get(self.queue.commit.remote(batch))
            except QueueClosed:
                pass
            return done

        def pid(self):
            return os.getpid()

    return Producer


def test_two_producers_and_a_trainer_through_the_named_actor(ray_local):
    config = QueueConfig(group_size=4, groups_per_step=4, max_staleness=1, max_in_flight=16)
    queue = create_queue_actor("actor-test", config)
    Producer = make_producer_class()
    producers = [Producer.remote("actor-test", i, 4) for i in range(2)]
    runs = [p.run.remote(1000, 3) for p in producers]
    consumed = []
    for step in range(6):
        got = ray.get(queue.get.remote(timeout=30))
        assert got is not None, (step, str(ray.get(queue.status.remote())))
        assert max(got.staleness) <= 1  # over-budget groups are regenerated, never trained on
        table = fetch_table(got)
        assert table.num_rows == 16
        consumed += table.column("group_id").to_pylist()[::4]
        ray.get(queue.set_version.remote(step + 1))
    ray.get(queue.close.remote())
    produced = sum(ray.get(runs), [])
    status = ray.get(get_queue_actor("actor-test").status.remote())
    assert len(set(consumed)) == len(consumed) == status["consumed"] == 24
    assert set(consumed) <= set(produced) and len(set(produced)) == len(produced) == status["committed"]
    assert status["committed"] == status["consumed"] + status["queued_groups"] + status["over_budget"]
    ray.kill(queue)


def test_committed_batches_survive_their_producer(ray_local):
    config = QueueConfig(group_size=2, groups_per_step=3, max_staleness=0, max_in_flight=3)
    queue = create_queue_actor("ownership-test", config)
    producer = make_producer_class().remote("ownership-test", 7, 2)
    produced = ray.get(producer.run.remote(3, 3))
    os.kill(ray.get(producer.pid.remote()), signal.SIGKILL)  # the producer dies right after its commit
    time.sleep(0.5)
    got = ray.get(queue.get.remote(timeout=10))
    table = fetch_table(got)  # the bytes are owned by the queue actor, not by the dead producer
    assert sorted(set(table.column("group_id").to_pylist())) == sorted(produced)
    ray.kill(queue)


def test_unknown_run_is_a_clear_error(ray_local):
    with pytest.raises(ValueError, match="no running streamrl run named 'nope'"):
        get_queue_actor("nope")


def test_checkpoint_through_the_actor_fetches_the_payloads(ray_local, tmp_path):
    from streamrl.buffer import load_queue

    config = QueueConfig(group_size=2, groups_per_step=2, max_staleness=1, max_in_flight=4)
    queue = create_queue_actor("ckpt-test", config)
    ray.get(make_producer_class().remote("ckpt-test", 1, 2).run.remote(3, 3))
    path = ray.get(queue.checkpoint.remote(str(tmp_path / "ckpt")))
    assert load_queue(path).status()["queued_groups"] == 3
    restored = create_queue_actor("ckpt-restored", config, restore_from=path)
    assert ray.get(restored.status.remote())["queued_groups"] == 3
    assert fetch_table(ray.get(restored.get.remote(timeout=5))).num_rows == 4
    ray.kill(queue), ray.kill(restored)


def test_the_queues_errors_reach_a_remote_caller_as_themselves(ray_local):
    """A producer calls the queue over Ray: a refused batch must arrive as a BatchError naming the column
    and row (it arrived as Ray's 'failed to deserialize exception'), an expired ticket as TicketExpired,
    a revoked lease as LeaseRevoked — so callers can tell them apart."""
    from harness.synthetic import synthetic_batch
    from streamrl.buffer import BatchError, LeaseRevoked
    from streamrl.buffer.queue import TicketExpired

    queue = create_queue_actor("errors-test", QueueConfig(group_size=2, groups_per_step=1, max_staleness=1,
                                                          ticket_timeout_s=0.3))
    lease = ray.get(queue.register_producer.remote(0))
    tickets = ray.get(queue.admit.remote(0, 2, None, 0.0, lease)).tickets
    with pytest.raises(BatchError) as refused:
        ray.get(queue.commit.remote(synthetic_batch(tickets[:1], 2, version=5)))
    assert refused.value.column == "versions" and refused.value.row == 0 and "outside [0, trainer version 0]" in str(refused.value)
    time.sleep(0.4)
    with pytest.raises(TicketExpired, match="have expired") as expired:
        ray.get(queue.commit.remote(synthetic_batch(tickets[:1], 2)))
    assert expired.value.expired == (tickets[0].ticket_id,)  # which groups, across the process boundary
    ray.get(queue.abandon_producer.remote(0))
    with pytest.raises(LeaseRevoked, match="declared dead"):
        ray.get(queue.admit.remote(0, 1, None, 0.0, lease))
    ray.kill(queue)


def make_outbox_producer_class():
    """A producer on the producers' own path (`RemoteQueue.commit`: the queue takes the batch from the
    producer's outbox as the return value of its own call)."""
    @ray.remote(num_cpus=0, max_concurrency=2)
    class OutboxProducer:
        def __init__(self, run_name, producer_id=3):
            from streamrl.buffer.actor import get_queue_actor
            from streamrl.runtime.clients import RemoteQueue

            self.id = producer_id
            self.client = RemoteQueue(get_queue_actor(run_name), producer_id)

        def take_batch(self, key):
            return self.client.outbox.take(key)

        def commit_one(self, groups=2, group_size=2, response_len=16):
            from harness.synthetic import synthetic_batch

            tickets = self.client.admit(self.id, groups, timeout=5.0).tickets
            versions = [t.admitted_version for t in tickets]
            ids = self.client.commit(synthetic_batch(tickets, group_size, version=versions,
                                                     response_len=response_len))
            assert not self.client.outbox._batches  # taken by the queue: nothing left behind here
            return ids

        def commit_many(self, n, **batch):
            return [i for _ in range(n) for i in self.commit_one(**batch)]

        def pid(self):
            return os.getpid()

    return OutboxProducer


@pytest.mark.parametrize("response_len", [16, 40_000])
def test_a_batch_committed_through_the_producers_outbox_survives_its_producer(ray_local, response_len):
    """Through the outbox, a batch is stored once, owned by the queue, and readable after a SIGKILL of
    the producer right after the commit: a small one (inlined in the queue's call's return value, then
    put by the queue) and a large one (in the object store, by reference)."""
    OutboxProducer = make_outbox_producer_class()
    config = QueueConfig(group_size=2, groups_per_step=2, max_staleness=0, max_in_flight=2)
    queue = create_queue_actor(f"outbox-test-{response_len}", config)
    producer = OutboxProducer.remote(f"outbox-test-{response_len}")
    committed = ray.get(producer.commit_one.remote(response_len=response_len))
    os.kill(ray.get(producer.pid.remote()), signal.SIGKILL)
    time.sleep(0.5)
    table = fetch_table(ray.get(queue.get.remote(timeout=10)))
    assert sorted(set(table.column("group_id").to_pylist())) == sorted(committed) and table.num_rows == 4
    assert (table.nbytes > 2 * INLINE_RETURN_LIMIT) == (response_len > 16)  # each path taken
    ray.kill(queue)


def test_small_batches_taken_from_producers_do_not_pile_up_in_the_queue_actor(ray_local):
    """Ray keeps a return value small enough to be inlined in the caller's heap and never frees it when
    the last reference to go is a borrower's (the trainer holds a step's groups past `set_version`, where
    the queue drops its own): a queue that kept the returned references grew by every batch it ever
    took. Its private memory must stay flat instead."""
    from harness.chaos.soak import process_memory_mb

    config = QueueConfig(group_size=4, groups_per_step=2, max_staleness=3, max_in_flight=8)
    queue = create_queue_actor("inline-test", config)
    producer = make_outbox_producer_class().remote("inline-test")
    queue_pid = ray.get(queue.pid.remote())

    @ray.remote(num_cpus=0)
    class Trainer:  # the borrower of the queue's references is an actor, as the trainer is
        def __init__(self, run_name):
            self.queue, self.version = get_queue_actor(run_name), 0

        def steps(self, n):
            taken = []
            for _ in range(n):
                step = ray.get(self.queue.get.remote(2, timeout=10))  # held until the next step, as a trainer does
                table = fetch_table(step)
                assert table.nbytes < 100 * 1024  # small enough for Ray to return it inline
                self.version += 1
                ray.get(self.queue.set_version.remote(self.version))
                taken += table.column("group_id").to_pylist()
            return sorted(set(taken))

    trainer = Trainer.remote("inline-test")

    def rounds(n: int) -> None:  # producer and trainer at once, as in a run
        producing, training = producer.commit_many.remote(n, groups=2, group_size=4, response_len=500), \
            trainer.steps.remote(n)
        assert ray.get(training) == sorted(ray.get(producing))

    rounds(100)  # warm-up: imports, allocator arenas
    time.sleep(1.5)  # Ray frees released objects about once a second
    before = process_memory_mb(queue_pid)["anon"]
    rounds(800)  # ~40 MB of batches: all of it would stay if each were kept
    time.sleep(1.5)
    grown = process_memory_mb(queue_pid)["anon"] - before
    # Kept, they would be ~45 MB (measured); without them the allocator's noise is 3-7 MB.
    assert grown < 20, f"the queue actor's private memory grew {grown:.1f} MB over 800 small batches"
    for actor in (queue, producer, trainer):
        ray.kill(actor)
