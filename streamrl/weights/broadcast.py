"""Weights into sglang servers by broadcast over one torch.distributed group per server
(`producers.sglang.weights = "distributed"`): NCCL on GPUs, gloo on CPU.

```
 open (once per server process, lazily):
   producer: TCPStore host (rank 0) ──┬── joins as rank 0
   thread:   POST /init_weights_update_group (master, port, rank_offset 1, world 1 + TP) ─► server ranks join
 load one version (the engine has paused that server):
   per bucket: thread: POST /update_weights_from_distributed (names, dtypes, shapes)  ─► server receives
               (the last bucket: flush_cache, the prefix cache was computed by the old weights)
               producer: broadcast each tensor of the bucket from rank 0, in the same order
               join the POST (its error raises), then the broadcasts (bounded by the group's timeout)
 a failed load drops the group (its state is unknown); a restarted server gets a new one
```
The producer is the sender: it already holds each version's arrays (from the object store). The
group is built without the default process group (a trainer may own one in other processes), the way
sglang's `init_custom_process_group` builds its side: a TCPStore that rank 0 hosts, a `PrefixStore`
named after the group, torch's `_new_process_group_helper`. Matching that layout is what lets rank 0
here meet the server's ranks in the store.
"""

from __future__ import annotations

import datetime
import itertools
import socket
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from streamrl.engine.sglang.client import SglangClient
from streamrl.runtime.net import is_loopback

_names = itertools.count()  # group names are unique in this process (torch refuses a name twice)


