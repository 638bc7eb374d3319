"""How a published version enters an sglang server: the one interface of the server-side weight paths
and the one factory that picks a path from `producers.sglang.weights`.

```
 producer's weights thread: fetch ─► (version, weights) ─► path.loader_for(version, weights) ─► load
 engine, server by server:  pause ─► load(client) ─► label the version ─► continue
 "disk"         weights.disk            safetensors written once, /update_weights_from_disk per server
 "tensor"       weights.tensor_handles  bucket by bucket onto the server's GPU, CUDA IPC handles
 "distributed"  weights.broadcast       broadcast from the trainer's first rank, a group per server
```
An engine in the producer's own process (torch, sim) takes versions through the object store instead:
`weights.receiver` fetches and swaps them (`engine.local_weights`). A `Loader` is kept by the engine
that used it, to reload a restarted server with the newest weights (the distributed one then opens a
new group for the new process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamrl.config import SglangSection
from streamrl.sglang.client import SglangClient
from streamrl.weights.arrays import resolve
from streamrl.weights.broadcast import Sender, UpdateGroups, distributed_loader
from streamrl.weights.disk import DiskWeights
from streamrl.weights.tensor_handles import tensor_loader

Loader = Callable[[SglangClient], None]  # puts one version's weights into one server
LoaderFor = Callable[[int, Any], Loader]  # (version, what fetch returned) → how that version enters a server


@dataclass(frozen=True)
class ServerSlot:
    """What a weight path needs to know of one server: its address, the first of its GPUs as the
    producer's process numbers them, and which process it is now (its restart count)."""

    url: str
    first_gpu: int = 0
    generation: Callable[[], int] = lambda: 0


@dataclass
class ServerWeightPath:
    """One server-side weight path: `loader_for(version, weights)` with `weights` a version's arrays or
    `[object reference]` to them (read here only by the paths that move the bytes themselves), and
    `close()` for what it holds open (the distributed path's update groups)."""

    name: str
    loader_for: LoaderFor
    close: Callable[[], None] = field(default=lambda: None)


def server_weight_path(section: SglangSection, servers: Sequence[ServerSlot], *, model_dir: str,
                       directory: Path, group_prefix: str, sender: Sender | None = None,
                       node: str | None = None) -> ServerWeightPath:
    """The path `section.weights` names. `directory`: where "disk" writes versions; `group_prefix`: the
    distributed groups' names; `sender`: rank 0 of those groups (the trainer), seen from `node`."""
    bucket_bytes = section.bucket_mb << 20
    if section.weights == "disk":
        disk = DiskWeights(model_dir, directory)
        return ServerWeightPath("disk", lambda version, weights: disk.loader(version, resolve(weights)))
    if section.weights == "distributed":
        by_url = {slot.url: slot for slot in servers}  # a restarted server is a new process: a new group
        groups = UpdateGroups(sender, tensor_parallel=section.tensor_parallel, timeout_s=section.weights_timeout_s,
                              name=group_prefix, generation=lambda client: by_url[client.url].generation(),
                              node=node)
        return ServerWeightPath("distributed", lambda version, weights: distributed_loader(groups, weights,
                                                                                           bucket_bytes),
                                close=groups.close)
    if section.weights == "tensor":
        return _tensor_path(section, servers, bucket_bytes)
    raise ValueError(f"producers.sglang.weights: no weight path named {section.weights!r}")


def _tensor_path(section: SglangSection, servers: Sequence[ServerSlot], bucket_bytes: int) -> ServerWeightPath:
    first_gpu = {slot.url: slot.first_gpu for slot in servers}

    def devices_of(client: SglangClient) -> list[torch.device] | None:  # the server's GPUs; none: host memory
        if not torch.cuda.is_available():
            return None
        return [torch.device("cuda", first_gpu[client.url] + rank) for rank in range(section.tensor_parallel)]

    def loader_for(version: int, weights: Any) -> Loader:
        return tensor_loader(resolve(weights), bucket_bytes, tensor_parallel=section.tensor_parallel,
                             devices_of=devices_of)

    return ServerWeightPath("tensor", loader_for)
