"""A run directory's JSON-lines records: a torn last line, a damaged one, the rewind of a resume."""

import json

import pytest

from streamrl.config import RunConfig
from streamrl.runtime.rundir import METRICS_FILE, RunDir, RunDirError


def test_a_torn_last_line_is_left_out_and_the_rewind_replaces_the_file_whole(tmp_path):
    run_dir = RunDir.create(tmp_path / "run", RunConfig())
    for step in range(1, 6):
        run_dir.append(METRICS_FILE, {"step": step, "reward_mean": 0.1 * step})
    with open(run_dir.path / METRICS_FILE, "a") as f:
        f.write('{"step": 6, "rew')  # the launcher killed while appending step 6
    assert [r["step"] for r in run_dir.read(METRICS_FILE)] == [1, 2, 3, 4, 5]
    run_dir.truncate_after(METRICS_FILE, 3)  # a resume from step 3
    text = (run_dir.path / METRICS_FILE).read_text()
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3] and text.endswith("\n")
    assert not list(run_dir.path.glob(".*.tmp"))


def test_a_damaged_line_that_is_not_the_last_is_refused_naming_it(tmp_path):
    run_dir = RunDir.create(tmp_path / "run", RunConfig())
    (run_dir.path / METRICS_FILE).write_text('{"step": 1}\n{"step": 2, "re\n{"step": 3}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl' line 2 is not JSON"):
        run_dir.read(METRICS_FILE)
    before = (run_dir.path / METRICS_FILE).read_text()
    with pytest.raises(RunDirError):
        run_dir.truncate_after(METRICS_FILE, 1)
    assert (run_dir.path / METRICS_FILE).read_text() == before  # refused: nothing rewritten


def test_checkpoints_past_step_999999_are_kept_newest_first_by_step_not_by_name(tmp_path):
    run_dir = RunDir.create(tmp_path / "run", RunConfig())
    run_dir.checkpoints.mkdir(exist_ok=True)
    for step in (999_998, 999_999, 1_000_000):
        directory = run_dir.step_dir(step)
        directory.mkdir()
        run_dir.make_latest(directory, keep=2)
    assert [d.name for d in run_dir.step_checkpoints()] == ["step_999999", "step_1000000"]
    assert (run_dir.checkpoints / "latest").read_text().strip() == "step_1000000"


def test_a_checkpoint_is_on_disk_before_latest_points_at_it(tmp_path, monkeypatch):
    """Renames alone survive a killed process, not a machine that goes down: `latest` could then name a
    checkpoint whose files never reached the disk (refused by its checksums, with the previous one
    pruned). Every file and directory is flushed before the rename, the rename before `latest` moves."""
    import os

    flushed = []
    fsync = os.fsync

    def recording_fsync(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    run_dir = RunDir.create(tmp_path / "run", RunConfig())

    def write(tmp):
        (tmp / "model").mkdir()
        (tmp / "model" / "weights.bin").write_bytes(b"\0" * 64)
        (tmp / "optimizer.bin").write_bytes(b"\1" * 64)

    target = run_dir.write_checkpoint(1, write, {"step": 1}, keep=2)
    checkpoints = str(run_dir.checkpoints)
    tmp = next(p for p in flushed if p.endswith("/model/weights.bin")).removesuffix("/model/weights.bin")
    files = {str(p.relative_to(target)) for p in target.rglob("*")}
    assert files == {"model", "model/weights.bin", "optimizer.bin", "meta.json", "checksums.json"}
    written = [p.removeprefix(tmp + "/") for p in flushed if p.startswith(tmp + "/")]
    assert set(written) == files and written.index("model/weights.bin") < written.index("model")
    directory_flushes = [i for i, p in enumerate(flushed) if p == checkpoints]
    assert len(directory_flushes) == 2  # the rename, then `latest` replaced
    assert flushed.index(tmp) < directory_flushes[0] < flushed.index(checkpoints + "/.latest.tmp") < directory_flushes[1]
    assert run_dir.latest_checkpoint() == target


def test_a_checkpoint_flushes_the_step_records_to_disk_before_it_becomes_the_latest(tmp_path, monkeypatch):
    """A checkpoint that survives a crash of the machine must not hold steps whose records were still in
    the page cache: the records are flushed first, `latest` moves last."""
    from streamrl.runtime import rundir

    flushed = []
    real = rundir.fsync_path
    monkeypatch.setattr(rundir, "fsync_path", lambda path: (flushed.append(path.name), real(path)))
    run_dir = RunDir.create(tmp_path / "run", RunConfig())
    run_dir.append(METRICS_FILE, {"step": 1})
    run_dir.append(rundir.GROUPS_FILE, {"step": 1})
    run_dir.write_checkpoint(1, lambda tmp: (tmp / "model").write_text("weights"), {"step": 1}, keep=2)
    assert flushed.index(METRICS_FILE) < flushed.index(".latest.tmp")
    assert flushed.index(rundir.GROUPS_FILE) < flushed.index(".latest.tmp")
    run_dir.write_json("summary.json", {"steps": 1})  # replaced whole: flushed before its rename
    assert ".summary.json.tmp" in flushed


@pytest.mark.parametrize("pointer", ["{other}", "../../other/checkpoints/step_000001", "step_1/../step_1", "latest"])
def test_latest_may_name_only_a_checkpoint_of_this_run(tmp_path, pointer):
    """`checkpoints/latest` holding an absolute path or ../ resumed another run's checkpoint as this
    run's (outside review: a reverse-task checkpoint resumed a file-task run)."""
    other = RunDir.create(tmp_path / "other", RunConfig())
    elsewhere = other.write_checkpoint(1, lambda tmp: (tmp / "model").write_text("w"), {"step": 1}, keep=2)
    run_dir = RunDir.create(tmp_path / "run", RunConfig())
    run_dir.checkpoints.mkdir(exist_ok=True)
    (run_dir.checkpoints / "latest").write_text(pointer.format(other=elsewhere) + "\n")
    with pytest.raises(RunDirError, match="not a step_N checkpoint of this run"):
        run_dir.latest_checkpoint()
