"""The sglang engine against loopback stand-ins of its servers (tests/fake_sglang.py): the client's
request and response shapes, exact per-token versions across a weight update, per-server updates,
restart after a crash, and the one producer over two servers (samples as coroutines of one event loop)."""

import concurrent.futures
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time

import pytest
from checkout import BENCHMARKS, FAKE_SGLANG

from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine.sglang.engine import EngineLost, EventLoopThread, SglangEngine
from streamrl.engine.sglang.server import ServerProcess, ServerSpec, group_members
from streamrl.net import free_port
from streamrl.sglang.client import SglangClient, SglangError
from streamrl.weights.disk import disk_loader
from streamrl.weights.tensor_handles import tensor_loader

FAKE = FAKE_SGLANG
spec = importlib.util.spec_from_file_location("fake_sglang", FAKE)
fake = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fake)


def start_fake(*flags: str) -> ServerProcess:
    port = free_port()
    server = ServerProcess(ServerSpec(model_path="unused", port=port),
                           command=[sys.executable, str(FAKE), "--port", str(port), *flags], startup_timeout_s=30)
    server.start()
    return server


@pytest.fixture
def server():
    process = start_fake("--token-delay-s", "0.004", "--update-delay-s", "0.3")
    yield process
    process.stop()


def test_a_server_whose_port_another_process_holds_is_refused_naming_the_port():
    """Another server on the port answered this one's health check, so a server that then failed to bind
    and exited passed for started (and its first call got the other server's 401)."""
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = ServerProcess(ServerSpec(model_path="unused", port=port),
                               command=[sys.executable, str(FAKE), "--port", str(port)], startup_timeout_s=30)
        server.port_wait_s = 0.5
        with pytest.raises(RuntimeError, match=f"port {port} is taken by another process"):
            server.start()
        assert server.process is None  # nothing was started
    server.start()  # free again: it starts
    try:
        assert server.alive() and server.healthy()
    finally:
        server.stop()


@pytest.fixture
def weights_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # what update_weights_from_disk loads, for the stand-in
    return tmp_path


@pytest.fixture
def io():
    loop = EventLoopThread()
    yield loop
    loop.close()


def sample(engine: SglangEngine, prompt, **kwargs):
    """One sample from this thread: the coroutine on the engine's event loop, waited for."""
    return engine.io.call(engine.sample(prompt, **kwargs))


def calls(server: ServerProcess) -> list[dict]:
    return SglangClient(server.url).call("/fake/calls", method="GET")["calls"]


