"""Runs a command and ends it when the process that started it is gone.

    python -m streamrl.engine.sglang.guard --parent PID -- COMMAND...

A server must not outlive its producer, even one killed with SIGKILL. Linux's parent-death signal
follows the *thread* that forked the child, not the process (a server restarted from a request
thread would be killed when that thread ends), so a guard process watches the producer instead.
The guard is the leader of the server's process group: stopping the group stops both. And if the
guard itself is killed outright (Ray SIGKILLs a dead worker's child processes), the server gets
SIGTERM from the kernel: the guard is single-threaded, so the parent-death signal is reliable here.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


def _term_when_guard_dies() -> None:
    """In the server process, before exec: SIGTERM when the guard ends (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))  # stop the server, then leave
    child = subprocess.Popen(command, preexec_fn=_term_when_guard_dies)
    while child.poll() is None and not stopping:
        if not parent_alive(args.parent):
            break
        time.sleep(args.poll_s)
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(args.grace_s)
        except subprocess.TimeoutExpired:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(os.getpgid(0), signal.SIGKILL)  # the server's own children too; this guard with them
    return child.wait()


if __name__ == "__main__":
    raise SystemExit(main())