def plan_buckets(arrays: Mapping[str, np.ndarray], bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into buckets of at most `bucket_bytes` each (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[str]] = []
    size = 0
    for name, array in arrays.items():
        if not buckets or (size + array.nbytes > bucket_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += array.nbytes
    return buckets


def dtype_name(array: np.ndarray) -> str:
    """The dtype as sglang reads it (`getattr(torch, name)`): "float32", "bfloat16", ..."""
    return str(torch.from_numpy(np.empty(0, array.dtype)).dtype).removeprefix("torch.")


def reaching_address(host: str, port: int) -> str:
    """This machine's address as the server sees it: loopback for a loopback server, else the address
    of the interface that routes to it (a UDP connect sends nothing)."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def join_group(store: dist.Store, *, backend: str, world_size: int, rank: int, group_name: str,
               timeout_s: float) -> Any:
    """Join a process group through `store`, outside the default group (sglang's layout, see above)."""
    group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                              group_name=group_name,
                                              timeout=datetime.timedelta(seconds=timeout_s))
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}  # group rank = rank in the group
    return group


class _Call(threading.Thread):
    """A blocking call in a thread, its result or error kept for `result`."""

    def __init__(self, name: str, fn: Callable[[], Any]):
        super().__init__(name=name, daemon=True)
        self.fn, self.value, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc

    def result(self, timeout_s: float, what: str) -> Any:
        self.join(timeout_s)
        if self.is_alive():
            raise TimeoutError(f"{what}: no answer within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return self.value


class UpdateGroup:
    """The group between this process (rank 0) and one server process's TP ranks (1 … TP)."""

    def __init__(self, client: SglangClient, *, tensor_parallel: int = 1, backend: str | None = None,
                 timeout_s: float = 300.0, name: str = "streamrl", device: torch.device | None = None):
        self.client, self.tensor_parallel, self.timeout_s = client, tensor_parallel, timeout_s
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.name = f"{name}-{client.port}-{next(_names)}"
        # NCCL moves CUDA tensors only: each bucket is copied to `device` first, a GPU the server does not
        # use (NCCL refuses a group with two ranks on one device). Not run on a CPU machine.
        if self.backend == "nccl" and device is None:
            raise ValueError("an NCCL update group needs the device to send from (one the server does not use)")
        self.device = device if self.backend == "nccl" else None
        self.group: Any = None

    def open(self) -> None:
        world = 1 + self.tensor_parallel
        address = reaching_address(self.client.host, self.client.port)
        store = dist.TCPStore(address, 0, world, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                              wait_for_workers=False)  # port 0: a free one, no race with another process
        server = _Call("init-update-group", lambda: self.client.init_weights_update_group(
            master_address=address, master_port=store.port, rank_offset=1, world_size=world,
            group_name=self.name, backend=self.backend, timeout_s=self.timeout_s))
        joining = _Call("join-update-group", lambda: join_group(
            store, backend=self.backend, world_size=world, rank=0, group_name=self.name, timeout_s=self.timeout_s))
        server.start()
        joining.start()
        server.result(self.timeout_s, f"{self.client.url}/init_weights_update_group")  # its refusal raises at once
        self.group = joining.result(self.timeout_s, f"joining update group {self.name}")
        self._store = store  # rank 0 hosts the store: it lives as long as the group

    def send(self, names: Sequence[str], arrays: Sequence[np.ndarray], *, flush_cache: bool = False) -> None:
        """One bucket: announce it to the server and broadcast its tensors, in order; `flush_cache`
        (the version's last bucket): the server then drops its prefix cache, computed by the old weights."""
        if self.group is None:
            raise RuntimeError(f"update group {self.name} is not open")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")  # object-store arrays: only read
            tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if self.device is not None:
            tensors = [t.to(self.device, non_blocking=True) for t in tensors]
        post = _Call("update-from-distributed", lambda: self.client.update_weights_from_distributed(
            list(names), [dtype_name(a) for a in arrays], [list(a.shape) for a in arrays], group_name=self.name,
            flush_cache=flush_cache, timeout_s=self.timeout_s))
        post.start()
        works = [dist.broadcast(t, group_src=0, group=self.group, async_op=True) for t in tensors]
        post.result(self.timeout_s + 5.0, f"{self.client.url}/update_weights_from_distributed")
        for work in works:  # the server has everything; these finish at once (or time out, bounded)
            work.wait(datetime.timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            c10d.destroy_process_group(group)
        self._store = None


class UpdateGroups:
    """One open group per server process, opened on first use. `generation(client)` names the server
    process behind a client (its restart count): a restarted server is a new process, outside the old
    group, so it gets a new one."""

    def __init__(self, *, tensor_parallel: int = 1, backend: str | None = None, timeout_s: float = 300.0,
                 name: str = "streamrl", generation: Callable[[SglangClient], int] = lambda client: 0,
                 device_of: Callable[[SglangClient], torch.device | None] = lambda client: None):
        self.tensor_parallel, self.backend, self.timeout_s, self.name = tensor_parallel, backend, timeout_s, name
        self.generation, self.device_of = generation, device_of
        self._groups: dict[str, tuple[int, UpdateGroup]] = {}
        self._lock = threading.Lock()
        self.opened = 0

    def get(self, client: SglangClient) -> UpdateGroup:
        generation = self.generation(client)
        with self._lock:
            held = self._groups.get(client.url)
        if held is not None and held[0] == generation:
            return held[1]
        self.drop(client)
        group = UpdateGroup(client, tensor_parallel=self.tensor_parallel, backend=self.backend,
                            timeout_s=self.timeout_s, name=self.name, device=self.device_of(client))
        group.open()
        with self._lock:
            self._groups[client.url] = (generation, group)
            self.opened += 1
        return group

    def drop(self, client: SglangClient) -> None:
        with self._lock:
            held = self._groups.pop(client.url, None)
        if held is not None:
            held[1].close()

    def close(self) -> None:
        with self._lock:
            held, self._groups = list(self._groups.values()), {}
        for _, group in held:
            group.close()


def distributed_loader(groups: UpdateGroups, arrays: Mapping[str, np.ndarray],
                       bucket_bytes: int) -> Callable[[SglangClient], None]:
    """A `load(client)` for `SglangEngine.update_weights`: `arrays` bucket by bucket over that server's
    group. A load that fails drops the group, so the next one (after a restart, say) opens a new one."""
    buckets = plan_buckets(arrays, bucket_bytes)

    def load(client: SglangClient) -> None:
        group = groups.get(client)
        try:
            for i, names in enumerate(buckets):
                group.send(names, [arrays[name] for name in names], flush_cache=i == len(buckets) - 1)
        except BaseException:
            groups.drop(client)
            raise

    return load
