"""Runs a command and ends it when the process that started it is gone.

    python -m streamrl.engine.sglang.guard --parent PID -- COMMAND...

A server must not outlive its producer, even one killed with SIGKILL. Linux's parent-death signal
follows the *thread* that forked the child, not the process (a server restarted from a request
thread would be killed when that thread ends), so a guard process watches the producer instead.
The guard is the leader of the server's process group: stopping the group stops both.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time


def parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    child = subprocess.Popen(command)
    while child.poll() is None:
        if not parent_alive(args.parent):
            os.killpg(os.getpgid(0), signal.SIGTERM)  # the server and its children; this guard too
            break
        time.sleep(args.poll_s)
    return child.wait()


if __name__ == "__main__":
    raise SystemExit(main())