def test_the_launch_command_binds_to_loopback_and_sends_token_ids_only():
    command = ServerSpec(model_path="/models/qwen", port=31000, tensor_parallel=2, mem_fraction=0.6,
                         memory_saver=True).command()
    assert command[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(command[3::2], command[4::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--tp-size"] == "2" and flags["--mem-fraction-static"] == "0.6"
    assert "--skip-tokenizer-init" in command and "--enable-memory-saver" in command


def test_generate_returns_tokens_log_probs_and_finish_in_sglang_shapes(io, server):
    engine = SglangEngine(SglangClient(server.url), io)
    got = sample(engine, [1, 2, 3], max_new_tokens=12, temperature=0.8)
    assert len(got.tokens) == len(got.logprobs) == len(got.versions) <= 12
    assert (got.logprobs <= 0).all() and set(got.versions) == {0} and got.segments == 1
    assert got.finish == LENGTH if len(got.tokens) == 12 else STOP
    request = [c for c in calls(server) if c["path"] == "/generate"][0]["body"]
    assert request["input_ids"] == [1, 2, 3] and request["return_logprob"] is True
    assert request["sampling_params"]["max_new_tokens"] == 12 and request["sampling_params"]["no_stop_trim"]
    stopped = sample(engine, [4], max_new_tokens=200, stop_token_ids=list(range(17)))  # every token stops
    assert len(stopped.tokens) == 1 and stopped.finish == STOP


def test_cancelled_samples_are_aborted_on_their_server_from_the_event_loop_without_a_thread(io, server):
    """A stopped group's samples end on the server too; the aborts ran in executor threads before (up to six
    more threads in the producer, which the thread-count test saw in the full suite)."""
    import asyncio

    engine = SglangEngine(SglangClient(server.url), io)
    threads = threading.active_count()
    running = [io.submit(engine.sample([i], max_new_tokens=10_000)) for i in range(8)]  # 40 s each

    async def cancel_all() -> None:
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            task.cancel()

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len([c for c in calls(server) if c["path"] == "/generate"]) < 8:
        time.sleep(0.05)
    io.call(cancel_all())
    for future in running:
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=10)
    sent = {c["body"]["rid"] for c in calls(server) if c["path"] == "/generate"}
    while time.monotonic() < deadline and len([c for c in calls(server) if c["path"] == "/abort_request"]) < 8:
        time.sleep(0.05)
    aborts = [c["body"] for c in calls(server) if c["path"] == "/abort_request"]
    assert {a["rid"] for a in aborts} == sent and len(sent) == 8 and not any(a["abort_all"] for a in aborts)
    assert threading.active_count() == threads
    io.call(engine._close_async())  # noqa: SLF001 - nothing is left pending
    assert not engine._aborts  # noqa: SLF001


def test_a_weight_update_mid_sample_continues_it_and_stamps_every_token_exactly(io, server, weights_dir):
    engine = SglangEngine(SglangClient(server.url), io)
    result = {}
    worker = threading.Thread(target=lambda: result.update(got=sample(engine, [5, 6], max_new_tokens=150)))
    worker.start()
    time.sleep(0.2)  # ~50 tokens in
    engine.update_weights(1, disk_loader(str(weights_dir)))
    worker.join(timeout=30)
    got = result["got"]
    assert len(got.tokens) == 150 and got.segments == 2 and engine.stats["continued"] == 1
    switch = int((got.versions == 0).sum())
    assert 0 < switch < 150 and list(got.versions) == [0] * switch + [1] * (150 - switch)
    # Each token's log-prob is that of the weights it is stamped with (the stand-in's toy model).
    toy, context = fake.ToyModel(17, 0), [5, 6]
    for token, logprob, version in zip(got.tokens, got.logprobs, got.versions):
        probs = toy.distribution("default" if version == 0 else str(version), context, 1.0)
        assert logprob == pytest.approx(math.log(probs[token]), abs=1e-6)
        context.append(int(token))
    sequence = [c["path"] for c in calls(server)]
    assert sequence == ["/generate", "/pause_generation", "/update_weights_from_disk", "/update_weight_version",
                        "/flush_cache", "/continue_generation", "/generate"]
    generates = [c["body"] for c in calls(server) if c["path"] == "/generate"]
    assert generates[1]["input_ids"] == [5, 6, *got.tokens[:switch].tolist()]  # continued, not restarted
    assert generates[1]["sampling_params"]["max_new_tokens"] == 150 - switch


@pytest.mark.parametrize("path", ["disk", "distributed", "tensor"])
def test_updating_one_engine_never_holds_up_another(io, weights_dir, path):
    from streamrl.weights.broadcast import UpdateGroups, distributed_loader

    servers = [start_fake("--token-delay-s", "0.002", "--update-delay-s", "1.0") for _ in range(2)]
    groups = UpdateGroups(timeout_s=30)
    loader = {"disk": lambda: disk_loader(str(weights_dir)),  # a slow load into engine 0
              "distributed": lambda: distributed_loader(groups, mixed_weights(3), 1 << 20),
              "tensor": lambda: tensor_loader(mixed_weights(3), 1 << 20)}[path]()
    try:
        engines = [SglangEngine(SglangClient(s.url), io) for s in servers]
        busy, done, stop = engines[1], [], threading.Event()

        def generate():
            while not stop.is_set():
                sample(busy, [1], max_new_tokens=5)
                done.append(time.monotonic())

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(0.2)
        began = time.monotonic()
        paused = engines[0].update_weights(3, loader)
        ended = time.monotonic()
        stop.set()
        worker.join(timeout=30)
        assert paused >= 1.0  # engine 0 was loading for a second ...
        assert sum(began < t < ended for t in done) >= 10  # ... while engine 1 went on generating
        assert engines[0].version == 3 and engines[1].version == 0
        if path != "disk":
            assert server_digest(servers[0]) == arrays_digest(mixed_weights(3))
    finally:
        groups.close()
        for s in servers:
            s.stop()


def test_a_server_that_dies_is_restarted_with_the_newest_weights_and_the_sample_is_lost(io, server, weights_dir):
    engine = SglangEngine(SglangClient(server.url), io, server=server)
    engine.update_weights(2, disk_loader(str(weights_dir)))
    errors = []

    def long_sample():
        try:
            sample(engine, [1], max_new_tokens=2000)
        except EngineLost as exc:
            errors.append(exc)

    worker = threading.Thread(target=long_sample)
    worker.start()
    time.sleep(0.3)
    os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)
    worker.join(timeout=60)
    assert len(errors) == 1 and server.restarts == 1 and engine.stats["restarts"] == 1
    assert [c["path"] for c in calls(server)][:2] == ["/update_weights_from_disk", "/update_weight_version"]
    after = sample(engine, [1], max_new_tokens=4)  # the new server, on the newest weights
    assert set(after.versions) == {2}


def a_recovery_held_in_its_reload(engine: SglangEngine, server: ServerProcess, weights_dir):
    """Version 2 loaded, the server killed, and a sample that finds it dead (it is lost): the restart's
    reload of version 2 begins once the new server is up, then waits for `go`. (lost sample, go)."""
    reloading, go = threading.Event(), threading.Event()

    def load(client):
        if server.restarts:  # the reload into the restarted server
            reloading.set()
            go.wait(10)
        client.update_weights_from_disk(str(weights_dir))

    engine.update_weights(2, load)
    os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)
    server.process.wait()
    lost = engine.io.submit(engine.sample([1], max_new_tokens=4))
    assert reloading.wait(30)
    return lost, go


def test_a_sample_sent_while_a_restarted_server_reloads_waits_and_runs_on_the_reloaded_weights(io, server,
                                                                                                weights_dir):
    """Before, the gate stayed open while a restart reloaded the weights: a sample sent meanwhile ran on
    the new server's startup weights ("default") and stopped the producer with SglangError."""
    engine = SglangEngine(SglangClient(server.url), io, server=server)
    lost, go = a_recovery_held_in_its_reload(engine, server, weights_dir)
    waiting = io.submit(engine.sample([1], max_new_tokens=4))
    time.sleep(0.3)
    assert not waiting.done() and calls(server) == []  # at the gate: nothing reached the new server
    go.set()
    assert set(waiting.result(timeout=30).versions) == {2}
    with pytest.raises(EngineLost):
        lost.result(timeout=30)
    assert [c["path"] for c in calls(server)] == ["/update_weights_from_disk", "/update_weight_version",
                                                  "/flush_cache", "/generate"]
    assert server.restarts == 1


def test_an_update_that_arrives_during_a_restarts_reload_loads_after_it(io, server, weights_dir):
    """Before, a restart's reload took no lock: an update to version 3 ran inside it, and the reload
    then labelled the server 2 after it (or, had the update come between load and label, weights 2 as 3)."""
    engine = SglangEngine(SglangClient(server.url), io, server=server)
    lost, go = a_recovery_held_in_its_reload(engine, server, weights_dir)
    update = threading.Thread(target=engine.update_weights, args=(3, disk_loader(str(weights_dir))))
    update.start()
    update.join(timeout=1.0)
    assert update.is_alive() and calls(server) == []  # it waits for the reload
    go.set()
    update.join(timeout=30)
    with pytest.raises(EngineLost):
        lost.result(timeout=30)
    labels = [c["body"] for c in calls(server) if c["path"] == "/update_weight_version"]
    assert [label["new_version"] for label in labels] == ["2", "3"] and engine.version == 3
    assert set(sample(engine, [1], max_new_tokens=3).versions) == {3} and server.restarts == 1


def test_server_errors_name_the_problem_and_a_failed_load_leaves_the_version(io, server, tmp_path):
    engine = SglangEngine(SglangClient(server.url), io)
    with pytest.raises(SglangError, match="input_ids must be a non-empty list"):
        sample(engine, [], max_new_tokens=3)
    with pytest.raises(SglangError, match="no model at"):
        engine.update_weights(1, disk_loader(str(tmp_path / "missing")))
    assert engine.version == 0 and engine.stats["updates"] == 0


