"""The `streamrl launch` processes a test starts, so that none outlives it: a failed check or a timeout
would otherwise leave a run training under the tests after it (on two cores) and holding its run's actor
names. Standard library only: the GPU machine runs the `gpu` tests without Ray."""

import os
import signal
import subprocess

_started: list[subprocess.Popen] = []


def track(proc: subprocess.Popen) -> subprocess.Popen:
    _started.append(proc)
    return proc


def kill_left_running() -> list[int]:
    """SIGKILL the process group of every tracked launcher still running; their pids. (One that has exited
    is not signalled: its pid, and so its group id, may already belong to another process.)"""
    killed = []
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed.append(proc.pid)
    return killed
