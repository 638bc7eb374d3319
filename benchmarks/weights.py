"""Weight streaming: publish-and-fetch time against weight size and producer count, beside the limit.

    python -m benchmarks.weights --out benchmarks/results/weights.json

For each size and producer count, in the same run:
  publish_fetch_s  the trainer's path (`WeightPublisher`: up to 64 MB written into shared memory and announced
                   to every producer with a message, as to producers on the trainer's machine in a run; larger
                   versions put once, announced to the weights actor and offered to every producer over Ray)
                   until every producer has them in its process (mapped, or fetched from the object store,
                   before its copy into the standby model, which `ready_s` includes) — the real path
  put_get_s        one `ray.put` of the same bytes and one `ray.get` in another process (the limit)
  fanout_s         one `ray.put` and one call to each of as many bare reader processes as there are producers,
                   each reading it: the least it costs to reach that many processes through Ray
  ready_s          until every producer can switch to them (double-buffered: after the copy into the
                   standby model, which overlaps generation)
  stall_s          what a producer pays at its next decode-step boundary to switch to them, the only
                   moment generation is held up: a pointer swap when double-buffered (default; the
                   copy into the standby model overlaps generation), a copy with --in-place
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import ray
import torch
from rich.console import Console
from rich.table import Table

from harness.benchreport import BASELINES, Target, check_report_paths, finish, positive_float, positive_int
from streamrl.engine.base import accept_offer
from streamrl.engine.local_weights import LocalWeights
from streamrl.runtime.actors import shared_weights_listener
from streamrl.runtime.clients import OFFER_GRACE_S, RemoteHold, create_actor, remote_fetch
from streamrl.runtime.connect import start_local
from streamrl.sim.workload import SimWorkload
from streamrl.weights.actor import WeightPublisher, WeightsActor
from streamrl.weights.receiver import WeightReceiver
from streamrl.weights.shared_memory import SharedAddress

RUN = "bench-weights"
TARGET_RATIO = 1.5  # publish to 4 producers within 1.5 x one put-and-get of the same bytes
WARMUP_ROUNDS = 2


class Subscriber:
    """A producer's weight path without the generation: receiver + a model of the published size."""

    def __init__(self, run: str, producer_id: int, floats: int, double_buffer: bool):
        torch.set_num_threads(1)
        weights = ray.get_actor(f"{run}/weights", namespace="streamrl")

        def model() -> torch.nn.Module:
            module = torch.nn.Module()
            module.w = torch.nn.Parameter(torch.zeros(floats), requires_grad=False)
            return module

        self.model = model()
        self.weights, self.producer_id = weights, producer_id
        self.hold = RemoteHold(weights, producer_id)
        self.receiver = WeightReceiver(remote_fetch(weights, producer_id, grace_s=OFFER_GRACE_S), poll_s=1.0,
                                       standby=model() if double_buffer else None)
        self.receiver.start()
        self.local = LocalWeights(self.model, self.receiver)
        # as ProducerActor does
        self.shared = shared_weights_listener(self.local, self.hold, ray.get_runtime_context().get_node_id())
        self.shared.start()

    def address(self) -> SharedAddress:
        return self.shared.address

    def arrival(self, version: int, timeout: float = 120.0) -> tuple[float, float]:
        """(fetched, ready to switch) wall times of `version`."""
        if not self.receiver.wait_newer(version - 1, timeout):
            raise TimeoutError(f"version {version} never arrived")
        return self.receiver.fetched_at, self.receiver.staged_at

    def offer_weights(self, version: int, weights: list) -> None:  # as ProducerActor.offer_weights (torch engine)
        accept_offer(self.local, version, weights, self.hold)

    def apply(self) -> float:
        started = time.perf_counter()
        self.local.refresh()
        return time.perf_counter() - started

    def stop(self) -> None:
        self.shared.stop()
        self.receiver.stop()


class Reader:
    def read(self, refs: list) -> float:
        array = ray.get(refs[0])["w"]
        assert array.size > 0
        return time.time()


