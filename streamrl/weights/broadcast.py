"""Weights into sglang servers by broadcast over one torch.distributed group per server
(`producers.sglang.weights = "distributed"`): from the trainer's first rank, NCCL on GPUs, gloo on CPU.

```
 open (once per server process, lazily), driven by the producer that owns the server:
   sender (trainer rank 0): host a TCPStore, join as rank 0 in a thread        ◄─ open_group
   producer: POST /init_weights_update_group (the sender's address, rank_offset 1, world 1 + TP)
   sender: the join completes once the server's ranks are in                   ◄─ joined
 load one version (the engine has paused that server): POST /begin_weight_update, then per bucket:
   producer: POST /update_weights_from_distributed (names, dtypes, shapes) in a thread
   sender: broadcast each tensor of the bucket from rank 0, in the same order  ◄─ broadcast
   wait for both together (bounded by the group's timeout): an error on either side raises at once,
   not after the other side's timeout (a sender that fails leaves the server's POST waiting for tensors
   that never come); a server's refusal, which breaks the broadcast too, is the error raised
 then POST /end_weight_update (sglang ≥ 0.5.21 refuses a load outside the session, without joining
 the broadcast: the sender's side would wait for peers that never come until the group is closed)
 a failed load drops the group on both sides (/destroy_weights_update_group: its state is unknown);
 a restarted server gets a new one
```
The producer drives (it owns the server, its API key and the pause around a load); the sender
moves the bytes. In a run the sender is the trainer's rank-0 actor (`GroupSender` behind Ray calls),
sending from its own GPU: never one of the servers' (NCCL refuses a group with two ranks on one device),
and straight from the trainer's node. The weights it sends are the version the producer holds, by
object reference: the registry keeps that version alive while the producer holds it. A `GroupSender`
in the producer's own process serves the tests. Each group is built without the default process
group (the trainer owns one for its ranks), the way sglang's `init_custom_process_group` builds its
side: a TCPStore that rank 0 hosts, a `PrefixStore` named after the group, torch's
`_new_process_group_helper`. Matching that layout is what lets rank 0 meet the server's ranks.
"""

from __future__ import annotations

import datetime
import itertools
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from streamrl.net import is_loopback
from streamrl.sglang.client import EngineTimeout, EngineUnreachable, SglangClient, SglangError
from streamrl.weights.arrays import read_only_tensors, resolve

# Group names are unique across processes (torch refuses a name twice in one, and a replacement
# producer must not reuse a dead one's names in the sender): this process's token, then a count.
_names = itertools.count()
_PROCESS_TOKEN = secrets.token_hex(4)
_REFUSAL_GRACE_S = 1.0  # after the sender's error, how long the server's refusal may take to come first


def plan_buckets(arrays: Mapping[str, np.ndarray | TensorSpec], bucket_bytes: int) -> list[list[str]]:
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


@dataclass(frozen=True)
class TensorSpec:
    """What a server is told of a tensor before it receives it."""

    dtype: str  # sglang's name, see dtype_name
    shape: tuple[int, ...]
    nbytes: int


def manifest(arrays: Mapping[str, np.ndarray]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(dtype_name(a), tuple(a.shape), a.nbytes) for name, a in arrays.items()}


