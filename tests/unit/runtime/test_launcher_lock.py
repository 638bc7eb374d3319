"""One launcher per run directory: a second one (a `--resume` of a run still going) is refused."""

import subprocess
import sys

import pytest

from streamrl.config import RunConfig
from streamrl.runtime.rundir import RunDir, RunDirError

HOLD = ("import sys, time; from streamrl.runtime.rundir import RunDir; "
        "RunDir(sys.argv[1]).hold(); print('held', flush=True); time.sleep(60)")


def test_a_run_directory_held_by_another_process_is_refused_and_free_once_it_ends(tmp_path):
    run_dir = RunDir.create(tmp_path / "run", RunConfig())
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=rf"in use by another streamrl launch \(pid {other.pid}\)"):
            RunDir.open(run_dir.path).hold()
    finally:
        other.kill()
        other.wait()
    again = RunDir.open(run_dir.path)
    again.hold()  # the holder is gone, however it ended
    again.release()


def test_a_process_shares_its_own_hold_until_the_last_release(tmp_path):
    first = RunDir.create(tmp_path / "run", RunConfig())
    second = RunDir.open(first.path)
    first.hold()
    second.hold()  # the same process: the launcher's own prepare, then launch
    first.release()
    probe = [sys.executable, "-c", "import sys; from streamrl.runtime.rundir import RunDir; RunDir(sys.argv[1]).hold()",
             str(first.path)]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # still held by `second`
    second.release()
    second.release()  # releasing twice is harmless
    assert subprocess.run(probe, capture_output=True).returncode == 0
