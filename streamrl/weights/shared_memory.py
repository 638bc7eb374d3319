"""Weights to producers on the trainer's machine through shared memory, without Ray's control plane.

```
 trainer (SharedWeightsWriter)                         producer (SharedWeightsListener thread)
   write(v, arrays): into a slot no reader holds        recv: token, v + the slot's file descriptor
     (exclusive lock; a new slot if every one is read)      map the slot (once per slot), shared lock,
   announce(address, token, v, slot) ──datagram──►          header says v? → offer(v, views), unlock
                                                             else a newer version overwrote it: skip
```
Each slot is an anonymous memory file (`memfd`) holding one version: a header, a manifest of the arrays
and their bytes. Its descriptor travels with each announcement (SCM_RIGHTS over an abstract UNIX
socket), so no name exists on disk and nothing outlives the processes that hold it. A producer reads
under a shared POSIX lock, so the trainer never overwrites a version being copied: it takes another
slot, or makes one (at most one per reader plus one). Publishing costs the trainer one copy of the
weights and a datagram per producer, against three Ray calls and an object-store read per producer,
which at a few MB dominate (`benchmarks/weights.py`). Producers on other machines, and versions larger
than `SHARED_MAX_BYTES`, go through the object store; a producer the datagram cannot reach does too.

Each announcement carries the token its listener made: only the trainer, told it over Ray, can
announce. POSIX locks belong to a process and any close of the file releases them, so one thread
(the listener's) takes them and closes duplicate descriptors only while it holds none.
"""

from __future__ import annotations

import array
import fcntl
import json
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

SHARED_MAX_BYTES = 64 * 2**20  # above: one more copy per step costs the trainer more than Ray's hops save
_HEADER = struct.Struct("<qq")  # version, manifest bytes
_ALIGN = 64
_MESSAGE = struct.Struct("<16sq")  # token, version
_MAPPED_SLOTS = 8  # a listener keeps this many slots mapped (the trainer keeps at most readers + 1)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list[int], int]:
    """(manifest, each array's offset in the slot, slot size): the arrays at aligned offsets after the manifest."""
    entries, offset = [], 0
    for name, array_ in arrays.items():
        entries.append([name, array_.dtype.str, list(array_.shape), offset])
        offset = _aligned(offset + array_.nbytes)
    manifest = json.dumps(entries).encode()
    start = _aligned(_HEADER.size + len(manifest))
    return manifest, [start + entry[3] for entry in entries], start + max(offset, 1)


@dataclass(frozen=True)
class SharedAddress:
    """Where a listener receives announcements: `node` (Ray's node id: only a trainer on the same
    machine can reach it), its abstract socket name and the token an announcement must carry."""

    node: str
    name: str
    token: bytes


