"""Replay-queue throughput: in-process commit+get, admission, and the Ray path, side by side.

    python -m benchmarks.buffer --out benchmarks/results/buffer.json

Every figure is measured in the same run, so the ratios (put/get against memcpy, the queue's Ray path
against a plain `ray.put` + `ray.get` of the same bytes between the same two processes) hold on a noisy
shared machine. Batches are 4,096 samples of ~512 response tokens (lengths drawn from 384-640). The
Ray path is the producers' own: `RemoteQueue.commit` from `COMMIT_THREADS` threads, as a producer
commits (each batch left in the producer's outbox, taken by the queue actor as the return value of its
call), then the trainer's `get` and `fetch_table`; `ray_gbps_one_commit` is the same path with one
commit in flight. The three take turns over several rounds, and `ray_vs_put_get` is the median of the
rounds' own ratios (one round of each, one after the other, varied 0.34-0.79 between runs on the 2-core
machine).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from harness.benchreport import BASELINES, Target, check_report_paths, finish, positive_float, positive_int
from harness.synthetic import synthetic_batch
from streamrl.buffer import QueueConfig, ReplayQueue, assemble
from streamrl.buffer.actor import create_queue_actor, fetch_table
from streamrl.rollout.producer import COMMIT_THREADS
from streamrl.runtime.clients import RemoteQueue
from streamrl.runtime.connect import start_local

SAMPLES, GROUP = 4096, 8
GROUPS = SAMPLES // GROUP
TARGETS = [Target("put_get_vs_memcpy", ">=", 0.25), Target("admit_per_s", ">=", 100_000),
           Target("ray_admit_slots_per_s", ">=", 10_000), Target("ray_vs_put_get", ">=", 0.5)]
HEADLINE = ["put_get_gbps", "admit_per_s", "ray_admit_slots_per_s", "ray_gbps"]


def big_config() -> QueueConfig:
    return QueueConfig(group_size=GROUP, groups_per_step=GROUPS, max_staleness=1_000_000,
                       max_in_flight=10_000_000, capacity_tokens=10**12, vocab_size=151_936)


def bench_put_get(repeats: int) -> dict:
    queue = ReplayQueue(big_config())
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(repeats):
        tickets = queue.admit(0, GROUPS).tickets
        batches.append(synthetic_batch(tickets, GROUP, prompt_len=(32, 96), response_len=(384, 640),
                                       vocab_size=151_936, rng=rng))
    nbytes = batches[0].nbytes
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        queue.commit(batch)
        table = assemble(queue.get(GROUPS, timeout=0).groups)
        times.append(time.perf_counter() - t0)
        assert table.num_rows == SAMPLES
    copy_times = []
    for batch in batches:
        buffers = [np.frombuffer(buf, np.uint8) for col in batch.columns for buf in col.buffers() if buf is not None]
        targets = [np.empty_like(b) for b in buffers]
        t0 = time.perf_counter()
        for src, dst in zip(buffers, targets):
            np.copyto(dst, src)
        copy_times.append(time.perf_counter() - t0)
    best, copy_best = min(times), min(copy_times)
    return {"batch_mb": nbytes / 1e6, "put_get_s": best, "put_get_gbps": nbytes / best / 1e9,
            "memcpy_gbps": nbytes / copy_best / 1e9}


def bench_admit(seconds: float) -> dict:
    queue = ReplayQueue(big_config())
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(1000):
            queue.admit(0, 1)
        calls += 1000
    single = calls / (time.perf_counter() - t0)
    slots, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        slots += len(queue.admit(0, 64).tickets)
    return {"admit_per_s": single, "admit_slots_per_s_batched": slots / (time.perf_counter() - t0)}


@ray.remote(num_cpus=0, max_concurrency=1 + COMMIT_THREADS)  # `produce`, and the queue's take of each commit
class _Producer:
    """A producer's commit path without the generation (the client a producer actor uses)."""

    def __init__(self, queue):
        self.queue = queue
        self.client = RemoteQueue(queue, 0)

    def take_batch(self, key: int):
        return self.client.outbox.take(key)

    def prepare(self, batches: int) -> None:
        # Generated before the clock starts: what is measured is the transport, not the sampling.
        rng = np.random.default_rng(1)
        self.batches = []
        for _ in range(batches):
            tickets = self.client.admit(0, GROUPS, timeout=30.0).tickets
            self.batches.append(synthetic_batch(tickets, GROUP, prompt_len=(32, 96), response_len=(384, 640),
                                                vocab_size=151_936, rng=rng))

    def produce(self, in_flight: int) -> list[int]:
        """Commit the prepared batches, `in_flight` at a time; their sizes in bytes."""
        with ThreadPoolExecutor(in_flight) as commit_threads:
            list(commit_threads.map(self.client.commit, self.batches))
        return [batch.nbytes for batch in self.batches]

    def put_and_read(self, reader) -> float:
        """The limit: each batch `ray.put` here and `ray.get` in the trainer's process; GB/s after the
        first batch (as `consume` measures)."""
        started = None
        for batch in self.batches:
            ray.get(reader.read.remote([ray.put(batch)]))
            started = started or time.perf_counter()
        return sum(batch.nbytes for batch in self.batches[1:]) / (time.perf_counter() - started) / 1e9

    def admit_rate(self, seconds: float, per_call: int) -> float:
        slots, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            slots += len(ray.get(self.queue.admit.remote(1, per_call)).tickets)
        return slots / (time.perf_counter() - t0)


