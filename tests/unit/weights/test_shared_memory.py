import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from streamrl.weights.shared_memory import SharedAddress, SharedWeightsListener, SharedWeightsWriter


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
             "print('locked', flush=True); sys.stdin.read()", str(held.fd)],
            pass_fds=[held.fd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
    forged = SharedAddress(node="here", name=listener.address.name, token=b"x" * 16)
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
    message, fds, _, _ = socket.recv_fds(listener._socket, 64, 1)  # what the listener's thread does
    assert listener.receive(message, fds) is False  # version 1's half-overwritten slot is not read
    assert offers.seen == [] and listener.skipped == 1
