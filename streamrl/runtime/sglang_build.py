"""A producer's sglang engine from the run config: its servers started, the weight path chosen, the pool.

```
 servers    producers.sglang.servers × tensor_parallel GPUs of the producer's; server j of producer i listens
            on base_port + i × servers + j, with its own API key
 weights    the path `producers.sglang.weights` names (`weights.server_paths`: disk, tensor, distributed)
```
"""

from __future__ import annotations

from pathlib import Path

from streamrl.config import RunConfig
from streamrl.engine.sglang.engine import EventLoopThread, SglangEngine
from streamrl.engine.sglang.pool import SglangPool, SglangWeights
from streamrl.engine.sglang.server import ServerProcess, ServerSpec
from streamrl.sglang.client import SglangClient
from streamrl.sglang.protocol import check_server_version
from streamrl.tasks import Task
from streamrl.weights.broadcast import Sender
from streamrl.weights.receiver import Fetch
from streamrl.weights.server_paths import ServerSlot, ServerWeightPath, server_weight_path


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
        slots = [ServerSlot(s.url, first_gpu=s.spec.base_gpu_id, generation=lambda s=s: s.restarts) for s in servers]
        path = server_weight_path(sg, slots, model_dir=model_dir, directory=versions, group_prefix=group_prefix,
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
                      weights=SglangWeights(engines, fetch, path.loader_for, poll_s=cfg.producers.weight_poll_s),
                      on_close=lambda: _stop(servers, path)), task


def _stop(servers: list[ServerProcess], path: ServerWeightPath | None) -> None:
    try:
        if path is not None:
            path.close()
    finally:
        for server in servers:
            server.stop()