@ray.remote(num_cpus=0)
class _Trainer:
    def __init__(self, queue):
        self.queue = queue

    def consume(self, batches: int, version: int) -> tuple[int, float]:
        """Take `batches` batches as the trainer does (`get`, `fetch_table`, then the next version, which
        lets the queue drop what was trained); rows received and seconds after the first batch. Bytes are
        counted where they were sent: `Table.nbytes` of 512 slices takes 15 ms, as long as the transfer."""
        received, t0 = 0, None
        for _ in range(batches):
            table = fetch_table(ray.get(self.queue.get.remote(GROUPS, timeout=60.0)))
            t0 = t0 or time.perf_counter()  # the clock starts at the first batch (actor start-up excluded)
            received += table.num_rows
            version += 1
            ray.get(self.queue.set_version.remote(version))
        return received, time.perf_counter() - t0

    def read(self, refs: list) -> int:
        return ray.get(refs[0]).num_rows


def bench_ray(batches: int, seconds: float, rounds: int) -> dict:
    """Admission over Ray, then `rounds` rounds of the transfers, alternated so that all see the same
    machine (it is shared and noisy): `batches` + 1 batches through the queue as a producer commits them,
    again with one commit in flight, then the same batches by a plain put + get. Medians over the rounds,
    and the median of each round's own ratio."""
    start_local(2, log_to_driver=False)
    try:
        queue = create_queue_actor("bench-buffer", big_config())
        producer, trainer = _Producer.remote(queue), _Trainer.remote(queue)
        ray.get([producer.admit_rate.remote(0.2, 64)])  # warm both actors up
        slots_per_s = ray.get(producer.admit_rate.remote(seconds, 64))
        version = 0

        def through_queue(in_flight: int) -> float:
            nonlocal version
            ray.get(producer.prepare.remote(batches + 1))
            consumed = trainer.consume.remote(batches + 1, version)
            sizes = ray.get(producer.produce.remote(in_flight))
            rows, elapsed = ray.get(consumed)
            version += batches + 1
            if rows != SAMPLES * (batches + 1):
                raise RuntimeError(f"the trainer received {rows} rows of {SAMPLES * (batches + 1)} sent")
            return sum(sizes[1:]) / elapsed / 1e9  # the clock starts at the first batch

        queued, one_commit, plain = [], [], []
        for _ in range(rounds):
            queued.append(through_queue(COMMIT_THREADS))
            one_commit.append(through_queue(1))
            plain.append(ray.get(producer.put_and_read.remote(trainer)))
        return {"ray_admit_slots_per_s": slots_per_s, "ray_gbps": float(np.median(queued)),
                "ray_gbps_one_commit": float(np.median(one_commit)), "ray_put_get_gbps": float(np.median(plain)),
                "ray_vs_put_get": float(np.median(np.divide(queued, plain))),
                "ray_one_commit_vs_put_get": float(np.median(np.divide(one_commit, plain))),
                "ray_commits_in_flight": COMMIT_THREADS, "ray_rounds": rounds}
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/buffer.json"))
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--seconds", type=positive_float, default=1.0)
    parser.add_argument("--ray-batches", type=positive_int, default=8, help="batches per round of the Ray path")
    parser.add_argument("--ray-rounds", type=positive_int, default=7,
                        help="rounds of the Ray path and a plain put + get")
    parser.add_argument("--baseline", type=Path, help="report to compare with (default: the stored baseline)")
    args = parser.parse_args()
    check_report_paths(parser, args.out, args.baseline)

    results = {**bench_put_get(args.repeats), **bench_admit(args.seconds),
               **bench_ray(args.ray_batches, args.seconds, args.ray_rounds)}
    results["put_get_vs_memcpy"] = results["put_get_gbps"] / results["memcpy_gbps"]
    table = Table(title="streamrl replay queue")
    for column in ("metric", "value"):
        table.add_column(column, justify="right")
    for key, value in results.items():
        table.add_row(key, f"{value:,.3f}")
    Console(width=150).print(table)
    workload = {"samples_per_batch": SAMPLES, "group_size": GROUP, "response_tokens": "384-640",
                "prompt_tokens": "32-96", "vocab_size": 151_936}
    finish("buffer", args.out, workload=workload, results=results, targets=TARGETS, headline=HEADLINE,
           baseline=args.baseline or BASELINES / "baseline_buffer.json")


if __name__ == "__main__":
    main()