def test_the_stand_in_refuses_a_request_past_the_context_length_as_sglang_does(io):
    """sglang refuses a prompt + max_new_tokens over its context (streamrl's launch refuses such prompts
    first): a stand-in that accepted it let no CPU test see it."""
    server = start_fake("--context-length", "16")
    try:
        engine = SglangEngine(SglangClient(server.url), io)
        with pytest.raises(SglangError, match="exceeds the model's maximum context length of 16 tokens"):
            sample(engine, [1] * 10, max_new_tokens=7)
        with pytest.raises(SglangError, match=r"The input \(16 tokens\) is longer than the model's context length"):
            sample(engine, [1] * 16, max_new_tokens=1)
        assert len(sample(engine, [1] * 10, max_new_tokens=6).tokens) == 6
    finally:
        server.stop()


def test_stopping_a_server_leaves_no_process(server):
    pid = server.process.pid
    server.stop()
    assert not server.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert json.dumps(server.spec.url)  # the spec outlives the process


def test_a_server_does_not_outlive_a_producer_killed_with_sigkill():
    import subprocess

    port = free_port()
    owner = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from streamrl.engine.sglang.server import ServerProcess, ServerSpec
server = ServerProcess(ServerSpec(model_path="unused", port={port}),
                       command=[sys.executable, {str(FAKE)!r}, "--port", "{port}"], startup_timeout_s=30)
server.start()
print(server.process.pid, flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        guard = int(owner.stdout.readline())
        assert SglangClient(f"http://127.0.0.1:{port}").healthy()
        owner.kill()  # SIGKILL: no cleanup code of the producer runs
        owner.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and SglangClient(f"http://127.0.0.1:{port}").healthy():
            time.sleep(0.1)
        assert not SglangClient(f"http://127.0.0.1:{port}").healthy()  # the guard ended the server
        while time.monotonic() < deadline and group_members(guard):
            time.sleep(0.1)  # the guard exits a moment after its server
        assert not group_members(guard)  # nothing of its process group is left (zombies aside)
    finally:
        owner.kill()


# ---- the producer over two stand-in servers, against the real queue and weight registry ------------------

def test_the_producer_over_two_servers_feeds_the_queue_within_budget_with_exact_versions(tmp_path):
    """The one producer over the sglang pool: samples as coroutines of one event loop (no thread each),
    weights rolled through the servers from the registry, nothing lost."""
    import numpy as np

    from streamrl.buffer import QueueConfig, ReplayQueue, validate_batch
    from streamrl.engine.sglang.pool import SglangPool, SglangWeights
    from streamrl.rollout import RolloutProducer
    from streamrl.rollout.producer import COMMIT_THREADS
    from streamrl.sim.workload import SimWorkload
    from streamrl.tasks.sim import SimTask
    from streamrl.weights.disk import DiskWeights
    from streamrl.weights.registry import WeightRegistry

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    servers = [start_fake("--token-delay-s", "0.001", "--update-delay-s", "0.05") for _ in range(2)]
    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=2, max_staleness=1, max_in_flight=8))
    registry = WeightRegistry()
    registry.publish(0, {"w": np.zeros(3, np.float32)})
    work = SimWorkload(prompt_tokens=4, vocab_size=17)
    io = EventLoopThread()
    engines = [SglangEngine(SglangClient(s.url), io, server=s) for s in servers]
    weights = SglangWeights(engines, lambda have, timeout: registry.acquire(0, have, timeout),
                            DiskWeights(base, tmp_path / "w").loader, poll_s=0.05)
    pool = SglangPool(engines, io, capacity=16, max_new_tokens=24, weights=weights,
                      on_close=lambda: [s.stop() for s in servers])
    producer = RolloutProducer(0, queue=queue, engine=pool, task=SimTask(work), group_size=4, max_staleness=1,
                               admit_timeout=0.05)
    stop, errors, consumed, newest, seen = threading.Event(), [], [], 0, []
    threads_before = threading.active_count()

    def run():
        try:
            producer.run(stop)
        except BaseException as exc:
            errors.append(exc)

    def watch():  # samples in flight and threads alive, while the producer runs
        while not stop.is_set():
            seen.append((pool.active, threading.active_count() - threads_before - 2))  # this test's two aside
            time.sleep(0.002)

    worker, watcher = threading.Thread(target=run), threading.Thread(target=watch)
    worker.start(), watcher.start()
    try:
        for version in range(1, 7):  # a trainer: take a step's groups, move the version, publish
            got = queue.get(timeout=30)
            assert got is not None, "the producer stopped feeding the trainer"
            for group in got.groups:
                validate_batch(group.payload, group_size=4, trainer_version=got.version)
                newest = max(newest, max(group.payload.column("versions").flatten().to_pylist()))
            assert max(got.staleness) <= 1
            consumed += [(g.group_id, g.prompt_id) for g in got.groups]
            queue.set_version(version)
            registry.publish(version, {"w": np.full(3, version, np.float32)})
    finally:
        stop.set()
        worker.join(timeout=60)
        watcher.join()
        pool.close()
    assert not errors and not worker.is_alive()
    # many samples in flight, a handful of threads (no thread per sample): the producer's admit, score and commit
    # threads and the pool's weights thread. Aborts of stopped groups' samples run on the event loop: as
    # executor threads they once added four more here in the full suite
    busiest = max(threads for active, threads in seen if active >= 8)
    assert busiest <= 3 + COMMIT_THREADS, busiest
    assert newest >= 4  # tokens of trained groups came from weights published during the run
    assert producer.stats.weight_updates >= 3 and all(e.stats["updates"] >= 3 for e in engines)
    # the versions held, for summary.json's "producers held different versions" (it reported none before)
    held = [version for _, version in weights.history]
    assert len(held) >= producer.stats.weight_updates and held == sorted(set(held)) and held[0] == 0
    assert sorted(p.name for p in (tmp_path / "w").iterdir())[-1] >= "v00000003"  # written, old ones pruned
    assert len(list((tmp_path / "w").iterdir())) <= 2
    status = queue.status()
    assert status["running"] == 0  # stopped: what was running went back
    ids = [g for g, _ in consumed]
    assert len(ids) == len(set(ids)) == 12
    prompts = [p for _, p in consumed] + [g.prompt_id for g in queue.queued_groups()] + queue.returned_prompts()
    assert sorted(prompts) == list(range(status["prompt_cursor"]))  # every prompt exactly once
    assert not any(s.alive() for s in servers)  # closing the pool stopped its servers


