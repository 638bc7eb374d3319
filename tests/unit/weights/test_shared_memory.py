import dataclasses
import fcntl
import mmap
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from streamrl.weights import shared_memory
from streamrl.weights.shared_memory import SharedWeightsListener, SharedWeightsWriter


def _arrays(value: float, n: int = 1000) -> dict[str, np.ndarray]:
    return {"embed.weight": np.full((n, 4), value, np.float32), "norm.weight": np.full(3, value, np.float64),
            "steps": np.array(7, np.int64), "empty": np.zeros((0, 5), np.float32)}


class _Offers:
    """What a listener offered: (version, the values of its arrays, read while the offer ran); with `keep`,
    the arrays themselves (only copies may be kept past the offer: views would pin the mapping)."""

    def __init__(self, keep: bool = False):
        self.seen: list[tuple[int, dict[str, np.ndarray]]] = []
        self.kept: list[dict[str, np.ndarray]] = []
        self.writeable: list[bool] = []
        self.keep = keep
        self.arrived = threading.Condition()

    def __call__(self, version, arrays):
        with self.arrived:
            self.seen.append((version, {k: v.copy() for k, v in arrays.items()}))
            self.writeable.append(any(v.flags.writeable for v in arrays.values()))
            if self.keep:
                self.kept.append(arrays)
            self.arrived.notify_all()

    def wait(self, count: int) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.seen) >= count, timeout=10)


@pytest.fixture
def channel():
    writer = SharedWeightsWriter()
    offers = _Offers()
    listener = SharedWeightsListener(offers, node="here", copy=True)
    yield writer, listener, offers
    listener.stop()
    writer.close()


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name])


def test_a_version_reaches_a_listener_whole_through_the_socket(channel):
    writer, listener, offers = channel
    listener.start()
    for version in range(3):
        slot = writer.write(version, _arrays(version))
        assert writer.announce(listener.address, version, slot)
        offers.wait(version + 1)
        _same(offers.seen[version][1], _arrays(version))
    assert [v for v, _ in offers.seen] == [0, 1, 2] and listener.skipped == 0
    assert writer.slots == 1  # nobody held the slot while the next version was written: reused


def test_views_are_read_only_and_copies_outlive_the_next_version():
    writer = SharedWeightsWriter()
    zero_copy, copied = _Offers(), _Offers(keep=True)
    views = SharedWeightsListener(zero_copy, node="here")
    copies = SharedWeightsListener(copied, node="here", copy=True)
    try:
        views.start()
        copies.start()
        slot = writer.write(1, _arrays(1.0))
        for listener in (views, copies):
            writer.announce(listener.address, 1, slot)
        zero_copy.wait(1)
        copied.wait(1)
        assert zero_copy.writeable == [False]
        writer.write(2, _arrays(2.0))  # the same slot, overwritten: the copies keep version 1
        _same(copied.kept[0], _arrays(1.0))
    finally:
        views.stop()
        copies.stop()
        writer.close()


def test_an_announcement_overtaken_by_a_newer_version_in_its_slot_is_skipped(channel):
    writer, listener, offers = channel
    first = writer.write(1, _arrays(1.0))
    writer.announce(listener.address, 1, first)
    second = writer.write(2, _arrays(2.0))  # no reader held the slot: version 1 is gone
    assert second is first
    writer.announce(listener.address, 2, second)
    listener.start()
    offers.wait(1)
    assert [v for v, _ in offers.seen] == [2] and listener.skipped == 1
    _same(offers.seen[0][1], _arrays(2.0))


