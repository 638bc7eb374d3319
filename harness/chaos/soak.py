"""A bounded soak of the queue actor: many producers admit and commit at full rate against a trainer
stand-in that publishes new weights every step, while the queue actor's memory and the object store are
sampled. It answers whether a long run stays within its configured bounds, not how fast it goes.

```
 SoakProducer ×N ──admit(n, weights v)──► QueueActor ◄──get(B)────── SoakConsumer (trainer stand-in)
   │ synthetic batch ──commit──────────►   (owns each      fetch_table, drop it; set_version(v + 1)
   │                                        batch object)   ray.put(weights_mb) ──publish(v + 1)──┐
   └──acquire (every weights_every_s, or at once when refused for stale weights) ──► WeightsActor ◄┘
 driver, every sample_every_s: the queue actor's RSS split into private (anonymous) and object-store
 (shared) pages from /proc, status(), the object store's bytes (the raylet's store stats)
```
Producers and the consumer stop at a wall-clock deadline; the driver then takes what is still queued,
so every committed group id is accounted for: consumed exactly once, or counted as regenerated
(`over_budget`). Nothing here waits on a fake clock: all figures are real calls through Ray.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any, Literal

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator

from harness.synthetic import synthetic_batch
from streamrl.buffer.actor import NAMESPACE, create_queue_actor, fetch_table
from streamrl.buffer.config import QueueConfig
from streamrl.runtime.clients import RemoteQueue
from streamrl.weights.actor import WeightsActor

MB = 2**20


QUICK = {"producers": 8, "duration_s": 30.0}  # `bench soak --quick` and `bench chaos --quick`
FULL = {"producers": 16, "duration_s": 120.0}

class SoakConfig(BaseModel):
    """One soak: the load, the queue under it and the bounds it is judged against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    producers: int = Field(8, ge=1, le=256)
    """Producer actors, each looping admit → synthetic batch → commit as fast as it can."""

    duration_s: float = Field(30.0, gt=0)
    """How long producers and the consumer run (the drain and the final samples come after)."""

    weights_mb: float = Field(4.0, ge=0)
    """Size of the weights the consumer `ray.put`s and publishes after every step."""

    seed: int = 0

    group_size: int = Field(8, ge=1)
    """G: samples per group."""

    groups_per_step: int = Field(16, ge=1)
    """B: groups the consumer takes per step."""

    max_staleness: int = Field(2, ge=0)
    """η of the queue."""

    max_in_flight: int = Field(64, ge=1)
    """Groups admitted but not committed, over all producers."""

    capacity_tokens: int = Field(48_000, ge=1)
    """The queue's token capacity. The default is below what the staleness budget would admit
    ((η + 1)·B groups of ~1,400 tokens), so capacity can bind before staleness does, and just above
    one step of the longest groups (the smallest capacity that cannot starve the consumer)."""

    groups_per_batch: int = Field(4, ge=1)
    """Groups a producer asks for per admit (and commits in one batch)."""

    prompt_len: tuple[int, int] = (8, 64)
    """Prompt tokens per sample, drawn uniformly from this inclusive range."""

    response_len: tuple[int, int] = (32, 256)
    """Response tokens per sample, drawn uniformly from this inclusive range."""

    admit_timeout_s: float = Field(0.5, gt=0)
    """How long one admit waits for a slot (the real producers' long poll)."""

    weights_every_s: float = Field(0.0, ge=0)
    """A producer asks for newer weights before an admit when this long has passed since it last asked
    (0: before every admit, as a real producer's long-polling receiver holds each version within
    milliseconds), and at once when refused for stale weights."""

    sample_every_s: float = Field(0.5, gt=0)
    """Period of the memory and object-store samples."""

    release_lag_s: float = Field(2.0, ge=0)
    """How long a released object may still count in the store: the raylet deletes freed objects in
    batches, every `free_objects_period_milliseconds` (1 s by default in Ray 2.60), after the owner has
    heard from every borrower. Objects released this recently are allowed on top of the live bound."""

    warmup_fraction: float = Field(0.25, ge=0, lt=1)
    """Part of the run left out of the growth figures: imports, allocator arenas, Arrow's pool and the
    first weight versions all settle in the first seconds."""

    rss_growth_limit_mb: float = Field(50.0, gt=0)
    """Largest growth of the queue actor's private (anonymous) memory after warm-up that still counts
    as bounded. Its RSS also counts the object-store pages it has written (`ray.put` of each batch),
    which the store's allocator spreads over its mapping: that part is bounded by the store, and judged
    there. The actor's real state is bounded by the capacity (metadata of a few hundred groups: well under 1 MB) plus
    one byte per ticket ever issued (~0.1 MB per 100k groups); what moves beyond that in a healthy
    actor is allocator and RPC-buffer noise, a few to ~20 MB. A leak of consumed batches or their
    references at these rates (tens of MB/s of batches) crosses 50 MB within seconds."""

    inject_leak: Literal["none", "weights", "batches"] = "none"
    """Make the consumer keep every weights version it publishes, or every step's groups (the references
    to consumed batches): what a registry or a queue that never let go would do. To check that the
    verdicts catch a leak; never set in a real soak."""

    @model_validator(mode="after")
    def _capacity_can_fill_a_step(self) -> SoakConfig:
        # A capacity below one step's worth of tokens would leave the consumer waiting forever.
        most = self.groups_per_step * self.group_size * (self.prompt_len[1] + self.response_len[1])
        if self.capacity_tokens < most:
            raise ValueError(f"capacity_tokens={self.capacity_tokens} < {most}: B={self.groups_per_step} groups "
                             f"of the longest samples could not be queued at once, a step might never fill")
        for name in ("prompt_len", "response_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}={getattr(self, name)}: need 1 <= low <= high")
        return self

    def queue_config(self) -> QueueConfig:
        return QueueConfig(group_size=self.group_size, groups_per_step=self.groups_per_step,
                           max_staleness=self.max_staleness, max_in_flight=self.max_in_flight,
                           capacity_tokens=self.capacity_tokens)