def test_a_server_that_dies_during_a_weight_update_is_restarted_and_gets_that_version(io, server, weights_dir):
    engine = SglangEngine(SglangClient(server.url), io, server=server)
    first = []

    def load_after_a_crash(client):  # the server dies while the weights load
        if not first:
            first.append(1)
            os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)
            server.process.wait()
        client.update_weights_from_disk(str(weights_dir))

    engine.update_weights(5, load_after_a_crash)
    assert server.restarts == 1 and engine.version == 5
    assert set(sample(engine, [1], max_new_tokens=3).versions) == {5}


def test_a_server_whose_guard_is_killed_outright_ends_too(server):
    os.kill(server.process.pid, signal.SIGKILL)  # the guard only, as Ray does to a dead worker's children
    server.process.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and group_members(server.process.pid):
        time.sleep(0.1)
    assert not group_members(server.process.pid)


# ---- weights by broadcast over one torch.distributed group per server (gloo here) ------------------------

def mixed_weights(version: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(version)
    return {"embed.weight": rng.standard_normal((64, 32)).astype(np.float32),  # 8 KiB: a bucket of its own
            "layer.0.bias": rng.standard_normal(32).astype(np.float16),
            "layer.0.weight": rng.standard_normal((32, 16)).astype(np.float32),
            "steps": np.array([version], np.int64),
            "head.weight": rng.standard_normal((16, 8, 2)).astype(np.float32)}


def arrays_digest(arrays: dict) -> str:
    import numpy as np

    return fake.weights_digest([(n, np.ascontiguousarray(a).tobytes()) for n, a in arrays.items()])


def server_digest(server: ServerProcess) -> str:
    return SglangClient(server.url).call("/fake/weights_digest", method="GET")["digest"]


def test_weights_broadcast_to_each_server_through_its_own_group_arrive_exactly(io):
    from streamrl.weights.broadcast import UpdateGroups, distributed_loader, plan_buckets

    servers = [start_fake("--update-delay-s", "0.0") for _ in range(2)]
    groups = UpdateGroups(timeout_s=30)
    try:
        engines = [SglangEngine(SglangClient(s.url), io, server=s) for s in servers]
        for version in (1, 2):
            arrays = mixed_weights(version)
            assert len(plan_buckets(arrays, 2560)) == 3  # the big tensor alone, the rest in two
            load = distributed_loader(groups, arrays, bucket_bytes=2560)
            for engine in engines:
                engine.update_weights(version, load)
            assert [server_digest(s) for s in servers] == [arrays_digest(arrays)] * 2
            assert [e.version for e in engines] == [version, version]
            assert {tuple(sample(e, [1], max_new_tokens=3).versions) for e in engines} == {(version,) * 3}
        assert groups.opened == 2  # one group per server, kept across versions
        inits = [c["body"] for s in servers for c in calls(s) if c["path"] == "/init_weights_update_group"]
        assert len(inits) == 2 and inits[0]["group_name"] != inits[1]["group_name"]
        assert all(i["rank_offset"] == 1 and i["world_size"] == 2 and i["backend"] == "gloo"
                   and i["master_address"] == "127.0.0.1" for i in inits)
        buckets = [c["body"] for c in calls(servers[0]) if c["path"] == "/update_weights_from_distributed"]
        assert buckets[1]["names"] == ["layer.0.bias", "layer.0.weight", "steps"]
        assert buckets[1]["dtypes"] == ["float16", "float32", "int64"] and buckets[1]["shapes"] == [[32], [32, 16], [1]]
        # the prefix cache holds KV of the old weights: flushed once per version, after the load and its label
        assert not any(b["flush_cache"] for b in buckets)
        # each version inside one weight-update session (sglang >= 0.5.21 refuses loads outside one)
        session = ["/begin_weight_update", *["/update_weights_from_distributed"] * 3, "/end_weight_update",
                   "/update_weight_version", "/flush_cache", "/continue_generation"]
        sequence = [c["path"] for c in calls(servers[0]) if c["path"] != "/generate"]
        assert sequence == ["/pause_generation", "/init_weights_update_group", *session, "/pause_generation", *session]
    finally:
        groups.close()
        for s in servers:
            s.stop()


def test_weights_by_tensor_handle_reach_each_server_exactly(io):
    """`/update_weights_from_tensor` in sglang's serialised form (base64 of a pickle of (name, tensor)
    pairs; here CPU tensors, on GPUs CUDA IPC handles), one copy per server TP rank, in buckets."""
    servers = [start_fake("--update-delay-s", "0.0", "--tp-size", "2") for _ in range(2)]
    try:
        engines = [SglangEngine(SglangClient(s.url), io, server=s) for s in servers]
        for version in (1, 2):
            arrays = mixed_weights(version)
            load = tensor_loader(arrays, bucket_bytes=2560, tensor_parallel=2)
            for engine in engines:
                engine.update_weights(version, load)
            assert [server_digest(s) for s in servers] == [arrays_digest(arrays)] * 2
            assert [e.version for e in engines] == [version, version]
            assert {tuple(sample(e, [1], max_new_tokens=3).versions) for e in engines} == {(version,) * 3}
        for server in servers:
            posts = [c["body"] for c in calls(server) if c["path"] == "/update_weights_from_tensor"]
            assert len(posts) == 6 and all(len(p["serialized_named_tensors"]) == 2 for p in posts)  # TP = 2
            assert not any(p["flush_cache"] for p in posts)  # flushed after the label (a load's flush can fail late)
            assert all(p["load_format"] is None for p in posts)
            sequence = [c["path"] for c in calls(server) if c["path"] != "/generate"]
            session = ["/pause_generation", "/begin_weight_update", *["/update_weights_from_tensor"] * 3,
                       "/end_weight_update", "/update_weight_version", "/flush_cache", "/continue_generation"]
            assert sequence == session * 2
    finally:
        for s in servers:
            s.stop()


def test_a_tensor_payload_is_sglangs_serialised_form():
    """What sglang's `MultiprocessingSerializer.deserialize` reads: strict base64, then a pickle of pairs
    that its allow-list unpickler accepts (the stand-in's, which follows sglang's rule)."""
    import base64
    import io as bytes_io

    import numpy as np
    import torch

    from streamrl.weights.tensor_handles import serialize_named_tensors

    named = [("a.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.tensor([1], dtype=torch.int64))]
    payload = base64.b64decode(serialize_named_tensors(named), validate=True)
    back = fake.AllowListUnpickler(bytes_io.BytesIO(payload)).load()
    assert [n for n, _ in back] == ["a.weight", "b"]
    assert all(torch.equal(t, u) and t.dtype == u.dtype for (_, t), (_, u) in zip(back, named))
    assert np.array_equal(back[0][1].numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.gpu
def test_on_cuda_weights_by_tensor_handle_reach_a_server_exactly():
    """The same with CUDA tensors: the payload carries IPC handles and the server (another process)
    opens them and copies the bytes out."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    server = start_fake("--update-delay-s", "0.0")
    try:
        arrays = mixed_weights(4)
        tensor_loader(arrays, bucket_bytes=2560, devices_of=lambda client: [torch.device("cuda", 0)])(
            SglangClient(server.url))
        assert server_digest(server) == arrays_digest(arrays)
    finally:
        server.stop()


def test_a_sender_refuses_a_group_name_twice_and_closes_a_dead_producers_groups_by_prefix():
    """The sender (the trainer, in a run) outlives producers: a dead one's groups are closed by its
    prefix, which frees their names; another producer's (p10 against p1) stay."""
    from streamrl.weights.broadcast import GroupSender

    sender = GroupSender()

    def open_group(name):  # a group of rank 0 alone: joined at once
        sender.open_group(name, 1, server=("127.0.0.1", 1), node=None, timeout_s=10)
        sender.joined(name, 10)

    for name in ("run-p1-a", "run-p1-b", "run-p10-a"):
        open_group(name)
    with pytest.raises(ValueError, match="update group run-p1-a is already open"):
        open_group("run-p1-a")
    assert sender.close_groups("run-p1-") == 2 and sender.stats["groups"] == 3
    open_group("run-p1-a")  # its name is free again
    sender.broadcast("run-p10-a", mixed_weights(1), ["steps"], 10)  # a group of one: nothing to wait for
    with pytest.raises(RuntimeError, match="update group run-p1-b is not open"):
        sender.broadcast("run-p1-b", mixed_weights(1), ["steps"], 10)
    sender.close()
    assert sender.close_groups("") == 0



def test_a_group_whose_server_never_joins_holds_up_neither_another_servers_join_nor_the_caller_once_closed(server):
    """A killed producer's server may die while the trainer is joining its group; that join waits out its
    timeout (300 s by default). Under one lock for every join, the replacement's servers' joins waited
    behind it and timed out (a fault test failed this way, one run in three); and the dead producer's
    wait held one of the trainer's threads as long, after its groups were closed."""
    from streamrl.weights.broadcast import GroupSender, UpdateGroup

    sender = GroupSender()
    sender.open_group("run-p0-dead", 2, server=("127.0.0.1", 1), node=None, timeout_s=60)  # rank 1 never comes
    waited: dict[str, BaseException] = {}

    def wait_for_dead_join():
        try:
            sender.joined("run-p0-dead", 60)
        except BaseException as exc:
            waited["error"] = exc

    waiting = threading.Thread(target=wait_for_dead_join, daemon=True)
    waiting.start()
    group = UpdateGroup(SglangClient(server.url), sender, timeout_s=60)
    started = time.monotonic()
    try:
        group.open()
        assert time.monotonic() - started < 20  # the stand-in imports torch at its first join: seconds
        assert sender.close_groups("run-p0-dead") == 1
        waiting.join(5)
        assert not waiting.is_alive()
        assert "update group run-p0-dead was closed while it was being joined" in str(waited["error"])
        with pytest.raises(RuntimeError, match="update group run-p0-dead is not being joined"):
            sender.joined("run-p0-dead", 60)  # the dead producer's call, arriving after the close (KeyError before)
    finally:
        group.close(on_server=True)
        sender.close()


def test_a_restarted_server_gets_a_new_group_and_then_the_next_version(io, server):
    from streamrl.weights.broadcast import UpdateGroups, distributed_loader

    groups = UpdateGroups(timeout_s=30, generation=lambda client: server.restarts)
    engine = SglangEngine(SglangClient(server.url), io, server=server)
    try:
        engine.update_weights(1, distributed_loader(groups, mixed_weights(1), 2560))
        os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)
        server.process.wait()
        # the update finds the server dead, restarts it, reloads version 1 into it through a new group, then 2
        engine.update_weights(2, distributed_loader(groups, mixed_weights(2), 2560))
        assert server.restarts == 1 and groups.opened == 2 and engine.version == 2
        assert server_digest(server) == arrays_digest(mixed_weights(2))
        assert set(sample(engine, [1], max_new_tokens=3).versions) == {2}
        sequence = [c["path"] for c in calls(server) if "weight" in c["path"]]
        session = ["/begin_weight_update", *["/update_weights_from_distributed"] * 3, "/end_weight_update",
                   "/update_weight_version"]
        assert sequence == ["/init_weights_update_group", *session, *session]
    finally:
        groups.close()


def test_a_server_that_refuses_a_bucket_raises_at_once_and_the_next_load_opens_a_new_group(server):
    from streamrl.weights.broadcast import UpdateGroups, distributed_loader

    groups = UpdateGroups(timeout_s=30)  # told nothing of restarts: it finds out from the refusal
    client = SglangClient(server.url)
    try:
        distributed_loader(groups, mixed_weights(1), 2560)(client)
        server.restart()  # a new process, outside the old group
        # the stand-in imports torch on its first load (seconds; sglang has it loaded): its refusal would
        # come after the sender's "peer closed", which raises once the server has had a moment to refuse
        with pytest.raises(SglangError, match="must run between begin_weight_update"):
            post(server, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
        began = time.monotonic()
        with pytest.raises(SglangError, match="Group .* not in"):
            distributed_loader(groups, mixed_weights(2), 2560)(client)
        assert time.monotonic() - began < 10  # not the group's 30 s timeout
        distributed_loader(groups, mixed_weights(2), 2560)(client)  # a failed load dropped the group
        assert groups.opened == 2 and server_digest(server) == arrays_digest(mixed_weights(2))
    finally:
        groups.close()


def test_an_update_whose_sender_fails_at_once_raises_its_error_at_once_and_does_not_load_again(io, server):
    """Before, the server's POST was awaited first: it waited for tensors that never came until its
    timeout, the timeout read as a dead server, and the whole load ran again through a new group; the
    update raised "timed out" after twice the group's timeout, never the sender's own error."""
    from streamrl.weights.broadcast import GroupSender, UpdateGroups, distributed_loader

    class FailingSender(GroupSender):
        fail = False

        def broadcast(self, name, weights, names, timeout_s):
            if self.fail:
                raise RuntimeError("CUDA out of memory (simulated) copying the bucket")
            return super().broadcast(name, weights, names, timeout_s)

    sender = FailingSender()
    groups = UpdateGroups(sender, timeout_s=10, generation=lambda client: server.restarts)
    engine = SglangEngine(SglangClient(server.url), io, server=server)
    try:
        engine.update_weights(1, distributed_loader(groups, mixed_weights(1), 2560))
        sender.fail = True
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            engine.update_weights(2, distributed_loader(groups, mixed_weights(2), 2560))
        assert time.monotonic() - began < 3  # not the group's 10 s timeout
        sequence = [c["path"] for c in calls(server)]
        after = sequence[sequence.index("/continue_generation") + 1:]
        assert after == ["/pause_generation", "/begin_weight_update", "/update_weights_from_distributed",
                         "/end_weight_update", "/destroy_weights_update_group"]  # one try, no new group
        assert server.restarts == 0 and groups.opened == 1 and engine.version == 1
    finally:
        groups.close()


def test_a_sender_that_cannot_join_the_group_fails_the_open_at_once(io, server):
    """The server's POST was awaited before the sender's join: a trainer that could not join left the
    server waiting for a rank 0 that never came, and the open raised only at the group's timeout."""
    import socket

    from streamrl.weights.broadcast import GroupSender, UpdateGroups, distributed_loader

    silent = socket.socket()  # a store that accepts and never answers: the server waits in its join
    silent.bind(("127.0.0.1", 0))
    silent.listen()

    class UnjoinableSender(GroupSender):
        def open_group(self, name, world, *, server, node, timeout_s):
            return "127.0.0.1", silent.getsockname()[1], "gloo"

        def joined(self, name, timeout_s):
            raise RuntimeError("the trainer could not join (simulated)")

        def close_group(self, name):
            pass

    groups = UpdateGroups(UnjoinableSender(), timeout_s=20, generation=lambda client: server.restarts)
    began = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="could not join"):
            distributed_loader(groups, mixed_weights(1), 2560)(SglangClient(server.url))
        assert time.monotonic() - began < 5  # not the group's 20 s timeout
    finally:
        silent.close()


def test_a_request_that_times_out_on_a_live_server_is_no_crash():
    """Before, a timeout read as an unreachable server: an update whose load timed out was taken for a
    crash and run again on the live server (and raised EngineUnreachable)."""
    from streamrl.sglang.client import EngineTimeout, EngineUnreachable

    server = start_fake("--update-delay-s", "1.0")
    loop = EventLoopThread()
    try:
        engine = SglangEngine(SglangClient(server.url), loop, server=server)
        loads = []

        def slow_load(client):
            loads.append(1)
            client.call("/update_weights_from_disk", {"model_path": "unused"}, timeout_s=0.2)

        with pytest.raises(EngineTimeout, match="no answer within 0.2 s") as raised:
            engine.update_weights(1, slow_load)
        assert not isinstance(raised.value, EngineUnreachable)
        assert loads == [1] and server.restarts == 0 and engine.stats["restarts"] == 0
        # a generation that outlasts the client's timeout: the sample is lost, the live server kept
        slow = SglangEngine(SglangClient(server.url, timeout_s=0.3), loop, server=server)
        slow.client.continue_generation()  # the failed update left the server paused
        with pytest.raises(EngineLost, match="no answer within 0.3 s"):
            sample(slow, [1], max_new_tokens=2000)
        assert server.restarts == 0 and slow.stats["restarts"] == 0
    finally:
        loop.close()
        server.stop()


def test_the_client_tells_a_server_that_is_not_there_from_one_that_does_not_answer():
    """Only a failed connection is unreachable; a connection taken and left unanswered is a timeout."""
    import asyncio
    import socket

    from streamrl.sglang.client import EngineTimeout, EngineUnreachable

    with socket.socket() as silent:  # accepts connections (the backlog does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        client = SglangClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.2)
        with pytest.raises(EngineTimeout) as raised:
            client.call("/model_info", method="GET")
        assert not isinstance(raised.value, EngineUnreachable)
        with pytest.raises(EngineTimeout):
            asyncio.run(_generate_once(client))
    client = SglangClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.2)  # nothing listens
    with pytest.raises(EngineUnreachable):
        client.call("/model_info", method="GET")
    with pytest.raises(EngineUnreachable):
        asyncio.run(_generate_once(client))


def test_an_answer_that_is_not_http_is_unreachable_for_the_blocking_and_the_async_client():
    """aiohttp's own errors (here ClientResponseError) escaped the async path: a producer error, and an
    abort task's exception never retrieved, where the blocking client said EngineUnreachable."""
    import asyncio
    import socket

    from streamrl.sglang.client import EngineUnreachable

    with socket.socket() as garbled:
        garbled.bind(("127.0.0.1", 0))
        garbled.listen(8)

        def answer_garbage():
            for _ in range(3):
                connection, _ = garbled.accept()
                with connection:
                    connection.recv(65536)
                    connection.sendall(b"garbage, not http\r\n\r\n")

        server = threading.Thread(target=answer_garbage, daemon=True)
        server.start()
        client = SglangClient(f"http://127.0.0.1:{garbled.getsockname()[1]}", timeout_s=5)
        with pytest.raises(EngineUnreachable):
            client.abort("0" * 32)
        with pytest.raises(EngineUnreachable):
            asyncio.run(_generate_once(client))
        with pytest.raises(EngineUnreachable):
            asyncio.run(_abort_once(client))
        server.join(5)


async def _abort_once(client: SglangClient):
    try:
        return await client.abort_async("0" * 32)
    finally:
        await client.close_async()


async def _generate_once(client: SglangClient):
    try:
        return await client.generate_async([1], max_new_tokens=1)
    finally:
        await client.close_async()


def test_dropping_a_group_on_a_server_that_does_not_answer_raises():
    """Before, a destroy that timed out was taken for a dead server (its group gone with it) and ignored."""
    import socket

    from streamrl.sglang.client import EngineTimeout
    from streamrl.weights.broadcast import GroupSender, UpdateGroup

    with socket.socket() as silent:  # accepts connections (the backlog does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        sender = GroupSender()
        group = UpdateGroup(SglangClient(f"http://127.0.0.1:{silent.getsockname()[1]}"), sender, timeout_s=10)
        sender.open_group(group.name, 1, server=("127.0.0.1", 1), node=None, timeout_s=10)  # rank 0 alone
        sender.joined(group.name, 10)
        group.open_ = True
        destroy = group.client.destroy_weights_update_group
        group.client.destroy_weights_update_group = lambda name: destroy(name, timeout_s=0.2)  # not 30 s
        with pytest.raises(EngineTimeout, match="destroy_weights_update_group: no answer within 0.2 s"):
            group.close(on_server=True)
    assert sender.close_groups("") == 0  # the sender's side was left all the same


# ---- the stand-in refuses what sglang refuses (read from sglang 0.5.21–0.5.23's source) ---------------------

def post(server: ServerProcess, path: str, body: dict | None = None) -> dict:
    return SglangClient(server.url).call(path, body or {})


def start_sample(engine: SglangEngine, prompt, **kwargs):
    """A sample running in the background: (thread, result dict)."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(got=sample(engine, prompt, **kwargs)))
    worker.start()
    return worker, result


def test_the_stand_in_refuses_tensor_and_distributed_loads_outside_a_weight_update_session(server):
    for path, body in [("/update_weights_from_tensor", {"serialized_named_tensors": [""]}),
                       ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})]:
        with pytest.raises(SglangError, match="must run between begin_weight_update"):
            post(server, path, body)
    with pytest.raises(SglangError, match="no weight-update session is open"):
        post(server, "/end_weight_update")
    post(server, "/begin_weight_update")
    with pytest.raises(SglangError, match="already open"):
        post(server, "/begin_weight_update")
    post(server, "/end_weight_update")
    with pytest.raises(SglangError, match="answered 404"):  # a route sglang does not have
        SglangClient(server.url).call("/get_weight_version", method="GET")


def test_the_stand_in_health_generates_and_a_paused_server_fails_it_while_model_info_answers():
    server = start_fake("--health-s", "0.5", "--health-timeout-s", "1.5")
    try:
        client = SglangClient(server.url)
        began = time.monotonic()
        assert client.healthy() and time.monotonic() - began >= 0.5  # a generation, not a ping
        client.pause_generation()
        began = time.monotonic()
        assert not client.healthy() and time.monotonic() - began >= 1.5  # held at the gate, then 503
        began = time.monotonic()
        assert client.alive() and time.monotonic() - began < 1.0  # streamrl's liveness: /model_info
        assert client.model_info()["weight_version"] == "default"
    finally:
        server.stop()


def test_the_stand_in_pause_blocks_until_nothing_runs_and_a_request_at_its_gate_runs_after_continue(io):
    server = start_fake("--token-delay-s", "0.01", "--pause-poll-s", "0.5")
    try:
        client, engine = SglangClient(server.url), SglangEngine(SglangClient(server.url), io)
        began = time.monotonic()
        client.pause_generation()
        assert time.monotonic() - began < 0.3  # nothing ran: at once
        client.continue_generation()
        sample(engine, [1], max_new_tokens=1)  # the client's connection pool is up
        running, _ = start_sample(engine, [1], max_new_tokens=500)
        time.sleep(0.2)
        began = time.monotonic()
        client.pause_generation()  # aborts the running request, checks again after pause_poll_s
        assert time.monotonic() - began >= 0.5
        waiting, result = start_sample(engine, [2], max_new_tokens=5)
        time.sleep(0.3)
        client.abort()  # abort-all reaches the scheduler only: not the request at the gate
        client.update_weight_version(7)
        client.continue_generation()
        waiting.join(timeout=10)
        running.join(timeout=10)
        assert len(result["got"].tokens) == 5 and set(result["got"].versions) == {7}
    finally:
        server.stop()


def test_the_stand_in_ends_itself_when_released_while_a_request_runs(io, server):
    from streamrl.sglang.client import EngineUnreachable

    engine, lost = SglangEngine(SglangClient(server.url), io), []

    def long_sample():
        try:
            sample(engine, [1], max_new_tokens=2000)
        except EngineLost as exc:  # the server ended under it
            lost.append(exc)

    worker = threading.Thread(target=long_sample)
    worker.start()
    time.sleep(0.5)
    with pytest.raises(EngineUnreachable):
        post(server, "/release_memory_occupation")  # sglang's idle assertion ends the server
    server.process.wait(timeout=10)
    assert not server.alive()
    worker.join(timeout=30)
    assert len(lost) == 1


def test_a_request_that_reaches_a_released_server_waits_at_its_pause_gate_as_in_sglang(server):
    """sglang's tokenizer holds a request that arrives while generation is paused, whatever the memory
    (the client pauses before it releases, and a request it sent before the pause can arrive after the
    release): it runs once the server is resumed and continued. One let through while the memory is away
    (continued before resumed) is refused: sglang's scheduler would run it without any."""
    client, result = SglangClient(server.url), {}
    client.pause_generation()
    client.flush_cache()
    client.release_memory_occupation()
    waiting = threading.Thread(target=lambda: result.update(got=client.generate([1], max_new_tokens=3)))
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive() and not result  # held at the gate, not refused
    client.resume_memory_occupation()
    client.continue_generation()
    waiting.join(timeout=10)
    assert len(result["got"].tokens) == 3
    client.pause_generation()
    client.release_memory_occupation()
    client.continue_generation()  # the client's bug this stand-in catches: generation let through, memory away
    with pytest.raises(SglangError, match="memory is released"):
        client.generate([1], max_new_tokens=3)


def test_the_stand_in_changes_the_weights_then_refuses_a_flush_it_cannot_do(io, server, weights_dir):
    engine = SglangEngine(SglangClient(server.url), io)
    worker, _ = start_sample(engine, [1], max_new_tokens=300)
    time.sleep(0.2)
    with pytest.raises(SglangError, match="Weights were updated, but the cache was not flushed"):
        post(server, "/update_weights_from_disk", {"model_path": str(weights_dir), "weight_version": "3"})
    assert SglangClient(server.url).model_info()["weight_version"] == "3"  # loaded and labelled anyway
    with pytest.raises(SglangError, match="answered 400"):
        post(server, "/flush_cache")
    SglangClient(server.url).abort()
    worker.join(timeout=30)


def test_the_stand_in_refuses_unknown_sampling_keys_and_unsafe_or_sloppy_tensor_payloads(server):
    import base64
    import pickle

    with pytest.raises(SglangError, match="Unexpected keyword argument 'top_a'"):
        post(server, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "top_a": 0.1}})

    class Exploit:
        def __reduce__(self):
            return (os.system, ("true",))

    post(server, "/begin_weight_update")
    evil = base64.b64encode(pickle.dumps([("w", Exploit())])).decode()
    with pytest.raises(SglangError, match="Blocked unsafe global"):
        post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    with pytest.raises(SglangError, match="answered 400"):  # strict base64: no stray characters
        post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["not*base64"]})
    post(server, "/end_weight_update")