def measure(nbytes: int, producers: int, repeats: int, double_buffer: bool) -> dict:
    floats = nbytes // 4
    arrays = {"w": np.random.default_rng(0).random(floats, dtype=np.float32)}
    weights = create_actor(WeightsActor, RUN, "weights", max_concurrency=producers + 4)
    subscribers = [ray.remote(num_cpus=0, max_concurrency=3)(Subscriber).remote(RUN, i, floats, double_buffer)
                   for i in range(producers)]
    publisher = WeightPublisher(weights)
    for i, subscriber in enumerate(subscribers):
        publisher.subscribe(i, subscriber, ray.get(subscriber.address.remote()))
    reader = ray.remote(num_cpus=0)(Reader).remote()
    fanout = [ray.remote(num_cpus=0)(Reader).remote() for _ in range(producers)]
    try:
        publisher.publish(0, arrays)  # connections, first fetch
        ray.get([s.arrival.remote(0) for s in subscribers])
        ray.get([s.apply.remote() for s in subscribers])
        publish, ready, put_get, stall, fanned = [], [], [], [], []
        # The first rounds are not timed: until the object store has touched as much memory as the three
        # paths keep alive at once, whichever allocates first pays for fresh pages (with one untimed round,
        # a 1 GB put + get or fan-out took 1.2-1.3 s in the first configuration of its size and 80-90 ms in
        # the next). The first configuration of a size can still come out slow (up to 2-5x in put + get).
        for version in range(1, WARMUP_ROUNDS + repeats + 1):
            timed = version > WARMUP_ROUNDS
            arrays["w"][0] = version  # new contents, same size
            started = time.time()
            publisher.publish(version, arrays)
            fetched, staged = zip(*ray.get([s.arrival.remote(version) for s in subscribers]))
            stalls = ray.get([s.apply.remote() for s in subscribers])
            publish_s, ready_s = max(fetched) - started, max(staged) - started
            started = time.time()
            put_get_s = ray.get(reader.read.remote([ray.put(arrays)])) - started
            started = time.time()
            ref = ray.put(arrays)
            fanned_s = max(ray.get([r.read.remote([ref]) for r in fanout])) - started
            del ref
            if timed:
                publish.append(publish_s)
                ready.append(ready_s)
                stall += stalls
                put_get.append(put_get_s)
                fanned.append(fanned_s)
        ray.get([s.stop.remote() for s in subscribers])
    finally:
        publisher.close()
        for actor in (weights, reader, *subscribers, *fanout):
            ray.kill(actor)
    publish_s, put_get_s = float(np.median(publish)), float(np.median(put_get))
    return {"bytes": nbytes, "producers": producers, "publish_fetch_s": publish_s, "put_get_s": put_get_s,
            "ratio": publish_s / put_get_s, "fanout_s": float(np.median(fanned)),
            "ratio_to_fanout": publish_s / float(np.median(fanned)),
            "ready_s": float(np.median(ready)), "stall_s": float(np.median(stall)), "stall_max_s": float(max(stall)),
            "publish_gbps": nbytes / publish_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/weights.json"))
    parser.add_argument("--sizes-mb", type=positive_float, nargs="+", default=[1, 16, 256, 1024])
    parser.add_argument("--producers", type=positive_int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=positive_int, default=7,
                        help="timed rounds per configuration, their median reported (with 3, the 1 MB ratio moved 2x "
                             "between runs)")
    parser.add_argument("--in-place", action="store_true",
                        help="producers copy new weights into the live model (default: double-buffered swap)")
    parser.add_argument("--baseline", type=Path, help="report to compare with (default: the stored baseline)")
    args = parser.parse_args()
    check_report_paths(parser, args.out, args.baseline)

    start_local(2, namespace="streamrl", logging_level="WARNING")
    try:
        rows = [measure(int(mb * 2**20), n, args.repeats, not args.in_place)
                for mb in args.sizes_mb for n in args.producers]
    finally:
        ray.shutdown()
    four = [r for r in rows if r["producers"] == 4]
    results = {"rows": rows, "worst_ratio_4_producers": max((r["ratio"] for r in four), default=float("nan")),
               "max_stall_s": max(r["stall_max_s"] for r in rows),  # every update's, not the rows' medians
               "publish_4_producers_s": {f"{r['bytes'] / 2**20:g}MB": r["publish_fetch_s"] for r in four}}
    table = Table(title="streamrl weight streaming (median of repeats)")
    for column in ("size", "producers", "publish+fetch", "put+get", "ratio", "bare fan-out", "vs fan-out", "ready",
                   "stall/update (max)", "GB/s"):
        table.add_column(column, justify="right")
    for r in rows:
        flag = "" if r["producers"] != 4 else (" ok" if r["ratio"] <= TARGET_RATIO else " MISSED")
        table.add_row(f"{r['bytes'] / 2**20:,.0f} MB", str(r["producers"]), f"{r['publish_fetch_s'] * 1e3:,.1f} ms",
                      f"{r['put_get_s'] * 1e3:,.1f} ms", f"{r['ratio']:.2f}{flag}", f"{r['fanout_s'] * 1e3:,.1f} ms",
                      f"{r['ratio_to_fanout']:.2f}", f"{r['ready_s'] * 1e3:,.1f} ms",
                      f"{r['stall_s'] * 1e3:,.2f} ({r['stall_max_s'] * 1e3:,.2f}) ms", f"{r['publish_gbps']:.2f}")
    Console(width=150).print(table)
    sim = SimWorkload()
    decode_step_s = sim.decode_step_s(sim.sequences_per_producer) * sim.time_scale
    targets = [Target("worst_ratio_4_producers", "<=", TARGET_RATIO), Target("max_stall_s", "<=", decode_step_s)]
    finish("weights", args.out, workload={"mode": "in_place" if args.in_place else "double_buffered",
                                          "sizes_mb": args.sizes_mb, "producers": args.producers,
                                          "repeats": args.repeats, "sim_decode_step_s": decode_step_s},
           results=results, targets=targets, headline=[f"publish_4_producers_s.{k}" for k in
                                                        results["publish_4_producers_s"]],
           baseline=args.baseline or BASELINES / "baseline_weights.json")


if __name__ == "__main__":
    main()
