import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from streamrl.models.hf import load_policy
from streamrl.weights.arrays import load_state_arrays, state_arrays
from streamrl.weights.receiver import WeightReceiver
from streamrl.weights.registry import WeightRegistry


def test_old_versions_are_released_once_no_holder_uses_them():
    reg = WeightRegistry()
    reg.publish(0, "w0")
    assert reg.acquire(holder=0) == (0, "w0") and reg.acquire(holder=1) == (0, "w0")
    reg.publish(1, "w1")
    reg.publish(2, "w2")
    assert reg.status()["stored"] == [0, 2]  # 1 was never held; 0 is still held by both
    assert reg.acquire(0, have=0) == (2, "w2")
    assert reg.status()["stored"] == [0, 2]  # holder 1 still has 0
    assert reg.acquire(1, have=0) == (2, "w2")
    assert reg.status()["stored"] == [2] and reg.released == [1, 0]
    assert reg.acquire(1, have=2) is None  # nothing newer


def test_a_holder_that_leaves_releases_its_version():
    reg = WeightRegistry()
    reg.publish(0, "w0")
    reg.acquire(7)
    reg.publish(1, "w1")
    assert reg.status()["stored"] == [0, 1]
    reg.drop_holder(7)
    assert reg.status()["stored"] == [1]


def test_publishing_an_old_version_is_refused():
    reg = WeightRegistry()
    reg.publish(3, "w3")
    with pytest.raises(ValueError, match="not newer"):
        reg.publish(3, "again")
    assert reg.latest == 3


def test_long_poll_returns_as_soon_as_a_version_is_published():
    reg = WeightRegistry()
    reg.publish(0, "w0")
    threading.Timer(0.2, reg.publish, args=(1, "w1")).start()
    started = time.perf_counter()
    assert reg.acquire(0, have=0, timeout=5.0) == (1, "w1")
    assert time.perf_counter() - started < 2.0
    assert reg.acquire(0, have=1, timeout=0.05) is None