def test_every_tp_rank_of_a_server_joins_its_update_group_and_receives_the_weights(io):
    from streamrl.weights.broadcast import UpdateGroups, distributed_loader

    server = start_fake("--update-delay-s", "0.0", "--tp-size", "2")
    groups = UpdateGroups(timeout_s=30, tensor_parallel=2)
    try:
        engine = SglangEngine(SglangClient(server.url), io, server=server)
        engine.update_weights(1, distributed_loader(groups, mixed_weights(1), 2560))
        assert server_digest(server) == arrays_digest(mixed_weights(1))
        (init,) = [c["body"] for c in calls(server) if c["path"] == "/init_weights_update_group"]
        assert init["world_size"] == 3 and init["rank_offset"] == 1  # the sender and two server ranks
        name = init["group_name"]
        groups.drop(engine.client)  # a failed load drops the group: on the server too
        with pytest.raises(SglangError, match="does not exist"):
            engine.client.destroy_weights_update_group(name)
    finally:
        groups.close()
        server.stop()


# ---- the client as the real server needs it (each failed before: see the test names) ----------------------

def test_an_update_does_not_wait_for_a_request_parked_at_the_servers_pause_gate(io, weights_dir):
    """Before, the update waited for every request in flight to come back, aborting again: one parked at
    the server's gate never does until the server continues, so each such update stalled drain_timeout_s
    (10 s). It now loads once the pause returns; the parked request runs after, with the new version."""
    server = start_fake("--token-delay-s", "0.002", "--update-delay-s", "0.0", "--pause-poll-s", "0.2")
    try:
        client, engine = SglangClient(server.url), SglangEngine(SglangClient(server.url), io, server=server)
        client.pause_generation()  # the server paused before this sample reached it (as at an update's start)
        parked, result = start_sample(engine, [3], max_new_tokens=6)
        time.sleep(0.3)
        began = time.monotonic()
        engine.update_weights(1, disk_loader(str(weights_dir)))
        assert time.monotonic() - began < 3.0
        parked.join(timeout=10)
        assert set(result["got"].versions) == {1} and len(result["got"].tokens) == 6
    finally:
        server.stop()