def reaching_address(host: str, port: int) -> str:
    """This machine's address as the server sees it: loopback for a loopback server, else the address
    of the interface that routes to it (a UDP connect sends nothing)."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


_CLOSED_POLL_S = 0.2  # how often a wait for a join looks whether its group was closed meanwhile
_NCCL_ERRORS = threading.Lock()  # the error-handling variable is read while an NCCL group is built


def join_group(store: dist.Store, *, backend: str, world_size: int, rank: int, group_name: str,
               timeout_s: float) -> Any:
    """Join a process group through `store`, outside the default group (sglang's layout, see above).
    An NCCL group is built with error handling 2 (clean up only): by default a collective that times
    out, or a peer that dies, tears the whole process down, and the sender is the trainer."""
    if backend != "nccl":
        # Gloo connects to every rank while the group is built. Under the lock, a join whose server had
        # died held every other join for its whole timeout, and a replaced producer's new servers timed
        # out waiting for the trainer to join their groups.
        return _build_group(store, backend=backend, world_size=world_size, rank=rank, group_name=group_name,
                            timeout_s=timeout_s)
    with _NCCL_ERRORS:  # NCCL connects at the first collective: the lock is held only while it is built
        saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            return _build_group(store, backend=backend, world_size=world_size, rank=rank, group_name=group_name,
                                timeout_s=timeout_s)
        finally:
            if saved is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved


def _build_group(store: dist.Store, *, backend: str, world_size: int, rank: int, group_name: str,
                 timeout_s: float) -> Any:
    group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=datetime.timedelta(seconds=timeout_s))
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}  # group rank = rank in the group
    return group


class _Call(threading.Thread):
    """A blocking call in a thread, its result or error kept for `result`; put on `done` when it ends."""

    def __init__(self, name: str, fn: Callable[[], Any], done: queue.SimpleQueue | None = None):
        super().__init__(name=name, daemon=True)
        self.fn, self.value, self.error, self.done = fn, None, None, done
        self.ended = threading.Event()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended.set()
            if self.done is not None:
                self.done.put(self)

    def result(self, timeout_s: float, what: str) -> Any:
        if not self.ended.wait(timeout_s):
            raise TimeoutError(f"{what}: no answer within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return self.value


def _join_all(calls: dict[_Call, str], done: queue.SimpleQueue, timeout_s: float) -> None:
    """Wait for `calls` (each put on `done` when it ends, named by its value in `calls`), raising the first
    error as soon as it appears rather than after the others end; a call still running at the end raises
    TimeoutError."""
    deadline = time.monotonic() + timeout_s
    pending = dict(calls)
    while pending:
        try:
            call = done.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            call = next(iter(pending))
            raise TimeoutError(f"{pending[call]}: no answer within {timeout_s:.0f} s") from None
        call.result(0.0, pending.pop(call))


class Sender(Protocol):
    """Rank 0 of the update groups: the process that sends the weights (see the module docstring).
    `weights`: a version's arrays, or `[object reference]` to them (`streamrl.weights.arrays.resolve`)."""

    def open_group(self, name: str, world: int, *, server: tuple[str, int], node: str | None,
                   timeout_s: float) -> tuple[str, int, str]: ...

    def joined(self, name: str, timeout_s: float) -> None: ...

    def manifest(self, weights: Any) -> dict[str, TensorSpec]: ...

    def broadcast(self, name: str, weights: Any, names: list[str], timeout_s: float) -> None: ...

    def close_group(self, name: str) -> None: ...


class GroupSender:
    """Rank 0 of one group per server: hosts each group's store, joins it, broadcasts buckets into it.
    Thread-safe: producers' calls arrive concurrently. `node`: this machine's address as other nodes
    reach it (None: a single machine)."""

    def __init__(self, *, backend: str | None = None, node: str | None = None):
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # NCCL moves CUDA tensors only: each bucket is copied to this process's GPU first (not run here)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        self.node = node
        self._lock = threading.Lock()
        self._joining: dict[str, tuple[dist.Store, _Call]] = {}
        self._groups: dict[str, tuple[dist.Store, Any]] = {}  # rank 0 hosts the store: it lives with the group
        self.stats = {"groups": 0, "buckets": 0, "bytes": 0}

    def open_group(self, name: str, world: int, *, server: tuple[str, int], node: str | None,
                   timeout_s: float) -> tuple[str, int, str]:
        """Host the group's store and start joining it; (address, port, backend) for the server. `node`:
        the address of the server's node (None: this one)."""
        address = reaching_address(*server) if node is None or node == self.node else self.node
        store = dist.TCPStore(address, 0, world, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)  # port 0: a free one, no race with another process
        joining = _Call("join-update-group", lambda: join_group(
            store, backend=self.backend, world_size=world, rank=0, group_name=name, timeout_s=timeout_s))
        with self._lock:
            if name in self._joining or name in self._groups:
                raise ValueError(f"update group {name} is already open")
            self._joining[name] = (store, joining)
        joining.start()
        return address, store.port, self.backend

    def joined(self, name: str, timeout_s: float) -> None:
        """Wait until the server's ranks are in the group. Raises on a timeout, a failed join, or the group
        closed meanwhile: a dead producer's call returns then, rather than hold one of the trainer's
        threads until its server's join times out."""
        with self._lock:
            if name in self._groups:
                return  # joined by an earlier call
            if name not in self._joining:  # closed before this call came: the caller's producer is gone
                raise RuntimeError(f"update group {name} is not being joined (closed, or never opened)")
            store, joining = self._joining[name]
        deadline = time.monotonic() + timeout_s
        while not joining.ended.wait(min(_CLOSED_POLL_S, max(0.0, deadline - time.monotonic()))):
            with self._lock:
                closed = name not in self._joining
            if closed:
                raise RuntimeError(f"update group {name} was closed while it was being joined")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"joining update group {name}: no answer within {timeout_s:.0f} s")
        group = joining.result(0.0, f"joining update group {name}")
        with self._lock:
            if self._joining.pop(name, None) is None:  # closed meanwhile: close_group destroys it
                raise RuntimeError(f"update group {name} was closed while it was being joined")
            self._groups[name] = (store, group)
            self.stats["groups"] += 1

    def manifest(self, weights: Any) -> dict[str, TensorSpec]:
        return manifest(resolve(weights))

    def broadcast(self, name: str, weights: Any, names: list[str], timeout_s: float) -> None:
        """The tensors `names` of `weights` from rank 0, in order."""
        with self._lock:
            held = self._groups.get(name)
        if held is None:
            raise RuntimeError(f"update group {name} is not open")
        tensors = read_only_tensors(resolve(weights), names)
        if self.device is not None:
            tensors = [t.to(self.device, non_blocking=True) for t in tensors]
        works = [dist.broadcast(t, group_src=0, group=held[1], async_op=True) for t in tensors]
        for work in works:
            work.wait(datetime.timedelta(seconds=timeout_s))
        with self._lock:
            self.stats["buckets"] += 1
            self.stats["bytes"] += sum(t.numel() * t.element_size() for t in tensors)

    def close_group(self, name: str) -> None:
        """Leave the group (one still being joined is left once its join ends; see `joined`)."""
        with self._lock:
            held = self._groups.pop(name, None)
            joining = self._joining.pop(name, None)
        if held is not None:
            c10d.destroy_process_group(held[1])
        if joining is not None:
            threading.Thread(target=_destroy_when_joined, args=(joining[1],), daemon=True).start()

    def close_groups(self, prefix: str) -> int:
        """Leave every group whose name starts with `prefix` (a dead producer's); how many."""
        with self._lock:
            names = [n for n in [*self._groups, *self._joining] if n.startswith(prefix)]
        for name in names:
            self.close_group(name)
        return len(names)

    def close(self) -> None:
        self.close_groups("")