class SoakProducer:
    """Admit → build a valid batch for the tickets → commit, timing each call; weights now and then. It
    admits and commits through the producers' own client (`RemoteQueue`: a lease on every admission, the
    batch taken from this actor's outbox by the queue), so the soak loads the path runs use."""

    def __init__(self, producer_id: int, queue: ray.actor.ActorHandle, weights: ray.actor.ActorHandle,
                 config: dict[str, Any]):
        self.id, self.weights = producer_id, weights
        self.client = RemoteQueue(queue, producer_id)
        self.cfg = SoakConfig(**config)
        self.rng = np.random.default_rng([self.cfg.seed, producer_id])
        self.version: int | None = None
        self.held: Any = None  # the fetched weights: holding them keeps that version's object alive

    def ready(self) -> int:
        return os.getpid()

    def take_batch(self, key: int):
        return self.client.outbox.take(key)  # the queue actor fetching a committed batch

    def _fetch_weights(self, timeout: float) -> bool:
        got = ray.get(self.weights.acquire.remote(self.id, self.version, timeout))
        if got is None:
            return False
        self.version, (ref,) = got
        self.held = None  # release the old version before mapping the new one
        self.held = ray.get(ref)
        return True

    def run(self, deadline: float) -> dict[str, Any]:
        cfg = self.cfg
        admit_ms, commit_ms, committed, blocked, blocked_s = [], [], [], Counter(), Counter()
        fetches, next_fetch = 0, 0.0
        try:
            while time.time() < deadline:
                if time.monotonic() >= next_fetch:
                    fetches += self._fetch_weights(timeout=0.0 if self.version is not None else 30.0)
                    next_fetch = time.monotonic() + cfg.weights_every_s
                started = time.perf_counter()
                adm = self.client.admit(self.id, cfg.groups_per_batch, weights_version=self.version,
                                        timeout=cfg.admit_timeout_s)
                if not adm.tickets:
                    blocked[adm.blocked_by] += 1
                    blocked_s[adm.blocked_by] += time.perf_counter() - started
                    if adm.blocked_by == "stale_weights":
                        fetches += self._fetch_weights(timeout=cfg.admit_timeout_s)
                    continue
                admit_ms.append((time.perf_counter() - started) * 1e3)
                # Stamped with the weights held, as a real producer's tokens are: never newer than the
                # queue's version, since the trainer sets the version before it publishes.
                batch = synthetic_batch(adm.tickets, cfg.group_size, version=self.version,
                                        prompt_len=cfg.prompt_len, response_len=cfg.response_len, rng=self.rng)
                started = time.perf_counter()
                committed += self.client.commit(batch)
                commit_ms.append((time.perf_counter() - started) * 1e3)
        finally:
            self.held = None
            ray.get(self.weights.drop_holder.remote(self.id))
        return {"admit_ms": np.asarray(admit_ms, np.float32), "commit_ms": np.asarray(commit_ms, np.float32),
                "committed": committed, "blocked_by": dict(blocked), "blocked_s": dict(blocked_s),
                "weight_fetches": fetches}


