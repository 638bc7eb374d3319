"""The tests' guard against launchers left running: what it kills, and what it must not signal."""

import os
import subprocess
import sys
import time

import pytest
from leftovers import kill_left_running, track

# A process group of two: the tracked leader and a child it started (as a driver starts Ray's processes).
GROUP = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_launcher_left_running_is_killed_with_its_whole_group():
    proc = track(subprocess.Popen([sys.executable, "-c", GROUP], start_new_session=True))
    deadline = time.time() + 10
    while len(subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()) < 2:
        assert time.time() < deadline, "the child never started"
        time.sleep(0.05)
    assert kill_left_running() == [proc.pid]
    deadline = time.time() + 10
    while _group_alive(proc.pid):  # the child is killed too (init reaps it)
        assert time.time() < deadline, "the launcher's child outlived it"
        time.sleep(0.05)
    assert kill_left_running() == []  # each is killed once


def test_a_launcher_that_exited_is_not_signalled(monkeypatch):
    proc = track(subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True))
    proc.wait()
    monkeypatch.setattr(os, "killpg", lambda *_: pytest.fail("an exited launcher's pid may be another's by now"))
    assert kill_left_running() == []