class _Slot:
    def __init__(self, size: int):
        self.fd = os.memfd_create("streamrl-weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.size = size
        self.buffer = mmap.mmap(self.fd, size)
        self.version: int | None = None

    def try_lock(self) -> bool:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: a reader holds it
            return False
        return True

    def unlock(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        # The mapping is dropped, not closed: it goes with the last view of it (one may live on in an
        # exception's traceback, and closing a mapping with views raises).
        del self.buffer
        os.close(self.fd)


class SharedWeightsWriter:
    """The trainer's side: `write` a version into a free slot, `announce` it to each listener."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []  # oldest version first
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)  # a listener that stopped reading is skipped, never waited for

    @property
    def slots(self) -> int:
        return len(self._slots)

    def write(self, version: int, arrays: Mapping[str, np.ndarray]) -> _Slot:
        manifest, offsets, size = _layout(arrays)
        slot = self._free_slot(size)
        try:
            # No version while it is written: a write that fails halfway leaves no half of one behind a
            # header a late announcement of the slot's previous version would still match.
            _HEADER.pack_into(slot.buffer, 0, -1, 0)
            slot.version = None
            for offset, array_ in zip(offsets, arrays.values()):
                target = np.frombuffer(slot.buffer, array_.dtype, array_.size, offset)
                np.copyto(target.reshape(array_.shape), array_, casting="no")
            slot.buffer[_HEADER.size:_HEADER.size + len(manifest)] = manifest
            _HEADER.pack_into(slot.buffer, 0, version, len(manifest))
            slot.version = version
        finally:
            slot.unlock()
        self._slots.remove(slot)
        self._slots.append(slot)
        return slot

    def views(self, slot: _Slot) -> dict[str, np.ndarray]:
        """Read-only views of the version `slot` holds (valid until the next `write`: this process takes
        no lock against itself)."""
        arrays = read_slot(slot.buffer, slot.version, {})
        if arrays is None:
            raise RuntimeError(f"the slot holds no version {slot.version}")
        return arrays

    def _free_slot(self, size: int) -> _Slot:
        """A slot of at least `size` bytes that no reader holds, locked; the oldest such one."""
        for slot in list(self._slots):
            if slot.size < size or slot.size > 2 * size:  # the weights changed size: a slot that fits them
                if slot.try_lock():
                    self._slots.remove(slot)
                    slot.close()
                continue
            if slot.try_lock():
                return slot
        slot = _Slot(size)
        if not slot.try_lock():
            raise RuntimeError("a new weights slot is locked by another process")
        self._slots.append(slot)
        return slot

    def announce(self, address: SharedAddress, version: int, slot: _Slot) -> bool:
        """Tell a listener `version` is in `slot`; False when it cannot be reached (gone, or not reading)."""
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [slot.fd]))]
        try:
            self._socket.sendmsg([_MESSAGE.pack(address.token, version)], fds, 0, "\0" + address.name)
        except (ConnectionRefusedError, FileNotFoundError, BlockingIOError) as exc:
            log.warning("producer socket %s not reachable (%s): weights go through the object store", address.name,
                        exc)
            return False
        return True

    def close(self) -> None:
        self._socket.close()
        for slot in self._slots:
            slot.close()
        self._slots = []


Offer = Callable[[int, dict[str, np.ndarray]], object]


class _Mapped:
    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)

    def close(self) -> None:
        del self.buffer  # as `_Slot.close`
        os.close(self.fd)


class SharedWeightsListener:
    """A producer's side: a thread that receives announcements and calls `offer(version, arrays)` with
    read-only views of the slot, holding the slot's lock until `offer` returns (it copies them into
    the standby model). `copy`: the offer keeps the arrays past its return (in-place loading), so it
    gets copies. `on_error`: told if reading fails (the thread ends; the producer should stop)."""

    def __init__(self, offer: Offer, *, node: str, copy: bool = False,
                 on_error: Callable[[BaseException], object] | None = None):
        self._offer, self._copy, self._on_error = offer, copy, on_error
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"streamrl-weights-{secrets.token_hex(8)}"
        self._socket.bind("\0" + name)
        self._socket.settimeout(0.2)  # how soon `stop` is seen
        self.address = SharedAddress(node=node, name=name, token=secrets.token_bytes(16))
        self._mapped: OrderedDict[tuple[int, int], _Mapped] = OrderedDict()  # (device, inode) → slot
        self._manifests: dict[bytes, list] = {}  # the last manifest read, parsed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.received = self.skipped = 0
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._listen, name="shared-weights", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                message, fds, _, _ = socket.recv_fds(self._socket, _MESSAGE.size + 1, 1)
            except TimeoutError:
                continue
            try:
                self.receive(message, fds)
            except BaseException as exc:
                self.error = exc
                if self._on_error is None:
                    raise
                self._on_error(exc)
                return

    def receive(self, message: bytes, fds: list[int]) -> bool:
        """One announcement (the listener thread's; called directly by tests): True when offered."""
        if len(message) != _MESSAGE.size or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            log.warning("ignored a malformed weights announcement (%d bytes, %d descriptors)", len(message), len(fds))
            return False
        token, version = _MESSAGE.unpack(message)
        if not secrets.compare_digest(token, self.address.token):
            os.close(fds[0])
            log.warning("ignored a weights announcement with a wrong token")
            return False
        slot = self._map(fds[0])
        fcntl.lockf(slot.fd, fcntl.LOCK_SH)  # waits while the trainer writes into this slot
        try:
            arrays = read_slot(slot.buffer, version, self._manifests)
            if arrays is None:  # overwritten by a newer version, announced after this one
                self.skipped += 1
                return False
            self.received += 1
            self._offer(version, {k: v.copy() for k, v in arrays.items()} if self._copy else arrays)
            del arrays  # views of the slot: none may outlive the lock
        finally:
            fcntl.lockf(slot.fd, fcntl.LOCK_UN)
        return True

    def _map(self, fd: int) -> _Mapped:
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        mapped = self._mapped.get(key)
        if mapped is not None and mapped.buffer.size() == stat.st_size:
            os.close(fd)  # a duplicate of the one kept: this thread holds no lock now (see the module docstring)
            self._mapped.move_to_end(key)
            return mapped
        if mapped is not None:
            mapped.close()
        mapped = self._mapped[key] = _Mapped(fd)
        while len(self._mapped) > _MAPPED_SLOTS:
            self._mapped.popitem(last=False)[1].close()
        return mapped


def read_slot(buffer: mmap.mmap, version: int, manifests: dict[bytes, list]) -> dict[str, np.ndarray] | None:
    """Views of the arrays of `version` in a slot (None: the slot holds another version now). `manifests`
    keeps the last manifest parsed (one model per run), so a version costs no JSON parsing."""
    written, manifest_bytes = _HEADER.unpack_from(buffer, 0)
    if written != version:
        return None
    raw = bytes(buffer[_HEADER.size:_HEADER.size + manifest_bytes])
    manifest = manifests.get(raw)
    if manifest is None:
        manifests.clear()
        manifest = manifests[raw] = json.loads(raw)
    start, arrays = _aligned(_HEADER.size + manifest_bytes), {}
    for name, dtype, shape, offset in manifest:
        count = int(np.prod(shape, dtype=np.int64))
        array_ = np.frombuffer(buffer, np.dtype(dtype), count, start + offset).reshape(shape)
        array_.flags.writeable = False  # the writer's mapping is writable; nothing may change a published version
        arrays[name] = array_
    return arrays