class SoakConsumer:
    """The trainer without the training: take B groups, fetch their rows, advance, publish weights."""

    def __init__(self, queue: ray.actor.ActorHandle, weights: ray.actor.ActorHandle, config: dict[str, Any]):
        self.queue, self.weights = queue, weights
        self.cfg = SoakConfig(**config)
        self.arrays = {"w": np.zeros(int(self.cfg.weights_mb * MB), np.uint8)}
        self.version = 0
        self.leaked: list[Any] = []  # only with `inject_leak`

    def publish_first(self) -> None:
        ray.get(self.weights.publish.remote(0, [ray.put(self.arrays)]))

    def run(self, deadline: float) -> dict[str, Any]:
        cfg = self.cfg
        consumed, prompts, get_ms, publish_ms, stale_max = [], [], [], [], 0
        last_publish = None
        while time.time() < deadline:
            started = time.perf_counter()
            got = ray.get(self.queue.get.remote(cfg.groups_per_step, 0.5))
            if got is None:
                continue
            table = fetch_table(got)
            get_ms.append((time.perf_counter() - started) * 1e3)
            if table.num_rows != cfg.groups_per_step * cfg.group_size:
                raise RuntimeError(f"step {self.version}: {table.num_rows} rows for {cfg.groups_per_step} groups")
            consumed += [g.group_id for g in got.groups]
            prompts += [g.prompt_id for g in got.groups]
            stale_max = max(stale_max, *got.staleness)
            if cfg.inject_leak == "batches":
                self.leaked.append(got)
            del table, got  # the step is done with its rows: the batches may go once the queue drops them
            self.version += 1
            started = time.perf_counter()
            ray.get(self.queue.set_version.remote(self.version))  # before publishing, as the trainer does
            if last_publish is not None:
                ray.get(last_publish)  # versions reach the (threaded) weights actor in order
            self.arrays["w"][:8] = self.version % 256  # a new version, not a copy of an identical one
            ref = ray.put(self.arrays)
            if cfg.inject_leak == "weights":
                self.leaked.append(ref)
            last_publish = self.weights.publish.remote(self.version, [ref])
            del ref
            publish_ms.append((time.perf_counter() - started) * 1e3)
        if last_publish is not None:
            ray.get(last_publish)
        return {"consumed": consumed, "prompts": prompts, "steps": self.version, "staleness_max": stale_max,
                "get_ms": np.asarray(get_ms, np.float32), "publish_ms": np.asarray(publish_ms, np.float32)}


class ObjectStoreProbe:
    """Bytes and objects in the cluster's object stores, from the raylets' store statistics.

    `ray.available_resources()["object_store_memory"]` is a scheduling resource that does not move
    when objects are put; `ray.util.state.list_objects` needs the dashboard and walks every reference.
    The raylet's `FormatGlobalMemoryInfo` without per-object detail is one small RPC (~5 ms) returning
    the store's own counters; internal in Ray 2.60 (what `ray memory --stats-only` prints)."""

    def __init__(self) -> None:
        from ray._private.internal_api import get_state_from_address

        self._state = get_state_from_address(ray.get_runtime_context().gcs_address)

    def sample(self) -> tuple[int, int]:
        from ray._private.internal_api import get_memory_info_reply

        stats = get_memory_info_reply(self._state, timeout_seconds=10.0).store_stats
        return int(stats.object_store_bytes_used), int(stats.num_local_objects)

    def settled(self, until: int = -1, quiet_s: float = 1.5, timeout_s: float = 15.0) -> tuple[int, int]:
        """(bytes, objects) once the bytes are at most `until`, or nothing has changed for `quiet_s`
        (longer than the raylet's batched frees): objects being freed are not counted as held."""
        deadline = time.monotonic() + timeout_s
        last, since = self.sample(), time.monotonic()
        while last[0] > until and time.monotonic() - since < quiet_s and time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.sample()
            if now != last:
                last, since = now, time.monotonic()
        return last