def test_a_paused_server_is_alive_and_not_restarted(io, server):
    """Before, liveness was `/health`, which generates: a paused server looked dead and was restarted."""
    client = SglangClient(server.url)
    client.pause_generation()
    assert client.alive()
    client.continue_generation()


def test_a_server_outside_the_supported_versions_is_refused_at_start():
    from streamrl.sglang.protocol import check_server_version

    old = start_fake("--sglang-version", "0.5.20")
    try:
        with pytest.raises(ValueError, match=r"runs sglang 0.5.20; streamrl speaks the protocol of sglang>=0.5.21,<0.6"):
            check_server_version(SglangClient(old.url).server_version(), old.url)
    finally:
        old.stop()
    assert check_server_version("0.5.23.post1") == (0, 5, 23) and check_server_version("0.5.21") == (0, 5, 21)
    with pytest.raises(ValueError):
        check_server_version("0.6.0")


def test_a_generation_with_a_null_log_prob_is_refused_by_name():
    from streamrl.sglang.client import _segment

    answer = {"meta_info": {"id": "r1", "finish_reason": {"type": "length"}, "weight_version": "2",
                            "output_token_logprobs": [[-0.5, 4, None], [None, 7, None]]}}
    with pytest.raises(SglangError, match=r"no log-prob for output tokens \[1\] of request 'r1'"):
        _segment(answer)


def test_top_p_below_one_is_refused_with_sglang():
    from streamrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="sglang's log-probs are of the whole distribution too"):
        load_config(None, ["producers.engine=sglang", "sampling.top_p=0.9"])


def test_the_sglang_smoke_drives_every_weight_path_through_the_stand_in(tmp_path):
    """benchmarks/sglang_smoke.py is the GPU check of a real server (benchmarks/gpu_smoke.sh); on CPU it runs
    the same protocol against the stand-in."""
    import subprocess

    out = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "sglang_smoke.py"), "--stand-in",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["path"] for r in results] == ["disk", "tensor", "distributed"]
    assert all(r["ok"] and r["versions"] == [1] and r["alive_while_paused"] for r in results)
