"""A producer over sglang servers: groups admitted as slots free, their samples spread over the
producer's engines, weights rolled through the engines one at a time as the trainer publishes them.

```
 main loop:   free group slots ─► queue.admit(slots, version every engine holds) ─► tickets
              each ticket: G samples ─► the least busy engine (threads; HTTP calls run concurrently)
              a group's G samples done ─► rewards ─► Arrow batch ─► commit
                 └─ a server died under it (EngineLost) ─► abandon the ticket: its prompt comes back
 weights:     fetch newer (long poll) ─► engine by engine: pause, load, update_weight_version, continue
              (the others keep generating); load = "disk": write safetensors + config once,
              update_weights_from_disk; "distributed": the trainer broadcasts bucket by bucket over
              that server's update group (`streamrl.weights.broadcast`); "tensor": bucket by bucket as CUDA IPC
              handles (`streamrl.weights.tensor_handles`)
 stop:        running groups abandoned, finished ones committed
```
Every token carries the version of the weights that generated it (see `streamrl.engine.sglang.engine`).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file

from streamrl import failpoints
from streamrl.buffer.queue import Ticket
from streamrl.config import SglangSection
from streamrl.engine.generation import Generation
from streamrl.engine.sglang.client import SglangClient
from streamrl.engine.sglang.engine import EngineLost, EnginePool, Loader, Sample
from streamrl.engine.sglang.server import ServerProcess
from streamrl.rollout.producer import QueueClient, commit_or_give_back, pack_groups
from streamrl.tasks import Task
from streamrl.weights.arrays import resolve
from streamrl.weights.broadcast import Sender, UpdateGroups, distributed_loader
from streamrl.weights.receiver import Fetch
from streamrl.weights.tensor_handles import tensor_loader

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


class DiskWeights:
    """Published weights as a Hugging Face directory an sglang server can load: the arrays as
    safetensors next to the base model's config and tokenizer. Keeps the newest `keep` versions."""

    def __init__(self, base_model: str | Path, root: str | Path, keep: int = 2):
        self.base, self.root, self.keep = Path(base_model), Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, version: int, arrays: dict[str, np.ndarray]) -> Path:
        target = self.root / f"v{version:08d}"
        partial = target.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for name in MODEL_FILES:
            if (self.base / name).is_file():
                shutil.copy2(self.base / name, partial / name)
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(partial / "model.safetensors"))
        partial.rename(target)  # a server never sees a half-written version
        for old in sorted(self.root.glob("v*"))[:-self.keep]:
            shutil.rmtree(old)
        return target

    def loader(self, version: int, arrays: dict[str, np.ndarray]) -> Loader:
        """Write the version once; each server then loads it from the directory."""
        return disk_loader(str(self.write(version, arrays)))


def disk_loader(path: str) -> Loader:
    """Loads a written version into a server (kept by the engine, to reload after a restart)."""
    return lambda client: client.update_weights_from_disk(path)


LoaderFor = Callable[[int, Any], Loader]  # (version, weights) → how that version enters a server


def weight_path(section: SglangSection, servers: list[ServerProcess], *, model_dir: str, directory: Path,
                name: str, sender: Sender | None = None, node: str | None = None
                ) -> tuple[LoaderFor, UpdateGroups | None]:
    """The `loader_for` of `producers.sglang.weights` and the update groups to close with the servers
    ("distributed" only). `weights` is a version's arrays or `[object reference]` to them (read here
    only by the paths that move the bytes themselves). `directory`: where "disk" writes versions;
    `name`: the groups' prefix; `sender`: rank 0 of the groups (the trainer), seen from `node`."""
    bucket_bytes = section.bucket_mb << 20
    if section.weights == "disk":
        disk = DiskWeights(model_dir, directory)
        return (lambda version, weights: disk.loader(version, resolve(weights))), None
    if section.weights == "distributed":
        by_url = {s.url: s for s in servers}  # a restarted server is a new process: a new group
        groups = UpdateGroups(sender, tensor_parallel=section.tensor_parallel, timeout_s=section.weights_timeout_s,
                              name=name, generation=lambda client: by_url[client.url].restarts, node=node)
        return (lambda version, weights: distributed_loader(groups, weights, bucket_bytes)), groups
    first_gpu = {s.url: s.spec.base_gpu_id for s in servers}  # as this process numbers its GPUs

    def devices_of(client: SglangClient) -> list[torch.device] | None:  # the server's GPUs; none: host memory
        if not torch.cuda.is_available():
            return None
        return [torch.device("cuda", first_gpu[client.url] + rank) for rank in range(section.tensor_parallel)]

    return (lambda version, weights: tensor_loader(resolve(weights), bucket_bytes,
                                                   tensor_parallel=section.tensor_parallel,
                                                   devices_of=devices_of)), None


