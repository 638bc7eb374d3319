"""Weights to producers on the trainer's machine through shared memory, without Ray's control plane.

```
 trainer (SharedWeightsWriter)                         producer (SharedWeightsListener thread)
   write(v, arrays): into a slot no reader holds        accept the trainer's connection (our user only)
     (exclusive lock; a new slot if every one is read)  recv: token, v + the slot's read-only descriptor
   announce(address, token, v, slot) ──message──►           map the slot (once per slot), shared lock,
     (over one connection per listener)                      header says v? → offer(v, views), unlock
                                                             else a newer version overwrote it: skip
```
Each slot is an anonymous memory file (`memfd`) holding one version: a header, a manifest of the arrays
and their bytes. A read-only descriptor of it travels with each announcement (SCM_RIGHTS over a
connection to an abstract UNIX socket), so no name exists on disk and nothing outlives the processes
that hold it. A producer reads under a shared POSIX lock, so the trainer never overwrites a version
being copied: it takes another slot, or makes one (at most one per reader plus one). Publishing costs
the trainer one copy of the weights and a message per producer, against three Ray calls and an
object-store read per producer, which at a few MB dominate (`benchmarks/weights.py`). Producers on
other machines, and versions larger than `SHARED_MAX_BYTES`, go through the object store; a producer
the message cannot reach does too.

Each announcement carries the token its listener made: only the trainer, told it over Ray, can
announce. The other way round, a listener's name is visible to every local user (/proc/net/unix) and
anyone may bind it once the listener is gone: the trainer connects once per listener, only to a socket
its own user bound in the listener's process (SO_PEERCRED), and the connection, not the name, carries
every later announcement. Whoever holds a slot's descriptor can copy the version in it but not change
it: the descriptor is read-only and the slot sealed against writing, since reopening a memfd through
/proc gives write access back; the trainer's own mapping, made before the seal, stays writable.

POSIX locks belong to a process and any close of the file releases them, so one thread (the
listener's) takes them and closes duplicate descriptors only while it holds none.
"""

from __future__ import annotations

import array
import fcntl
import functools
import json
import logging
import mmap
import os
import secrets
import selectors
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
_STOP_WAIT_S = 10.0  # how long `stop` waits for an offer to return
_CREDENTIALS = struct.Struct("iII")  # struct ucred: pid, uid, gid
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1; Python 3.11 lacks the name
# No write, no writable mapping made from now on, no size change under the trainer's mapping (a fault),
# no unsealing.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