def test_receiver_stages_in_the_background_and_loads_at_apply(tiny_model_dir):
    trainer_model, _ = load_policy(tiny_model_dir)
    producer_model, _ = load_policy(tiny_model_dir)
    reg = WeightRegistry()
    reg.publish(0, state_arrays(trainer_model))
    receiver = WeightReceiver(lambda have, timeout: reg.acquire(0, have, timeout), poll_s=0.05)
    receiver.start()
    try:
        assert receiver.wait_newer(None, timeout=5)
        assert receiver.apply(producer_model) == (producer_model, 0)
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.mul_(1.5)
        reg.publish(1, state_arrays(trainer_model))
        assert receiver.wait_newer(0, timeout=5)
        assert receiver.version == 0  # staged, not loaded until the next decode-step boundary
        assert receiver.apply(producer_model) == (producer_model, 1)
    finally:
        receiver.stop()
    for a, b in zip(trainer_model.state_dict().values(), producer_model.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert [v for _, v in receiver.history] == [0, 1]


def test_double_buffering_swaps_in_a_fully_written_standby(tiny_model_dir):
    trainer_model, _ = load_policy(tiny_model_dir)
    live, _ = load_policy(tiny_model_dir)
    standby, _ = load_policy(tiny_model_dir)
    reg = WeightRegistry()
    reg.publish(0, state_arrays(trainer_model))
    receiver = WeightReceiver(lambda have, timeout: reg.acquire(0, have, timeout), standby=standby)
    assert receiver.fetch_now()
    model, version = receiver.apply(live)
    assert model is standby and version == 0  # a pointer swap; the old live model is the new standby
    assert receiver.apply(model) == (standby, 0)  # nothing newer: no swap
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(1.0)
    reg.publish(1, state_arrays(trainer_model))
    with receiver._standby_lock:  # the poll thread is still writing the standby: keep generating
        receiver._standby_version = 1
        assert receiver.apply(model) == (standby, 0)
    receiver._standby_version = 0
    assert receiver.fetch_now()
    model, version = receiver.apply(model)
    assert model is live and version == 1
    for a, b in zip(trainer_model.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_receiver_reraises_a_failed_fetch():
    def broken(have, timeout):
        raise ConnectionError("weights actor gone")

    receiver = WeightReceiver(broken, poll_s=0.01)
    receiver.start()
    receiver.wait_newer(None, timeout=2)
    receiver.stop()
    with pytest.raises(RuntimeError, match="fetching weights failed"):
        receiver.apply(torch.nn.Linear(1, 1))  # the error surfaces where generation would continue


def test_state_arrays_hold_tied_weights_once_and_reject_mismatches(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    arrays = state_arrays(model)
    assert "lm_head.weight" not in arrays and "model.embed_tokens.weight" in arrays
    bad = dict(arrays, **{"model.norm.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_state_arrays(model, bad)
    with pytest.raises(KeyError, match="not_a_weight"):
        load_state_arrays(model, {"not_a_weight": np.zeros(1, np.float32)})
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    twice = dict(arrays, **{"lm_head.weight": arrays["model.embed_tokens.weight"] + 1})  # an untied exporter's
    with pytest.raises(ValueError, match=r"one tied tensor of the model under several names \['model.embed_tokens"):
        load_state_arrays(model, twice)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_a_model_with_several_empty_tensors_loads_its_own_published_weights():
    """Empty tensors may all report storage address 0: taken for one tied tensor, all but the first were
    left out of the published version, which the model then refused as incomplete."""
    class WithEmptyBuffers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.register_buffer("a", torch.zeros(0))
            self.register_buffer("b", torch.zeros(0, 3))

    arrays = state_arrays(WithEmptyBuffers())
    assert {"a", "b"} <= set(arrays) and arrays["b"].shape == (0, 3)
    load_state_arrays(WithEmptyBuffers(), arrays)


def test_a_version_missing_a_tensor_or_of_another_kind_of_number_is_refused_and_the_model_left_as_it_was(
        tiny_model_dir):
    """Loaded as given, a version without one of the model's tensors left that tensor at the previous
    version under the new version's stamp, and integer arrays were converted into float weights."""
    model, _ = load_policy(tiny_model_dir)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    published = {name: np.full_like(array, 0.5) for name, array in state_arrays(model).items()}
    without_norm = {name: array for name, array in published.items() if name != "model.norm.weight"}
    with pytest.raises(KeyError, match="lack tensors of the model: \\['model.norm.weight'\\]"):
        load_state_arrays(model, without_norm)
    as_integers = dict(published, **{"model.norm.weight": published["model.norm.weight"].astype(np.int32)})
    with pytest.raises(TypeError, match="model.norm.weight: int32"):
        load_state_arrays(model, as_integers)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    # What is allowed: a tied tensor under one of its names (lm_head through the embedding), and a
    # float array into weights of another precision.
    model.to(torch.bfloat16)
    load_state_arrays(model, published)
    assert all((tensor == 0.5).all() for tensor in model.state_dict().values() if tensor.is_floating_point())


@pytest.mark.ray
def test_the_trainer_offers_each_version_to_subscribed_producers_and_forgets_dead_ones(ray_local):
    """One hop to every running producer (`offer_weights`), the registry still announced (late joiners
    long-poll it); a producer found dead is unsubscribed, and the registry learns what a producer has."""
    import ray

    from streamrl.runtime.clients import create_actor
    from streamrl.weights.actor import WeightPublisher, WeightsActor

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self):
            self.offers = []

        def offer_weights(self, version, weights):
            self.offers.append((version, float(ray.get(weights[0])["w"][0])))

        def seen(self):
            return self.offers

    weights = create_actor(WeightsActor, "offer-test", "weights", max_concurrency=4)
    alive, doomed = Producer.remote(), Producer.remote()
    publisher = WeightPublisher(weights)
    try:
        publisher.subscribe(0, alive)
        publisher.subscribe(1, doomed)
        publisher.publish(0, {"w": np.zeros(4, np.float32)})
        ray.get([alive.seen.remote(), doomed.seen.remote()])
        ray.kill(doomed)
        publisher.publish(1, {"w": np.ones(4, np.float32)})
        time.sleep(0.5)
        publisher.publish(2, {"w": np.full(4, 2.0, np.float32)})  # checks the offers of version 1
        time.sleep(0.5)
        assert ray.get(alive.seen.remote()) == [(0, 0.0), (1, 1.0), (2, 2.0)]
        assert list(publisher._subscribers) == [0]  # the dead one was dropped
        assert ray.get(weights.acquire.remote(5, None, 1.0))[0] == 2  # a late joiner long-polls the latest
        assert ray.get(weights.acquire.remote(0, 1, 0.0)) is not None  # and a holder reporting version 1 ...
        status = ray.get(weights.status.remote())
        assert status["held"][0] == 2 and status["latest"] == 2  # ... now holds what it was given
    finally:
        ray.kill(weights)
        ray.kill(alive)


def test_an_offer_that_cannot_be_staged_stops_the_producer_not_the_trainer(tiny_model_dir):
    from streamrl.engine.local_weights import LocalWeights

    model, _ = load_policy(tiny_model_dir)
    registry = WeightRegistry()
    registry.publish(0, state_arrays(model))
    standby, _ = load_policy(tiny_model_dir)  # double-buffered, the default: staging copies into it
    receiver = WeightReceiver(lambda have, timeout: registry.acquire(0, have, timeout), standby=standby)
    receiver.fetch_now()
    weights = LocalWeights(model, receiver)
    weights.refresh()
    wrong_shape = dict(state_arrays(model), **{"model.embed_tokens.weight": np.zeros((2, 2), np.float32)})
    weights.offer(1, wrong_shape, lambda version: None)
    with pytest.raises(RuntimeError, match="fetching weights failed") as raised:
        weights.refresh()
    assert "does not match the model's" in str(raised.value.__cause__)


def test_a_copy_into_the_standby_that_fails_partway_is_never_switched_to(monkeypatch):
    """The standby kept the label of the version it held while the next was copied over it: a copy that
    failed partway (out of memory) left a torn model the next decode step could swap in under that label."""
    import streamrl.weights.receiver as receiver_module
    from streamrl.weights.arrays import ArrayModel

    def version(v):
        return {"a": np.full(4, v, np.float32), "b": np.full(4, v, np.float32)}

    receiver = WeightReceiver(lambda have, timeout: None, standby=ArrayModel(version(0)))
    assert receiver.offer(1, version(1))
    live, in_use = receiver.apply(ArrayModel(version(0)))
    assert in_use == 1 and receiver.offer(2, version(2))  # staged in the standby, not switched to yet
    whole_copy = receiver_module.load_state_arrays

    def fails_after_a(model, arrays):
        whole_copy(model, {"a": arrays["a"], "b": model.arrays["b"]})
        raise MemoryError("out of memory copying b")

    monkeypatch.setattr(receiver_module, "load_state_arrays", fails_after_a)
    with pytest.raises(MemoryError):
        receiver.offer(3, version(3))  # waits SWAP_WAIT_S for the switch to 2, then writes over it
    model, in_use = receiver.apply(live)
    assert model is live and in_use == 1  # neither the torn standby nor a version it no longer holds


def test_the_first_version_is_waited_for_when_a_newer_one_is_being_written_over_it(tiny_model_dir, monkeypatch):
    """A resumed trainer can train from its restored queue and offer v + 1 while a new producer is still
    starting: the standby that held v is being overwritten when the producer first applies. Nothing is in
    use yet, so it waits for the write (before, it kept a live model with no version and failed with
    "no weights were published yet")."""
    import streamrl.weights.receiver as receiver_module

    trainer_model, _ = load_policy(tiny_model_dir)
    live, _ = load_policy(tiny_model_dir)
    standby, _ = load_policy(tiny_model_dir)
    receiver = WeightReceiver(lambda have, timeout: None, standby=standby)
    assert receiver.offer(2, state_arrays(trainer_model))
    writing = threading.Event()
    slow_load = receiver_module.load_state_arrays

    def load_slowly(model, arrays):
        writing.set()
        time.sleep(0.3)
        slow_load(model, arrays)

    monkeypatch.setattr(receiver_module, "load_state_arrays", load_slowly)
    offer = threading.Thread(target=receiver.offer, args=(3, state_arrays(trainer_model)))
    offer.start()
    assert writing.wait(5)
    model, version = receiver.apply(live)
    offer.join()
    assert model is standby and version == 3


def test_a_version_offered_while_sglang_servers_load_the_one_before_still_reaches_them():
    """sglang servers take versions only from their long poll; an offer of version 2 during the load of
    version 1 used to be recorded as held, so the poll then waited for version 3 — forever when the
    trainer was waiting for this very producer's groups (a replaced producer, in CI)."""
    from streamrl.engine.base import accept_offer
    from streamrl.engine.sglang.pool import SglangWeights

    loading = threading.Event()

    class SlowServer:  # what SglangWeights asks of an engine: its version, and a load that takes a while
        version = 0

        def update_weights(self, version, load):
            loading.set()
            time.sleep(0.3)
            self.version = version
            return 0.3

    registry = WeightRegistry()
    registry.publish(1, "v1")
    weights = SglangWeights([SlowServer()], lambda have, timeout: registry.acquire(7, have, timeout),
                            lambda version, handle: None, poll_s=0.1)
    weights.start()
    try:
        assert loading.wait(10)
        registry.publish(2, "v2")
        assert not accept_offer(weights, 2, "v2", lambda version: registry.hold(7, version))
        assert weights.wait_newer(1, timeout=5), "version 2 never reached the servers"
        assert weights.version == 2
    finally:
        weights.stop()


def test_a_long_poll_answers_within_its_grace_while_the_trainer_publishes_faster_than_that():
    """The grace lets an offer arrive first; counted from the newest publish only, a trainer publishing
    every 0.1 s held a 0.5 s grace's answer back for good."""
    registry = WeightRegistry()
    registry.publish(1, "v1")
    publishing = threading.Event()

    def publish_fast():
        version = 2
        while not publishing.is_set():
            registry.publish(version, f"v{version}")
            version += 1
            time.sleep(0.1)

    thread = threading.Thread(target=publish_fast)
    thread.start()
    try:
        started = time.monotonic()
        got = registry.acquire(0, 1, timeout=3.0, grace_s=0.5)
        took = time.monotonic() - started
    finally:
        publishing.set()
        thread.join()
    assert got is not None and got[0] > 1 and 0.4 <= took < 1.5, (got, took)


def slow_copies(monkeypatch, seconds):
    import streamrl.weights.receiver as receiver_module

    load = receiver_module.load_state_arrays

    def load_slowly(model, arrays):
        time.sleep(seconds)
        load(model, arrays)

    monkeypatch.setattr(receiver_module, "load_state_arrays", load_slowly)


def test_offers_overtaken_while_a_slow_copy_runs_are_skipped_and_the_newest_is_switched_to(tiny_model_dir,
                                                                                           monkeypatch):
    """A producer slower to copy than the trainer to publish: each queued offer copied its own version in
    turn, the standby lock free for microseconds between copies, and generation stayed on the first
    version while the trainer ran ahead. Now the offers a newer one overtook are skipped (not fetched,
    not copied), the generating thread gets to switch between copies, and each taken version is held
    (the registry told) before its copy, so the long poll does not fetch it too."""
    trainer_model, _ = load_policy(tiny_model_dir)
    live, _ = load_policy(tiny_model_dir)
    standby, _ = load_policy(tiny_model_dir)
    receiver = WeightReceiver(lambda have, timeout: None, standby=standby)
    assert receiver.offer(0, state_arrays(trainer_model))
    live, version = receiver.apply(live)
    assert version == 0
    slow_copies(monkeypatch, 0.3)
    fetched, held = [], []

    def offer(v):
        receiver.offer(v, lambda: fetched.append(v) or state_arrays(trainer_model), hold=held.append)

    offers = [threading.Thread(target=offer, args=(v,)) for v in range(1, 9)]
    for thread in offers:  # one every 0.05 s: six times faster than a copy
        thread.start()
        time.sleep(0.05)
    switched = []
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in offers) and time.monotonic() < deadline:
        live, version = receiver.apply(live)  # the generating thread's decode steps
        switched.append(version)
        time.sleep(0.02)
    for thread in offers:
        thread.join()
    live, version = receiver.apply(live)
    assert version == 8  # the newest, in the end
    assert len(fetched) <= 4 and fetched[-1] == 8, fetched  # overtaken offers were not fetched
    assert held == fetched  # each taken version was held before its copy
    assert len(set(switched) - {0}) >= 1  # generation moved on while versions kept coming


@pytest.mark.ray
def test_the_long_poll_does_not_fetch_a_version_an_offer_is_still_fetching(ray_local, monkeypatch):
    """The long poll answers a version an offer has not brought within its grace; it read the weights
    before looking whether the version was taken, so an offer's fetch slower than the grace (a large
    model from another node) was transferred twice. The poll's answer is now read only if taken."""
    import ray

    from streamrl.runtime.clients import create_actor, remote_fetch
    from streamrl.weights.actor import WeightsActor

    weights = create_actor(WeightsActor, "lazy-poll-test", "weights", max_concurrency=4)
    try:
        ray.get(weights.publish.remote(0, [ray.put({"w": np.zeros(4, np.float32)})]))
        receiver = WeightReceiver(remote_fetch(weights, 0, grace_s=0.2))
        assert receiver.fetch_now(timeout=5.0)  # version 0, the first, by the long poll
        new = ray.put({"w": np.ones(4, np.float32)})
        ray.get(weights.publish.remote(1, [new]))
        reads, real_get = [], ray.get

        def counting_get(refs, *args, **kwargs):
            if isinstance(refs, ray.ObjectRef) and refs == new:
                reads.append(threading.current_thread().name)
            return real_get(refs, *args, **kwargs)

        monkeypatch.setattr(ray, "get", counting_get)

        def slow_fetch():  # the offer's fetch outlasts the poll's grace
            time.sleep(0.6)
            return ray.get(new)

        offer = threading.Thread(target=receiver.offer, args=(1, slow_fetch), name="offer")
        offer.start()
        time.sleep(0.05)
        assert not receiver.fetch_now(timeout=3.0)  # answered after the grace, the version already taken
        offer.join()
        assert reads == ["offer"] and receiver.status()["staged"] == 1
    finally:
        ray.kill(weights)


@pytest.mark.ray
def test_producers_on_the_trainers_machine_get_versions_through_shared_memory(ray_local):
    """A producer that gave a shared-memory address on this machine gets each version without a Ray call;
    once its socket is gone it gets Ray offers; one on another machine only ever gets Ray offers."""
    import ray

    from streamrl.runtime.clients import create_actor
    from streamrl.weights.actor import WeightPublisher, WeightsActor

    @ray.remote(num_cpus=0, max_concurrency=3)
    class Producer:
        def __init__(self):
            from streamrl.engine.local_weights import LocalWeights
            from streamrl.runtime.actors import shared_weights_listener

            def model():
                module = torch.nn.Module()
                module.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
                return module

            self.weights = LocalWeights(model(), WeightReceiver(lambda have, timeout: None, standby=model()))
            self.held, self.ray_offers = [], []
            self.listener = shared_weights_listener(self.weights, self.held.append,
                                                    ray.get_runtime_context().get_node_id())
            self.listener.start()

        def address(self):
            return self.listener.address

        def offer_weights(self, version, weights):
            self.ray_offers.append(version)
            self.weights.offer(version, weights, self.held.append)

        def loaded(self, version):
            assert self.weights.wait_newer(version - 1, 10.0)
            self.weights.refresh()
            return self.weights.version, float(self.weights.model.w[0]), list(self.ray_offers), list(self.held)

        def stop_listening(self):
            self.listener.stop()

    weights = create_actor(WeightsActor, "shared-offer-test", "weights", max_concurrency=4)
    local, remote = Producer.remote(), Producer.remote()
    publisher = WeightPublisher(weights)
    try:
        publisher.subscribe(0, local, ray.get(local.address.remote()))
        elsewhere = dataclasses.replace(ray.get(remote.address.remote()), node="another-node")
        publisher.subscribe(1, remote, elsewhere)
        publisher.publish(1, {"w": np.ones(4, np.float32)})
        assert ray.get(local.loaded.remote(1)) == (1, 1.0, [], [1])  # no Ray offer: through shared memory
        assert ray.get(remote.loaded.remote(1)) == (1, 1.0, [1], [1])
        ray.get(local.stop_listening.remote())
        publisher.publish(2, {"w": np.full(4, 2.0, np.float32)})
        assert ray.get(local.loaded.remote(2)) == (2, 2.0, [2], [1, 2])  # its socket gone: a Ray offer
        publisher.publish(3, {"w": np.full(4, 3.0, np.float32)})
        assert ray.get(local.loaded.remote(3))[:3] == (3, 3.0, [2, 3])
    finally:
        publisher.close()
        for actor in (weights, local, remote):
            ray.kill(actor)


@pytest.mark.ray
def test_a_failed_announcement_of_a_shared_memory_version_is_raised_by_the_next_publish(ray_local):
    """With producers reading shared memory, the object store's copy and the announcement to the weights
    actor are made in the background: their failure still reaches the trainer, at its next publish."""
    import ray

    from streamrl.runtime.clients import create_actor
    from streamrl.weights.actor import WeightPublisher, WeightsActor
    from streamrl.weights.shared_memory import SharedWeightsListener

    weights = create_actor(WeightsActor, "shared-announce-test", "weights", max_concurrency=4)
    offers = []
    listener = SharedWeightsListener(lambda version, arrays: offers.append(version),
                                     node=ray.get_runtime_context().get_node_id())
    listener.start()
    publisher = WeightPublisher(weights)
    try:
        publisher.subscribe(0, None, listener.address)  # reached through shared memory only: no actor needed
        publisher.publish(1, {"w": np.ones(4, np.float32)})
        publisher.publish(2, {"w": np.full(4, 2.0, np.float32)})
        assert ray.get(weights.status.remote())["latest"] >= 1  # announced in the background
        ray.kill(weights)
        with pytest.raises(ray.exceptions.RayActorError):  # 2's announcement, or 3's, found it dead
            publisher.publish(3, {"w": np.full(4, 3.0, np.float32)})
            publisher.publish(4, {"w": np.full(4, 4.0, np.float32)})
        deadline = time.time() + 10
        while len(offers) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert offers[:2] == [1, 2]
    finally:
        listener.stop()
        publisher.close()