def process_memory_mb(pid: int) -> dict[str, float]:
    """Resident memory of a local process from /proc (Linux, as Ray's workers are): `rss`, split into
    `anon` (its private heap: what a leak in the process grows) and `shmem` (shared-memory pages it
    touched: the object store's mapping)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssShmem": "shmem"}
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in fields:
                values[fields[key]] = int(rest.split()[0]) / 1024  # kB
    return values


def percentiles_ms(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"n": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"n": int(len(values)), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(values.max())}


def growth(times: np.ndarray, values: np.ndarray, after: float) -> tuple[float, float]:
    """(end − start, slope per minute) of `values` after warm-up: medians of the first and last three
    samples (one sample's jitter is no growth), slope by least squares."""
    kept = times >= after
    t, v = times[kept], values[kept]
    if len(v) < 2:
        return 0.0, 0.0
    head, tail = float(np.median(v[:3])), float(np.median(v[-3:]))
    slope = float(np.polyfit(t, v, 1)[0]) * 60 if len(v) >= 3 and np.ptp(t) > 0 else 0.0
    return tail - head, slope


def largest_group_bytes(cfg: SoakConfig) -> int:
    """Arrow bytes of the longest possible group (measured on a synthetic batch, so the bound follows
    the schema)."""
    from streamrl.buffer.queue import Ticket

    tickets = [Ticket(i, i, 0, 0, 0.0) for i in range(cfg.groups_per_batch)]
    batch = synthetic_batch(tickets, cfg.group_size, prompt_len=cfg.prompt_len[1],
                            response_len=cfg.response_len[1])
    return -(-batch.nbytes // cfg.groups_per_batch)


def store_bounds(cfg: SoakConfig, steps_per_s: float) -> dict[str, int]:
    """How much of the object store the soak may use (bytes above what was there before it), if
    consumed batches and old weights are released.

    Live batches: a committed batch object lives while one of its groups is queued or a step holds it.
    The queue holds at most (η + 1)·B running + queued groups (the staleness budget) and stops admitting
    at `capacity_tokens`; worst case each of those groups keeps a whole batch of `groups_per_batch`
    alive. Add one batch per producer in transit (a large `commit` argument goes through the store) and
    the step the consumer holds. Live weights: the registry keeps the newest version and each one a
    producer holds (≤ producers + 1), and the consumer has put one more that is being published.
    Released, not yet deleted: each step of the last `release_lag_s` released one version and up to B
    batches. After the drain only the newest version may stay (+ one being freed, + 1 MB slack)."""
    group = largest_group_bytes(cfg)
    batch = group * cfg.groups_per_batch
    live_groups = (cfg.max_staleness + 1) * cfg.groups_per_step
    batches = (live_groups + cfg.producers + cfg.groups_per_step) * batch
    weights = int(cfg.weights_mb * MB)
    live_weights = (cfg.producers + 2) * weights
    lag = int(cfg.release_lag_s * steps_per_s * (weights + cfg.groups_per_step * batch))
    return {"group_bytes": group, "batches": batches, "weights": live_weights, "release_lag": lag,
            "run": batches + live_weights + lag, "drained": 2 * weights + MB}


def run_soak(**knobs: Any) -> dict[str, Any]:
    """Run one soak inside an initialised single-node Ray (the queue actor's memory is read from /proc
    on this machine); `SoakConfig` fields as keywords. Returns the report: latencies, rates, samples,
    the accounting of every committed group and the verdicts `memory_bounded`, `object_store_bounded`."""
    if not ray.is_initialized():
        raise RuntimeError("run_soak needs an initialised Ray (ray.init first)")
    cfg = SoakConfig(**knobs)
    run_name = f"soak-{os.getpid()}-{time.time_ns()}"
    probe = ObjectStoreProbe()
    store_before, _ = probe.settled()  # an earlier run in this Ray may still be freeing its objects
    actors: list[ray.actor.ActorHandle] = []
    try:
        queue = create_queue_actor(run_name, cfg.queue_config(), max_concurrency=cfg.producers + 8)
        actors.append(queue)
        weights = ray.remote(num_cpus=0, max_concurrency=cfg.producers + 4)(WeightsActor).options(
            name=f"{run_name}/weights", namespace=NAMESPACE).remote()
        actors.append(weights)
        consumer = ray.remote(num_cpus=0)(SoakConsumer).remote(queue, weights, cfg.model_dump())
        actors.append(consumer)
        producer_cls = ray.remote(num_cpus=0, max_concurrency=2)(SoakProducer)  # its run, and the queue's take
        producers = [producer_cls.remote(i, queue, weights, cfg.model_dump()) for i in range(cfg.producers)]
        actors += producers
        ray.get(consumer.publish_first.remote())
        ray.get([p.ready.remote() for p in producers])  # started before the clock: rates exclude start-up
        queue_pid = ray.get(queue.pid.remote())

        started = time.time()
        deadline = started + cfg.duration_s
        runs = [p.run.remote(deadline) for p in producers]
        consuming = consumer.run.remote(deadline)
        samples = []
        while True:
            now = time.time()
            memory = process_memory_mb(queue_pid)
            status = ray.get(queue.status.remote())
            store, objects = probe.sample()
            samples.append({"t": now - started, "rss_mb": memory["rss"], "private_mb": memory["anon"],
                            "shmem_mb": memory["shmem"], "store_mb": (store - store_before) / MB,
                            "store_objects": objects,
                            "queued_groups": status["queued_groups"], "queued_tokens": status["queued_tokens"],
                            "running": status["running"], "version": status["version"]})
            if now >= deadline:
                break
            time.sleep(max(0.0, min(cfg.sample_every_s - (time.time() - now), deadline - time.time())))

        produced = ray.get(runs)
        consumed = ray.get(consuming)
        elapsed = time.time() - started
        # Take what is still queued, so that every committed group is accounted for.
        drained: list[int] = []
        drained_prompts: list[int] = []
        while left := ray.get(queue.status.remote())["queued_groups"]:
            got = ray.get(queue.get.remote(left, 0.0))  # None if some went over budget meanwhile: ask again
            if got is not None:
                drained += [g.group_id for g in got.groups]
                drained_prompts += [g.prompt_id for g in got.groups]
            del got
        final_status = ray.get(queue.status.remote())
        weights_status = ray.get(weights.status.remote())
        bounds = store_bounds(cfg, consumed["steps"] / elapsed)
        # The store frees objects shortly after their last reference goes: within the bound at once, or
        # once it has stopped changing (what is left then is held by someone).
        store_after, objects_after = probe.settled(until=store_before + bounds["drained"])
        memory_after = process_memory_mb(queue_pid)
    finally:
        for actor in actors:
            ray.kill(actor)
    return report(cfg, samples, produced, consumed, drained, drained_prompts, final_status, weights_status,
                  elapsed=elapsed, store_drained=store_after - store_before, objects_drained=objects_after,
                  bounds=bounds, private_drained_mb=memory_after["anon"])


def report(cfg: SoakConfig, samples: list[dict[str, Any]], produced: list[dict[str, Any]],
           consumed: dict[str, Any], drained: list[int], drained_prompts: list[int], status: dict[str, Any],
           weights_status: dict[str, Any], *, elapsed: float, store_drained: int, objects_drained: int,
           bounds: dict[str, int], private_drained_mb: float) -> dict[str, Any]:
    committed = [i for p in produced for i in p["committed"]]
    taken = consumed["consumed"] + drained
    prompts = consumed["prompts"] + drained_prompts
    committed_set, taken_set = set(committed), set(taken)
    # Each committed group is consumed once or regenerated (over budget: its prompt generated again).
    accounting = {
        "committed": len(committed), "consumed": len(consumed["consumed"]), "drained": len(drained),
        "regenerated": status["over_budget"],
        "duplicated_commits": len(committed) - len(committed_set),
        "duplicated_consumed": len(taken) - len(taken_set),
        "duplicated_prompts": len(prompts) - len(set(prompts)),
        "consumed_not_committed": len(taken_set - committed_set),
        "lost": len(committed_set - taken_set) - status["over_budget"],
        "queue_counters_agree": status["committed"] == len(committed) and status["consumed"] == len(taken),
        "left_queued": status["queued_groups"], "left_running": status["running"],
    }
    accounting["ok"] = (accounting["queue_counters_agree"] and accounting["lost"] == 0
                        and not any(accounting[k] for k in ("duplicated_commits", "duplicated_consumed",
                                                            "duplicated_prompts", "consumed_not_committed",
                                                            "left_queued", "left_running")))

    t = np.array([s["t"] for s in samples])
    warmup = cfg.warmup_fraction * cfg.duration_s
    rss = np.array([s["rss_mb"] for s in samples])
    private = np.array([s["private_mb"] for s in samples])
    store = np.array([s["store_mb"] for s in samples])
    private_growth, private_slope = growth(t, private, warmup)
    rss_growth, rss_slope = growth(t, rss, warmup)
    shmem_growth, _ = growth(t, np.array([s["shmem_mb"] for s in samples]), warmup)
    store_growth, store_slope = growth(t, store, warmup)
    after = t >= warmup
    store_peak_run = float(store[after].max()) if after.any() else float(store.max())
    queued_tokens = np.array([s["queued_tokens"] for s in samples])
    # Admission checks capacity when it admits: groups already in flight may still land on top of it.
    queue_token_bound = cfg.capacity_tokens + cfg.max_in_flight * cfg.group_size * (cfg.prompt_len[1] +
                                                                                   cfg.response_len[1])
    admit_ms = np.concatenate([p["admit_ms"] for p in produced])
    commit_ms = np.concatenate([p["commit_ms"] for p in produced])
    blocked: Counter[str] = Counter()
    blocked_s: Counter[str] = Counter()
    for p in produced:
        blocked.update(p["blocked_by"])
        blocked_s.update(p["blocked_s"])
    memory_bounded = private_growth < cfg.rss_growth_limit_mb
    store_bounded = store_peak_run * MB <= bounds["run"] and store_drained <= bounds["drained"]
    return {
        "config": cfg.model_dump(),
        "elapsed_s": elapsed,
        "admit_ms": percentiles_ms(admit_ms),
        "commit_ms": percentiles_ms(commit_ms),
        "consumer_get_ms": percentiles_ms(consumed["get_ms"]),
        "consumer_publish_ms": percentiles_ms(consumed["publish_ms"]),
        "commits_per_s": len(commit_ms) / elapsed,
        "groups_per_s": len(committed) / elapsed,
        "consumed_groups_per_s": len(consumed["consumed"]) / elapsed,
        "steps": consumed["steps"], "steps_per_s": consumed["steps"] / elapsed,
        "staleness_max": consumed["staleness_max"],
        "admit_blocked": dict(blocked),
        "admit_blocked_s": dict(blocked_s),  # producer time spent in refused admits, by reason
        "weight_fetches": sum(p["weight_fetches"] for p in produced),
        "accounting": accounting,
        "memory": {
            "warmup_s": warmup, "limit_mb": cfg.rss_growth_limit_mb,
            "rss_peak_mb": float(rss.max()), "rss_growth_mb": rss_growth, "rss_slope_mb_per_min": rss_slope,
            "private_peak_mb": float(private.max()), "private_growth_mb": private_growth,
            "private_slope_mb_per_min": private_slope, "private_after_drain_mb": private_drained_mb,
            "shmem_growth_mb": shmem_growth,  # object-store pages first touched after warm-up
        },
        "object_store": {
            "peak_mb": float(store.max()), "peak_after_warmup_mb": store_peak_run,
            "end_of_run_mb": float(store[-1]), "growth_mb": store_growth, "slope_mb_per_min": store_slope,
            "after_drain_mb": store_drained / MB,
            "objects_after_drain": objects_drained,
            "bound_run_mb": bounds["run"] / MB, "bound_drained_mb": bounds["drained"] / MB,
            "bound_batches_mb": bounds["batches"] / MB, "bound_weights_mb": bounds["weights"] / MB,
            "bound_release_lag_mb": bounds["release_lag"] / MB,
            "weights_stored_versions": len(weights_status["stored"]),
            "weights_released_versions": weights_status["released"],
        },
        "queue": {"queued_tokens_peak": int(queued_tokens.max()), "queued_tokens_bound": queue_token_bound,
                  "queued_groups_peak": int(max(s["queued_groups"] for s in samples)),
                  "bounded": bool(queued_tokens.max() <= queue_token_bound)},
        "memory_bounded": bool(memory_bounded),
        "object_store_bounded": bool(store_bounded),
        "samples": samples,
    }