def _destroy_when_joined(joining: _Call) -> None:
    joining.join()
    if joining.error is None and joining.value is not None:
        c10d.destroy_process_group(joining.value)


class UpdateGroup:
    """The group between the sender (rank 0) and one server process's TP ranks (1 … TP), driven from
    the producer that owns the server."""

    def __init__(self, client: SglangClient, sender: Sender, *, tensor_parallel: int = 1, timeout_s: float = 300.0,
                 name: str = "streamrl", node: str | None = None):
        self.client, self.sender, self.tensor_parallel, self.timeout_s = client, sender, tensor_parallel, timeout_s
        self.name, self.node = f"{name}-{_PROCESS_TOKEN}-{client.port}-{next(_names)}", node
        self.open_ = False

    def open(self) -> None:
        world = 1 + self.tensor_parallel
        address, port, backend = self.sender.open_group(self.name, world, server=(self.client.host, self.client.port),
                                                        node=self.node, timeout_s=self.timeout_s)
        done: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        server = _Call("init-update-group", lambda: self.client.init_weights_update_group(
            master_address=address, master_port=port, rank_offset=1, world_size=world, group_name=self.name,
            backend=backend, timeout_s=self.timeout_s), done)
        joining = _Call("sender-joins", lambda: self.sender.joined(self.name, self.timeout_s), done)
        server.start()
        joining.start()
        try:  # either side's failure raises at once: a sender that cannot join leaves the server waiting
            _join_all({server: f"{self.client.url}/init_weights_update_group",
                       joining: f"the sender joining {self.name}"}, done, self.timeout_s + 5.0)
        except BaseException as exc:
            self.sender.close_group(self.name)
            if exc is joining.error and server.ended.wait(_REFUSAL_GRACE_S) and server.error is not None:
                raise server.error  # noqa: B904 - the server's refusal says why; the sender's error stays on it
            raise
        self.open_ = True

    def send(self, names: Sequence[str], specs: Sequence[TensorSpec], weights: Any) -> None:
        """One bucket: announce it to the server while the sender broadcasts it from `weights` (inside
        the server's weight-update session). A refused announcement, or a broadcast that fails (no group,
        no memory for the bucket), raises at once (the sender's error up to `_REFUSAL_GRACE_S` later, in
        case the server refuses too); the other side then ends with the group, which the caller drops."""
        if not self.open_:
            raise RuntimeError(f"update group {self.name} is not open")
        done: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        post = _Call("update-from-distributed", lambda: self.client.update_weights_from_distributed(
            list(names), [s.dtype for s in specs], [list(s.shape) for s in specs], group_name=self.name,
            timeout_s=self.timeout_s), done)
        sending = _Call("broadcast", lambda: self.sender.broadcast(self.name, weights, list(names), self.timeout_s),
                        done)
        post.start()
        sending.start()
        try:
            _join_all({post: f"{self.client.url}/update_weights_from_distributed",
                       sending: f"broadcast into {self.name}"}, done, self.timeout_s + 5.0)
        except BaseException as exc:
            # a server that refuses the bucket (a new process, outside the group) breaks the sender's
            # broadcast too, as fast: its refusal says why, the sender's "peer closed" does not
            if exc is sending.error and post.ended.wait(_REFUSAL_GRACE_S) and post.error is not None:
                raise post.error  # noqa: B904 - the sender's error stays on it as its context
            raise

    def close(self, *, on_server: bool = False) -> None:
        """Leave the group on the sender's side and, with `on_server`, on the server's (which keeps a
        group it joined until told: after a failed load, say). A server that died took its group along; one
        that does not answer in time (EngineTimeout) is alive and may still hold it: that raises."""
        if not self.open_:
            return
        self.open_ = False
        try:
            if on_server:
                try:
                    self.client.destroy_weights_update_group(self.name)
                except EngineTimeout:
                    raise  # the server is alive and may still hold the group: not a death to ignore
                except EngineUnreachable:
                    pass  # the server process is gone, and its side of the group with it
                except SglangError as exc:  # "does not exist": the server never joined (a new process, say)
                    if "does not exist" not in str(exc):
                        raise
        finally:
            self.sender.close_group(self.name)


