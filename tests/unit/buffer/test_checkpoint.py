import json
import os

import pytest

from harness.synthetic import synthetic_batch
from streamrl.buffer import BatchError, CheckpointError, QueueConfig, ReplayQueue, assemble, load_queue, save_queue
from streamrl.buffer.checkpoint import MANIFEST, QUEUED_FILE, STATES_FILE, atomic_directory


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


@pytest.mark.parametrize("eta", [0, 2])
def test_a_snapshot_between_get_and_set_version_loses_nothing(tmp_path, rng, eta):
    """The groups the trainer took but has not trained are not in the checkpoint's weights: the restored
    queue offers them again (consumed = v·B), instead of counting them consumed — which lost their
    prompts, shrank the budget by B and, at η = 0, left nothing admissible and nothing to get."""
    queue = ReplayQueue(QueueConfig(group_size=2, groups_per_step=2, max_staleness=eta, max_in_flight=10,
                                    vocab_size=32))
    queue.commit(synthetic_batch(queue.admit(0, 10).tickets, 2, rng=rng))
    taken = queue.get(timeout=0)  # the trainer is training these
    before = queue.status()
    restored = load_queue(save_queue(queue, tmp_path / "ckpt"))
    status = restored.status()
    assert status["version"] == 0 and status["consumed"] == 0 and status["in_training"] == 0
    assert status["queued_groups"] == before["queued_groups"] + 2 and status["admitted_live"] == before["admitted_live"]
    again = restored.get(timeout=0)
    assert again is not None and [g.group_id for g in again.groups] == [g.group_id for g in taken.groups]
    assert assemble(again.groups).equals(assemble(taken.groups))
    restored.set_version(1)
    assert len(restored.admit(0, 10, weights_version=1).tickets) == 2  # the next step's groups (η = 2: 2 more)
    queue.set_version(1)  # the live queue's step ends as usual: a snapshot now has them consumed
    assert load_queue(save_queue(queue, tmp_path / "after")).status()["consumed"] == 2


def test_restore_checks_the_counters_against_the_ticket_states(tmp_path, rng):
    queue, _ = busy_queue(rng)
    path = save_queue(queue, tmp_path / "ckpt")
    text = (path / MANIFEST).read_text()
    cases = [
        (lambda m: m["counters"].update(consumed=4), "counters.consumed = 4, but the ticket states give 2"),
        (lambda m: m["counters"].update(admitted=5), "counters.admitted = 5, but the ticket states give 6"),
        (lambda m: m["counters"].update(over_budget=-1), "counters.over_budget = -1"),
        (lambda m: m.update(prompt_cursor=m["prompt_cursor"] + 1), "the cursor handed out 7 prompts"),
        (lambda m: m["returned_prompts"].append(m["groups"][0]["prompt_id"]), "must be distinct ids"),
        (lambda m: m.update(holds=["Not A Hold"]), "admission hold name"),
    ]
    for change, message in cases:
        manifest = json.loads(text)
        change(manifest)
        (path / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=message):
            load_queue(path)


def test_a_format_1_checkpoint_loads_with_its_pause_as_the_operators_hold(tmp_path, rng):
    queue, tickets = busy_queue(rng)  # paused by the operator
    queue.abandon([tickets[5].ticket_id])
    path = save_queue(queue, tmp_path / "ckpt")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.update(format_version=1, paused=manifest.pop("holds") == ["operator"])
    for seq, group in enumerate(manifest["groups"]):
        group["seq"] = seq
    (path / MANIFEST).write_text(json.dumps(manifest))
    restored = load_queue(path)
    assert restored.status() == queue.status() and restored.holds == ["operator"]


def test_config_may_change_but_not_the_group_size_or_the_groups_per_step(tmp_path, rng):
    queue, _ = busy_queue(rng)
    path = save_queue(queue, tmp_path / "ckpt")
    looser = QueueConfig(group_size=2, groups_per_step=2, max_staleness=4, max_in_flight=20)
    assert load_queue(path, looser).config.max_staleness == 4
    with pytest.raises(CheckpointError, match="group_size 3 differs from the checkpoint's 2"):
        load_queue(path, QueueConfig(group_size=3, groups_per_step=2))
    # admission's bound counts the groups consumed against (v + η + 1) · B: a larger B admitted a burst
    with pytest.raises(CheckpointError, match="groups_per_step 8 differs from the checkpoint's 2"):
        load_queue(path, QueueConfig(group_size=2, groups_per_step=8))


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