@functools.cache
def sealing_supported() -> bool:
    """Whether this kernel seals a memory file against future writes (Linux 5.1): without it a reader could
    reopen a slot for writing, so shared memory is not used and versions go through the object store."""
    fd = os.memfd_create("streamrl-seal-check", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as exc:
        log.warning("this kernel cannot seal shared memory (%s): weights go through the object store", exc)
        return False
    finally:
        os.close(fd)
    return True


def _peer(connection: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected UNIX socket (for a connecting socket:
    the one that called `listen`)."""
    pid, uid, _ = _CREDENTIALS.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            _CREDENTIALS.size))
    return pid, uid


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
    machine can reach it), its abstract socket name, the token an announcement must carry and `pid`, the
    listener's process (the only one the trainer sends to)."""

    node: str
    name: str
    token: bytes
    pid: int


class _Slot:
    def __init__(self, size: int):
        self.fd = os.memfd_create("streamrl-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self.buffer = mmap.mmap(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)  # after the mapping: the trainer's stays writable
            self.shared_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)  # what readers get
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
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
        os.close(self.shared_fd)
        os.close(self.fd)


class SharedWeightsWriter:
    """The trainer's side: `write` a version into a free slot, `announce` it to each listener."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []  # oldest version first
        self._connections: dict[SharedAddress, socket.socket] = {}

    @property
    def slots(self) -> int:
        return len(self._slots)

    def write(self, version: int, arrays: Mapping[str, np.ndarray]) -> _Slot:
        self._drop_departed()
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
        """Tell a listener `version` is in `slot`; False when it cannot be reached (gone, not reading, or
        its name bound by another process)."""
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [slot.shared_fd]))]
        try:
            connection = self._connections.get(address) or self._connect(address)
            connection.sendmsg([_MESSAGE.pack(address.token, version)], fds)
        except (ConnectionError, FileNotFoundError, BlockingIOError, PermissionError) as exc:
            self._disconnect(address)
            log.warning("producer socket %s not reachable (%s): weights go through the object store", address.name,
                        exc)
            return False
        return True

    def _connect(self, address: SharedAddress) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.setblocking(False)  # a listener that stopped reading is skipped, never waited for
            connection.connect("\0" + address.name)
            pid, uid = _peer(connection)
            if (pid, uid) != (address.pid, os.getuid()):
                raise PermissionError(f"bound by process {pid} of user {uid}, not by the listener's process "
                                      f"{address.pid} of user {os.getuid()}")
        except BaseException:
            connection.close()
            raise
        self._connections[address] = connection
        return connection

    def _disconnect(self, address: SharedAddress) -> None:
        connection = self._connections.pop(address, None)
        if connection is not None:
            connection.close()

    def _drop_departed(self) -> None:
        """Close the connections whose listener is gone (a replaced producer's is never announced to again)."""
        for address, connection in list(self._connections.items()):
            try:
                gone = connection.recv(1, socket.MSG_PEEK) == b""  # a listener sends nothing: only its end
            except BlockingIOError:
                gone = False
            except ConnectionError:
                gone = True
            if gone:
                self._disconnect(address)

    def close(self) -> None:
        for address in list(self._connections):
            self._disconnect(address)
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
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        name = f"streamrl-weights-{secrets.token_hex(8)}"
        self._socket.bind("\0" + name)
        self._socket.listen(8)
        self._connections: list[socket.socket] = []  # from trainers (one, or a restarted one's)
        self.address = SharedAddress(node=node, name=name, token=secrets.token_bytes(16), pid=os.getpid())
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
        """Stop listening and let the slots go. A thread still in an offer after `_STOP_WAIT_S` lets them go
        when it returns: closing a slot's descriptor under it would drop its lock, and the trainer could overwrite
        the version being copied."""
        self._stop.set()
        if self._thread is None:
            self._close()
            return
        self._thread.join(timeout=_STOP_WAIT_S)
        if self._thread.is_alive():
            log.warning("the shared-weights listener is still in an offer after %.0f s: it lets its slots go "
                        "when the offer returns", _STOP_WAIT_S)

    def _close(self) -> None:
        self._socket.close()
        for connection in self._connections:
            connection.close()
        self._connections.clear()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()

    def _listen(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._socket, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.2):  # how soon `stop` is seen
                    if key.fileobj is self._socket:
                        self._accept(selector)
                    elif not self._read(key.fileobj):
                        selector.unregister(key.fileobj)
                        self._connections.remove(key.fileobj)
                        key.fileobj.close()
        except BaseException as exc:
            self.error = exc
            if self._on_error is None:
                raise
            self._on_error(exc)
        finally:
            selector.close()
            self._close()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        connection, _ = self._socket.accept()
        pid, uid = _peer(connection)
        if uid != os.getuid():
            connection.close()
            log.warning("refused a weights connection from process %d of user %d", pid, uid)
            return
        self._connections.append(connection)
        selector.register(connection, selectors.EVENT_READ)

    def _read(self, connection: socket.socket) -> bool:
        """One announcement from `connection`; False when the trainer closed it."""
        try:
            message, fds, _, _ = socket.recv_fds(connection, _MESSAGE.size + 1, 1)
        except ConnectionResetError:
            return False
        if not message and not fds:
            return False
        self.receive(message, fds)
        return True

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