class UpdateGroups:
    """One open group per server process, opened on first use. `generation(client)` names the server
    process behind a client (its restart count): a restarted server is a new process, outside the old
    group, so it gets a new one. `sender`: rank 0 of every group (default: this process); `node`: the
    address of this process's node, for a sender on another one."""

    def __init__(self, sender: Sender | None = None, *, tensor_parallel: int = 1, timeout_s: float = 300.0,
                 name: str = "streamrl", generation: Callable[[SglangClient], int] = lambda client: 0,
                 node: str | None = None):
        self.sender = sender if sender is not None else GroupSender()
        self.tensor_parallel, self.timeout_s, self.name, self.node = tensor_parallel, timeout_s, name, node
        self.generation = generation
        self._groups: dict[str, tuple[int, UpdateGroup]] = {}
        self._lock = threading.Lock()
        self.opened = 0

    def get(self, client: SglangClient) -> UpdateGroup:
        generation = self.generation(client)
        with self._lock:
            held = self._groups.get(client.url)
        if held is not None and held[0] == generation:
            return held[1]
        self.drop(client, on_server=False)  # a restarted server is a new process: it never joined the old group
        group = UpdateGroup(client, self.sender, tensor_parallel=self.tensor_parallel, timeout_s=self.timeout_s,
                            name=self.name, node=self.node)
        group.open()
        with self._lock:
            self._groups[client.url] = (generation, group)
            self.opened += 1
        return group

    def drop(self, client: SglangClient, *, on_server: bool = True) -> None:
        with self._lock:
            held = self._groups.pop(client.url, None)
        if held is not None:
            held[1].close(on_server=on_server)

    def close(self) -> None:
        """At shutdown: the sender's side only (the servers are being stopped)."""
        with self._lock:
            held, self._groups = list(self._groups.values()), {}
        for _, group in held:
            group.close()


def distributed_loader(groups: UpdateGroups, weights: Any, bucket_bytes: int) -> Callable[[SglangClient], None]:
    """A `load(client)` for `SglangEngine.update_weights`: one version bucket by bucket over that
    server's group, the sender broadcasting from `weights` (arrays, or `[object reference]`: then this
    process reads only the sender's manifest, never the arrays). A load that fails drops the group, so
    the next one (after a restart, say) opens a new one."""
    specs = groups.sender.manifest(weights)
    buckets = plan_buckets(specs, bucket_bytes)

    def load(client: SglangClient) -> None:
        group = groups.get(client)
        try:
            with client.weight_update_session():
                for names in buckets:
                    group.send(names, [specs[name] for name in names], weights)
        except BaseException as exc:
            try:
                groups.drop(client)
            except Exception as dropping:  # the load's own error says what went wrong: it raises
                exc.add_note(f"dropping the update group of {client.url} failed too: {dropping!r}")
            raise

    return load
