"""A producer's sglang engine from the run config: its servers started, the weight path chosen, the pool.

```
 servers    producers.sglang.servers × tensor_parallel GPUs of the producer's; server j of producer i listens
            on base_port + i × servers + j, with its own API key
 weights    "disk": safetensors written once, /update_weights_from_disk on each server
            "distributed": broadcast from the trainer's first rank over one update group per server
            "tensor": bucket by bucket onto the server's GPU, passed as CUDA IPC handles
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from streamrl.config import RunConfig, SglangSection
from streamrl.engine.sglang.engine import EventLoopThread, SglangEngine
from streamrl.engine.sglang.pool import LoaderFor, SglangPool, SglangWeights
from streamrl.engine.sglang.server import ServerProcess, ServerSpec
from streamrl.sglang.client import SglangClient
from streamrl.sglang.protocol import check_server_version
from streamrl.tasks import Task
from streamrl.weights.arrays import resolve
from streamrl.weights.broadcast import Sender, UpdateGroups, distributed_loader
from streamrl.weights.disk import DiskWeights
from streamrl.weights.receiver import Fetch
from streamrl.weights.tensor_handles import tensor_loader


def sglang_engine(cfg: RunConfig, *, producer_id: int, model_dir: str, seed: int, fetch: Fetch,
                  search_path: str | None = None, work_dir: str | None = None, sender: Sender | None = None,
                  group_prefix: str = "streamrl-", node: str | None = None) -> tuple[SglangPool, Task]:
    """Start this producer's servers (in parallel) and return the pool over them and the task.
    `fetch` returns `[object reference]` to each version; `work_dir` holds server logs and "disk"
    versions; `sender` is rank 0 of the "distributed" update groups, seen from `node`."""
    from transformers import AutoTokenizer

    from streamrl.tasks import make_task

    sg = cfg.producers.sglang
    task = make_task(cfg.task, AutoTokenizer.from_pretrained(model_dir), seed=cfg.run.seed, search_path=search_path)
    servers = [ServerProcess(ServerSpec(model_path=model_dir, host=sg.host,
                                        port=sg.base_port + producer_id * sg.servers + j,
                                        tensor_parallel=sg.tensor_parallel, mem_fraction=sg.mem_fraction,
                                        base_gpu_id=j * sg.tensor_parallel, memory_saver=sg.memory_saver,
                                        seed=seed + j, extra_args=list(sg.extra_args), launcher=sg.launcher),
                             log_dir=work_dir, startup_timeout_s=sg.startup_timeout_s)
               for j in range(sg.servers)]
    io = EventLoopThread()
    try:
        for server in servers:
            server.start(wait=False)  # the servers load in parallel
        for server in servers:
            server.wait_healthy()
            # a server outside the protocol's versions would refuse loads (or accept them differently) later
            check_server_version(SglangClient(server.url, api_key=server.spec.api_key).server_version(), server.url)
        versions = Path(work_dir or model_dir) / f"weights-producer-{producer_id}"  # "disk" writes here
        loader_for, groups = weight_path(sg, servers, model_dir=model_dir, directory=versions, name=group_prefix,
                                         sender=sender, node=node)
    except BaseException:
        _stop(servers, None)
        io.close()
        raise
    engines = [SglangEngine(SglangClient(s.url), io, server=s) for s in servers]
    return SglangPool(engines, io, capacity=cfg.producers.groups_per_batch * cfg.queue.group_size,
                      max_new_tokens=cfg.sampling.max_new_tokens or task.max_new_tokens(),
                      stop_token_ids=task.stop_token_ids, temperature=cfg.sampling.temperature,
                      top_p=cfg.sampling.top_p,
                      weights=SglangWeights(engines, fetch, loader_for, poll_s=cfg.producers.weight_poll_s),
                      on_close=lambda: _stop(servers, groups)), task


def _stop(servers: list[ServerProcess], groups: UpdateGroups | None) -> None:
    try:
        if groups is not None:
            groups.close()
    finally:
        for server in servers:
            server.stop()


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

    def loader_for(version: int, weights: Any):
        return tensor_loader(resolve(weights), bucket_bytes, tensor_parallel=section.tensor_parallel,
                             devices_of=devices_of)

    return loader_for, None