def test_a_slot_a_reader_holds_is_never_overwritten():
    """Another process holds version 1's slot under its shared lock (as a listener copying it does): the
    writer puts version 2 in a new slot, and reuses the old one once it is let go."""
    writer = SharedWeightsWriter()
    try:
        held = writer.write(1, _arrays(1.0))
        reader = subprocess.Popen(
            [sys.executable, "-c", "import fcntl, sys; fcntl.lockf(int(sys.argv[1]), fcntl.LOCK_SH); "
             "print('locked', flush=True); sys.stdin.read()", str(held.shared_fd)],
            pass_fds=[held.shared_fd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline().strip() == "locked"
            other = writer.write(2, _arrays(2.0))
            assert other is not held and writer.slots == 2
            listener_offers = _Offers()
            listener = SharedWeightsListener(listener_offers, node="here", copy=True)
            writer.announce(listener.address, 1, held)  # version 1 is still whole in its slot
            listener.start()
            listener_offers.wait(1)
            _same(listener_offers.seen[0][1], _arrays(1.0))
            listener.stop()
        finally:
            reader.stdin.close()
            reader.wait(timeout=10)
        assert writer.write(3, _arrays(3.0)) is held  # let go: the oldest free slot again
        assert writer.slots == 2
    finally:
        writer.close()


def test_weights_of_another_size_get_a_new_slot_the_listener_maps(channel):
    writer, listener, offers = channel
    listener.start()
    small = writer.write(1, _arrays(1.0, n=10))
    writer.announce(listener.address, 1, small)
    offers.wait(1)
    large = writer.write(2, _arrays(2.0, n=100_000))
    assert large is not small and writer.slots == 1  # the small one was freed
    writer.announce(listener.address, 2, large)
    offers.wait(2)
    _same(offers.seen[1][1], _arrays(2.0, n=100_000))


def test_announcements_without_the_listeners_token_are_ignored(channel):
    writer, listener, offers = channel
    slot = writer.write(1, _arrays(1.0))
    forged = dataclasses.replace(listener.address, token=b"x" * 16)
    assert writer.announce(forged, 1, slot)  # delivered, but not taken
    writer.announce(listener.address, 1, slot)
    listener.start()
    offers.wait(1)
    assert listener.received == 1 and listener.skipped == 0
    assert listener.receive(b"short", []) is False  # malformed: refused, nothing offered


def test_a_listener_that_is_gone_is_reported_unreachable(channel):
    writer, listener, _ = channel
    slot = writer.write(1, _arrays(1.0))
    listener.start()
    listener.stop()
    assert writer.announce(listener.address, 1, slot) is False


def _engine_weights(double_buffer: bool):
    import torch

    from streamrl.engine.local_weights import LocalWeights
    from streamrl.weights.receiver import WeightReceiver

    def model():
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(torch.zeros(1000), requires_grad=False)
        return module

    return LocalWeights(model(), WeightReceiver(lambda have, timeout: None, standby=model() if double_buffer else None))


@pytest.mark.parametrize("double_buffer", [True, False])
def test_an_engine_loads_the_version_announced_even_once_its_slot_is_overwritten(double_buffer):
    """In place, the receiver keeps a version's arrays until the decode loop copies them, after the
    listener let the slot go: it must be given copies, or it would load whatever overwrote them."""
    from streamrl.runtime.actors import shared_weights_listener

    weights, held = _engine_weights(double_buffer), []
    listener = shared_weights_listener(weights, held.append, "here")
    writer = SharedWeightsWriter()
    try:
        listener.start()
        slot = writer.write(1, {"w": np.full(1000, 1.0, np.float32)})
        writer.announce(listener.address, 1, slot)
        assert weights.wait_newer(0, 10.0)
        assert writer.write(2, {"w": np.full(1000, 2.0, np.float32)}) is slot  # not announced: version 1 is gone
        weights.refresh()
        assert weights.version == 1 and held == [1]
        assert (weights.model.w == 1.0).all()
    finally:
        listener.stop()
        writer.close()


def test_a_write_that_fails_halfway_leaves_no_version_in_its_slot(channel):
    writer, listener, offers = channel
    slot = writer.write(1, _arrays(1.0))
    writer.announce(listener.address, 1, slot)  # read only after the failed write below
    broken = {**_arrays(2.0), "steps": np.array(object())}  # the same slot, copied until "steps"
    with pytest.raises(ValueError, match="OBJECT"):
        writer.write(2, broken)
    assert writer.slots == 1
    message, fds = _announcement(listener)
    assert listener.receive(message, fds) is False  # version 1's half-overwritten slot is not read
    assert offers.seen == [] and listener.skipped == 1


def _announcement(listener: SharedWeightsListener) -> tuple[bytes, list[int]]:
    """The next announcement to a listener not started, taken as its thread would."""
    connection, _ = listener._socket.accept()
    with connection:
        message, fds, _, _ = socket.recv_fds(connection, 64, 1)
    return message, fds


def test_a_listener_gets_a_descriptor_that_cannot_change_the_version(channel):
    """The descriptor is read-only, and the slot sealed: reopened for writing through /proc, it still
    gives no writable mapping, no write and no resize. The listener reads it all the same."""
    writer, listener, offers = channel
    slot = writer.write(7, _arrays(7.0))
    assert writer.announce(listener.address, 7, slot)
    message, (fd,) = _announcement(listener)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(PermissionError):
            mmap.mmap(fd, os.fstat(fd).st_size)  # shared and writable
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, os.fstat(reopened).st_size)
            with pytest.raises(PermissionError):
                os.pwrite(reopened, b"\xff" * 8, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(reopened, 0)
        finally:
            os.close(reopened)
        assert listener.receive(message, [os.dup(fd)])  # a shared lock on it, and a read-only mapping
    finally:
        os.close(fd)
    _same(offers.seen[0][1], _arrays(7.0))
    _same(writer.views(slot), _arrays(7.0))
    assert writer.write(8, _arrays(8.0)) is slot  # the trainer's own mapping still writes


_IMPOSTOR = """
import os, socket, sys
kind, name, uid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
server = socket.socket(socket.AF_UNIX, kind)
server.bind("\\0" + name)
if uid >= 0:
    os.setuid(uid)  # before listen: a connecting socket sees the credentials of listen's caller
if kind != socket.SOCK_DGRAM:
    server.listen(1)
print("bound", flush=True)
sys.stdin.readline()
server.settimeout(1)
try:
    if kind != socket.SOCK_DGRAM:
        server, _ = server.accept()
        server.settimeout(1)
    _, fds, _, _ = socket.recv_fds(server, 64, 1)
except OSError:
    fds = []
print(len(fds), flush=True)
"""


@pytest.mark.parametrize("impostor", ["another process", "another user"])
def test_a_listeners_name_bound_by_another_process_gets_no_slot(channel, impostor):
    """Abstract names are public and free once their listener is gone: whoever binds one next gets
    nothing, unless it is the listener's process of the trainer's user."""
    if impostor == "another user" and os.getuid() != 0:
        pytest.skip("needs root, to run a process as another user")
    writer, listener, _ = channel
    kind = listener._socket.type
    listener.start()
    listener.stop()
    slot = writer.write(1, _arrays(1.0))
    process = subprocess.Popen(
        [sys.executable, "-c", _IMPOSTOR, str(int(kind)), listener.address.name,
         str(65534 if impostor == "another user" else -1)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "bound"
        # Told the impostor's process, as if the listener had been it: only its user is wrong.
        address = dataclasses.replace(listener.address, pid=process.pid) if impostor == "another user" \
            else listener.address
        assert writer.announce(address, 1, slot) is False
        process.stdin.write("\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "0"  # descriptors received
    finally:
        process.stdin.close()
        process.wait(timeout=10)


_INTRUDER = """
import array, os, socket, struct, sys
kind, name, token = int(sys.argv[1]), "\\0" + sys.argv[2], bytes.fromhex(sys.argv[3])
fd = os.memfd_create("intruder")
os.ftruncate(fd, 4096)
os.setuid(65534)
sender = socket.socket(socket.AF_UNIX, kind)
message, fds = [struct.pack("<16sq", token, 5)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
if kind == socket.SOCK_DGRAM:
    sender.sendmsg(message, fds, 0, name)
else:
    sender.connect(name)
    try:
        sender.sendmsg(message, fds)
    except (BrokenPipeError, ConnectionResetError):  # refused at once, on the credentials of the connection
        pass
sender.close()
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run a process as another user")
def test_a_listener_refuses_announcements_from_another_user(channel):
    writer, listener, offers = channel
    listener.start()
    subprocess.run([sys.executable, "-c", _INTRUDER, str(int(listener._socket.type)), listener.address.name,
                    listener.address.token.hex()], check=True, timeout=30)
    slot = writer.write(1, _arrays(1.0))
    assert writer.announce(listener.address, 1, slot)
    offers.wait(1)
    assert listener.received == 1 and listener.skipped == 0  # the intruder's version 5 was never read


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_descriptor_outlives_the_slot_or_the_connection_it_was_made_for():
    before = _open_descriptors()
    writer = SharedWeightsWriter()
    offers = _Offers()
    listener = SharedWeightsListener(offers, node="here", copy=True)
    listener.start()
    small = writer.write(1, _arrays(1.0, n=10))
    assert writer.announce(listener.address, 1, small)
    offers.wait(1)
    with_one_slot = _open_descriptors()
    large = writer.write(2, _arrays(2.0, n=100_000))
    assert large is not small and writer.slots == 1  # the small slot dropped, its descriptors closed
    assert _open_descriptors() == with_one_slot
    listener.stop()
    writer.write(3, _arrays(3.0, n=100_000))  # the departed listener's connection is let go
    writer.close()
    assert _open_descriptors() == before


def test_stop_keeps_the_slots_of_an_offer_that_has_not_returned(monkeypatch):
    """Closing a slot's descriptor would drop the listener's lock on it while the offer still copies."""
    monkeypatch.setattr(shared_memory, "_STOP_WAIT_S", 0.2)
    entered, release = threading.Event(), threading.Event()

    def offer(version, arrays):
        entered.set()
        assert release.wait(10)

    writer = SharedWeightsWriter()
    listener = SharedWeightsListener(offer, node="here")
    try:
        listener.start()
        slot = writer.write(1, _arrays(1.0))
        writer.announce(listener.address, 1, slot)
        assert entered.wait(10)
        listener.stop()  # gives up waiting
        (mapped,) = listener._mapped.values()
        os.fstat(mapped.fd)  # still open
    finally:
        release.set()
        listener._thread.join(10)
        writer.close()
    assert not listener._thread.is_alive() and listener._mapped == {}  # let go once the offer returned
