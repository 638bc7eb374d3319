import json
import os

import pytest

from streamrl.buffer import BatchError, CheckpointError, QueueConfig, ReplayQueue, assemble, load_queue, save_queue
from streamrl.buffer.checkpoint import MANIFEST, QUEUED_FILE, STATES_FILE, atomic_directory
from streamrl.buffer.synthetic import synthetic_batch


def busy_queue(rng):
    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=2, max_staleness=2, max_in_flight=10, vocab_size=32))
    tickets = queue.admit(0, 6).tickets
    queue.commit(synthetic_batch(tickets[:4], 2, rng=rng, response_len=(1, 9)))
    queue.get(timeout=0)
    queue.set_version(1)
    queue.commit(synthetic_batch(tickets[4:5], 2, version=1, rng=rng))
    queue.pause()
    return queue, tickets


def test_round_trip_of_a_quiet_queue_changes_nothing(tmp_path, rng):
    queue, tickets = busy_queue(rng)
    queue.abandon([tickets[5].ticket_id])
    restored = load_queue(save_queue(queue, tmp_path / "ckpt"))
    assert restored.status() == queue.status()
    assert restored.returned_prompts() == queue.returned_prompts()
    assert assemble(restored.queued_groups()).equals(assemble(queue.queued_groups()))
    queue.resume(), restored.resume()
    assert queue.get(timeout=0).staleness == restored.get(timeout=0).staleness
    assert [t.prompt_id for t in queue.admit(0, 9).tickets] == [t.prompt_id for t in restored.admit(0, 9).tickets]


def test_restore_rederives_admission_so_a_resumed_run_cannot_burst(tmp_path, rng):
    queue, tickets = busy_queue(rng)  # ticket 5 still running
    restored = load_queue(save_queue(queue, tmp_path / "ckpt"))
    status = restored.status()
    assert status["running"] == 0 and status["returned_prompts"] == 1
    assert status["admitted_live"] == status["consumed"] + status["queued_groups"]
    restored.resume()
    granted = restored.admit(0, 100).tickets
    assert tickets[5].prompt_id == granted[0].prompt_id  # regenerated, not skipped
    assert restored.status()["admitted_live"] <= (1 + 2 + 1) * 2
    with pytest.raises(BatchError, match="expired"):
        restored.commit(synthetic_batch([tickets[5]], 2, rng=rng))


def test_config_may_change_but_not_the_group_size(tmp_path, rng):
    queue, _ = busy_queue(rng)
    path = save_queue(queue, tmp_path / "ckpt")
    looser = QueueConfig(group_size=2, groups_per_step=2, max_staleness=4, max_in_flight=20)
    assert load_queue(path, looser).config.max_staleness == 4
    with pytest.raises(CheckpointError, match="group_size 3 differs from the checkpoint's 2"):
        load_queue(path, QueueConfig(group_size=3, groups_per_step=2))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("name", [QUEUED_FILE, STATES_FILE])
def test_damaged_files_are_refused(tmp_path, rng, damage, name):
    queue, _ = busy_queue(rng)
    path = save_queue(queue, tmp_path / "ckpt")
    target = path / name
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        i = len(data) // 2
        target.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match=name):
        load_queue(path)


def test_damaged_manifest_is_refused(tmp_path, rng):
    queue, _ = busy_queue(rng)
    path = save_queue(queue, tmp_path / "ckpt")
    manifest = path / MANIFEST
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_queue(path)
    data = json.loads(text)
    data["groups"][0]["row_count"] = 7
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="do not match the manifest"):
        load_queue(path)
    data = json.loads(text)
    del data["version"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="unusable checkpoint"):
        load_queue(path)
    with pytest.raises(CheckpointError, match="missing"):
        load_queue(tmp_path / "nowhere")


def test_interrupted_write_leaves_no_checkpoint(tmp_path, rng):
    def write_half_then_die(tmp):
        (tmp / QUEUED_FILE).write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_directory(tmp_path / "ckpt", write_half_then_die)
    assert os.listdir(tmp_path) == []
    queue, _ = busy_queue(rng)
    save_queue(queue, tmp_path / "ckpt")
    with pytest.raises(FileExistsError):
        save_queue(queue, tmp_path / "ckpt")


def test_empty_queue_round_trip(tmp_path):
    queue = ReplayQueue(QueueConfig(group_size=1, groups_per_step=1))
    restored = load_queue(save_queue(queue, tmp_path / "ckpt"))
    assert restored.status() == queue.status()