class SglangProducer:
    def __init__(self, producer_id: int, *, queue: QueueClient, pool: EnginePool, task: Task, group_size: int,
                 max_groups: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 fetch: Fetch | None = None, loader_for: LoaderFor | None = None,
                 weight_poll_s: float = 1.0, admit_timeout: float = 0.2):
        """Weights are fetched with `fetch` and go into each server by `loader_for(version, weights)`
        (`weights`: what `fetch` returned; see `weight_path`); neither: the servers keep theirs."""
        if (fetch is None) != (loader_for is None):
            raise ValueError("weights need both a fetch function and a loader_for (how a version enters a server)")
        self.producer_id, self.queue, self.pool, self.task = producer_id, queue, pool, task
        self.group_size, self.max_groups, self.max_new_tokens = group_size, max_groups, max_new_tokens
        self.sampling = {"temperature": temperature, "top_p": top_p, "stop_token_ids": list(task.stop_token_ids)}
        self.fetch, self.loader_for = fetch, loader_for
        self.weight_poll_s, self.admit_timeout = weight_poll_s, admit_timeout
        self._samples = ThreadPoolExecutor(max_workers=max_groups * group_size, thread_name_prefix="sample")
        self._weights_error: BaseException | None = None
        self.stats: dict[str, Any] = {"groups": 0, "samples": 0, "generated_tokens": 0, "lost_groups": 0,
                                      "expired_groups": 0, "weight_updates": 0, "update_pause_s": 0.0}
        self.last_blocked_by: str | None = None
        self._loaded = threading.Event()  # set by the weights thread after each version it loads
        # (wall time, version) each time every engine holds a newer version, as `WeightReceiver.history`
        self.history: list[tuple[float, int]] = []

    def run(self, stop: threading.Event) -> None:
        """Generate until `stop` is set; a commit or weights failure is raised here."""
        updater = threading.Thread(target=self._follow_weights, args=(stop,), name="weights", daemon=True)
        if self.fetch is not None:
            updater.start()
        running: dict[int, tuple[Ticket, list[int], list[Future], float]] = {}
        try:
            while not stop.is_set():
                if self._weights_error is not None:
                    raise self._weights_error
                self._admit(running)
                self._collect(running, timeout=0.05)
        finally:
            for _, _, futures, _ in running.values():
                for future in futures:
                    future.cancel()
            if running:
                self.queue.abandon(list(running))
            self._samples.shutdown(wait=False, cancel_futures=True)
            stop.set()
            if updater.is_alive():
                updater.join()

    def _admit(self, running: dict) -> None:
        free = self.max_groups - len(running)
        if free <= 0:
            return
        admission = self.queue.admit(self.producer_id, free, weights_version=self.pool.version,
                                     timeout=self.admit_timeout if not running else 0.0)
        self.last_blocked_by = admission.blocked_by
        if admission.blocked_by == "stale_weights" and not running:
            # refused at once: only newer weights open slots, so wait for them (not a busy loop)
            self._loaded.wait(self.admit_timeout)
            self._loaded.clear()
        for ticket in admission.tickets:
            prompt = list(self.task.prompt(ticket.prompt_id))
            futures = [self._samples.submit(self._sample, prompt) for _ in range(self.group_size)]
            running[ticket.ticket_id] = (ticket, prompt, futures, time.time())

    def _sample(self, prompt: list[int]) -> Sample:
        return self.pool.pick().sample(prompt, max_new_tokens=self.max_new_tokens, **self.sampling)

    def _collect(self, running: dict, timeout: float) -> None:
        pending = [f for _, _, futures, _ in running.values() for f in futures if not f.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        for ticket_id in [t for t, (_, _, futures, _) in running.items() if all(f.done() for f in futures)]:
            ticket, prompt, futures, started = running.pop(ticket_id)
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                self.queue.abandon([ticket_id])  # its prompt is generated again
                lost = [e for e in errors if not isinstance(e, EngineLost)]
                if lost:
                    raise lost[0]
                self.stats["lost_groups"] += 1
                continue
            self._commit(ticket, prompt, [f.result() for f in futures], started)

    def _commit(self, ticket: Ticket, prompt: list[int], samples: list[Sample], started: float) -> None:
        lengths = [len(s.tokens) for s in samples]
        generation = Generation(tokens=np.concatenate([s.tokens for s in samples]),
                                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                                logprobs=np.concatenate([s.logprobs for s in samples]),
                                versions=np.concatenate([s.versions for s in samples]),
                                finish=np.array([s.finish for s in samples], dtype=np.int8))
        rewards = np.array([self.task.reward(ticket.prompt_id, generation.response(i)) for i in range(len(samples))],
                           dtype=np.float32)
        batch = pack_groups([ticket], [prompt], generation, rewards, group_size=self.group_size,
                            producer_id=self.producer_id, t_start=started, t_end=time.time())
        if not commit_or_give_back(self.queue, batch, [ticket.ticket_id]):
            self.stats["expired_groups"] += 1
            return
        failpoints.hit("producer.after_commit")  # committed: its ticket is the queue's now
        self.stats["groups"] += 1
        self.stats["samples"] += len(samples)
        self.stats["generated_tokens"] += int(sum(lengths))

    def _follow_weights(self, stop: threading.Event) -> None:
        """Newest weights into each engine in turn (rolling: one engine paused at a time). The loader
        is kept by each engine to reload a restarted server: the distributed one opens a new group for it."""
        have: int | None = None
        try:
            while not stop.is_set():
                got = self.fetch(have, self.weight_poll_s)
                if got is None:
                    continue
                version, arrays = got
                pauses = self.pool.update_weights(version, self.loader_for(version, arrays))
                self.history.append((time.time(), version))
                have = version
                self.stats["weight_updates"] += 1
                self.stats["update_pause_s"] += sum(pauses)
                self._loaded.set()
        except BaseException as exc:
            self._weights_error = exc
