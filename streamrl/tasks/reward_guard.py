"""Guarded calls of a user reward function: whatever the function does, the sample gets a reward and
the run goes on.

A call that raises, outlasts the timeout, or returns NaN/inf, None, something that is not a number,
or a number outside `[low, high]` is a *failed reward*: the sample gets the fallback reward and the
failure is counted by kind, with the last few messages kept, so a bug in a reward function shows in
`summary.json` instead of ending the run.

    caller thread (a producer)                  worker process (a fresh interpreter, one per guard)
    guard(completion, row) ──► socket ─────────► fn(completion, row)     fn imported once, at start,
          waits ≤ timeout_s ◄── socket ◄── ("value", x) | (kind, message)  from "module:function"
          nothing by then: kill the worker's process group (the next call starts a new one)
    judge: x finite and in [low, high] → x;  anything else → record (kind, message), return fallback

A hang can only be cut from outside the interpreter running it (a thread cannot be interrupted), hence
the process; calls go over one persistent socket pair, so a call costs a round trip, not a process. The
worker is a new interpreter (`python -c _WORKER`), not a fork: producers live in threaded Ray workers,
and a fork of a threaded process can inherit locks held by threads that do not exist in the child. It
imports the function with the same search path.

The worker leads a process group (and session) of its own, and the processes the function starts (a
code-execution reward runs the candidate in a subprocess) are in it unless they leave on purpose. A hung
worker is stopped by killing the group, so a timed-out call leaves nothing running; closing the guard lets
the worker exit, then kills what is left in its group. The group also dies with the parent, even while the
function hangs: a thread in the worker polls the parent's pid, and end of file on the socket without a
request to exit means the same. (Linux's parent-death signal is not used: it follows the thread that
started the worker, not the process, and would kill only the worker.) In a session of its own, neither
the worker nor the function's processes get the terminal's Ctrl-C; the parent handles it and closes the
worker.

`isolation = "inline"` calls the function in the caller's thread: no pickling and no round trip, but a
hang is not cut (the timeout is not enforced) and a crash of the interpreter takes the caller with it.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol

log = logging.getLogger(__name__)


FAILURE_KINDS = ("raised", "timeout", "nan", "none", "not_a_number", "out_of_range")

Outcome = tuple[str, Any]
"""("value", float), or (a failure kind, a short message)."""

_MESSAGE_CHARS = 240
_START_TIMEOUT_S = 120.0  # interpreter start and imports, on a node that may be busy
_PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class RewardFailure:
    kind: str
    """One of FAILURE_KINDS."""
    message: str


def _short(text: str) -> str:
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "..."


def _shown(value: Any) -> str:
    """A returned value for a failure message; a user type's repr may itself raise."""
    try:
        return repr(value)
    except Exception as exc:  # noqa: BLE001 -- the message must not become a second failure
        return f"<{type(value).__name__} whose repr raised {type(exc).__name__}>"


def _describe_exception(exc: BaseException, in_file: str | None = None) -> str:
    """The error and where it was raised: the deepest frame of `in_file` if it has one (the user's line,
    not a library's hook it went through: wandb wraps sys.exit once it has run), else the deepest."""
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if f.filename == in_file] or frames
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return _short(f"{type(exc).__name__}: {exc}{where}")


def _source_of(module_name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package that fails too, or a malformed name
        return None
    return None if spec is None else spec.origin


def import_reward(spec: str, search_path: str | None = None) -> Callable[[str, dict], Any]:
    """The function a `module:function` spec names; `search_path` is put first on sys.path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected module:function")
    if search_path and search_path not in sys.path:
        sys.path.insert(0, search_path)  # the launching directory, so a local reward module imports on workers
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed as it ran: the user's bug, not ours
        # a SyntaxError names its file and line itself; its traceback ends in the import machinery
        cause = (_short(f"{type(exc).__name__}: {exc}") if isinstance(exc, SyntaxError)
                 else _describe_exception(exc, _source_of(module_name)))
        raise ValueError(f"reward {spec!r}: importing module {module_name!r} raised {cause}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def is_batched(fn: Callable) -> bool:
    """Whether a reward function scores a whole group per call (its attribute `batched = True`)."""
    return getattr(fn, "batched", False) is True


def call_reward(fn: Callable[[Any, dict], Any], completion: str | list[str],
                row: dict[str, Any]) -> Outcome | list[Outcome]:
    """One call of the user's function: its value as a float, or why there is none (range not checked).
    A batched function gets the group's completions and answers one outcome per completion."""
    try:
        value = fn(completion, row)
    except (Exception, SystemExit) as exc:  # the user's bug, recorded for this sample (or group)
        return "raised", _describe_exception(exc)
    if not isinstance(completion, list):
        return _number(value)
    if isinstance(value, str | bytes | dict) or _length(value) != len(completion):
        return "not_a_number", _short(f"a batched reward returned {type(value).__name__}, not a list of "
                                      f"{len(completion)} numbers")
    return [_number(v) for v in value]


def _length(value: Any) -> int | None:
    try:
        return len(value)
    except Exception:  # noqa: BLE001 -- no length (a number, a 0-d array or tensor), or a user type's __len__ raised
        return None


def _number(value: Any) -> Outcome:
    if value is None:
        return "none", "returned None"
    # bools, ints, numpy scalars and one-element tensors convert; a string that happens to parse does not
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        return "not_a_number", _short(f"returned {type(value).__name__}, not a number: {_shown(value)}")
    try:
        return "value", float(value)
    except OverflowError:  # an int beyond float's range (10**400)
        return "out_of_range", f"returned {type(value).__name__} too large for a float"  # its repr may not exist
    except Exception as exc:  # noqa: BLE001 -- a user type's __float__ may raise anything: this sample's failure
        return "not_a_number", _short(f"returned {type(value).__name__}, not a number: "
                                      f"{_describe_exception(exc)}")


def judge(value: float, low: float, high: float) -> Outcome:
    """A value the trainer can use, or the failure it is."""
    if not math.isfinite(value):
        return "nan", f"returned {value}"
    if not low <= value <= high:
        return "out_of_range", f"returned {value:g}, outside [{low:g}, {high:g}] (task.reward_min/reward_max)"
    return "value", value


class Caller(Protocol):
    def call(self, completion: str | list[str], row: dict[str, Any]) -> Outcome | list[Outcome]: ...

    def close(self) -> None: ...


class InlineCaller:
    """The function called in the caller's thread. The timeout is not enforced."""

    def __init__(self, fn: Callable[[str, dict], Any]):
        self.fn = fn

    def call(self, completion: str | list[str], row: dict[str, Any]) -> Outcome | list[Outcome]:
        # A copy, as a worker process gets one: a function that changes its row must not change the task's.
        return call_reward(self.fn, completion, copy.deepcopy(row))

    def close(self) -> None:
        pass


def _end_group() -> NoReturn:
    """In the worker: SIGKILL its process group (itself and what the function started), or just exit
    if it does not lead a group of its own (then the group is someone else's)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(1)


def _exit_with_parent(parent_pid: int) -> NoReturn:
    while os.getppid() == parent_pid:  # reparented (to init or a subreaper) once the parent is gone
        time.sleep(_PARENT_POLL_S)
    _end_group()


def _serve(conn: Connection, parent_pid: int, spec: str, search_path: str | None) -> None:
    """The worker process: import the function, then answer calls until the parent asks it to exit
    (`None`); end of file instead means the parent is gone, and ends the worker's process group."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    try:
        fn = import_reward(spec, search_path)
    except Exception as exc:
        conn.send(("import_error", str(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            _end_group()
        if request is None:  # the parent's close: it kills what is left of the group once this has exited
            return
        completion, row = request
        conn.send(call_reward(fn, completion, row))


_WORKER = """import sys
sys.path.append(sys.argv[1])
from multiprocessing.connection import Connection
from streamrl.tasks.reward_guard import _serve
_serve(Connection(int(sys.argv[2])), int(sys.argv[3]), sys.argv[4], sys.argv[5] or None)
"""
"""The worker's program: argv = package root, socket fd, parent pid, spec, search path."""


def _exited(process: subprocess.Popen, within_s: float) -> bool:
    """Whether a child has exited, waiting up to `within_s`, without reaping it where the platform allows:
    until it is reaped its pid, which is the id of the process group it leads, cannot be reused, so the
    group can still be signalled without hitting someone else's."""
    if not hasattr(os, "waitid"):  # macOS before Python 3.13: reaped, so its group's id is reusable once empty
        try:
            process.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + within_s
    while True:
        try:
            if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already (SIGCHLD ignored in this process): exited
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


class ProcessCaller:
    """The function called in a worker process, over a socket pair; a call that outlasts `timeout_s`
    kills the worker and everything the function started (the worker's process group), and the next call
    starts a new worker."""

    def __init__(self, spec: str, search_path: str | None, timeout_s: float):
        self.spec, self.search_path, self.timeout_s = spec, search_path, timeout_s
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        """The running worker's pid (None before the first call and after a kill)."""
        return None if self._process is None else self._process.pid

    def call(self, completion: str | list[str], row: dict[str, Any]) -> Outcome | list[Outcome]:
        if self._process is not None and _exited(self._process, 0.0):
            self._stop()  # it died between calls (killed from outside): not this call's failure
        if self._process is None:
            self._start()
        try:
            self._conn.send((completion, row))
            if not self._conn.poll(self.timeout_s):
                self._stop(hung=True)
                return "timeout", (f"no result within {self.timeout_s:g} s (task.reward_timeout_s): "
                                   "worker and its child processes killed")
            return self._conn.recv()
        except (EOFError, OSError):  # the function ended the process: os._exit, a native crash, the OOM killer
            return "raised", f"the reward worker process died during the call (exit code {self._stop()})"

    def _start(self) -> None:
        # A fresh interpreter running _WORKER, not multiprocessing's spawn: spawn re-runs the parent's main
        # script in the child, which fails for a script without an `if __name__ == "__main__"` guard.
        # Popen execs at once (no Python runs between fork and exec), so a threaded parent is safe.
        # streamrl's root goes last on the worker's path: streamrl imports as it does here, nothing is shadowed.
        # A new session: the worker's process group is its own to kill, and the terminal's Ctrl-C stays here.
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER, package_root, str(theirs.fileno()), str(os.getpid()), self.spec,
                 self.search_path or ""],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        self._process, self._conn = process, Connection(ours.detach())
        self.starts += 1
        if not self._conn.poll(_START_TIMEOUT_S):
            self._stop()
            raise TimeoutError(f"reward {self.spec!r}: the worker process did not start within {_START_TIMEOUT_S:g} s")
        try:
            kind, message = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"reward {self.spec!r}: the worker process exited while starting "
                               f"(exit code {self._stop()})") from None
        if kind == "import_error":
            self._stop()
            raise ValueError(f"{message} (in the reward worker process)")

    def _stop(self, hung: bool = False) -> int | None:
        """End the worker and whatever the function left running in its process group: an idle worker
        is asked to exit (its atexit handlers run) and given a second, a hung one is killed at once; the
        worker's exit code."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is None:
            return None
        if not hung:
            try:
                conn.send(None)  # exit; end of file alone would mean this process is gone
            except OSError:
                pass  # the worker has died already: nobody to ask
        conn.close()
        if not hung:
            _exited(process, 1.0)
        try:
            os.killpg(process.pid, signal.SIGKILL)  # SIGKILL: a hung function may ignore SIGTERM
        except ProcessLookupError:
            pass  # the worker was reaped already and its group is empty
        return process.wait(timeout=10.0)

    def close(self) -> None:
        self._stop()


class RewardGuard:
    """`guard(completion, row)` → the reward, or `fallback` for a failed reward (counted in `counts`,
    the last `keep` kept in `recent`); `guard.group(completions, row)` → one reward each, in one call
    of a `batched` function. Thread-safe: calls are serialized (one worker runs one call)."""

    def __init__(self, spec: str, search_path: str | None = None, *,
                 isolation: Literal["process", "inline"] = "process", timeout_s: float = 10.0,
                 low: float = -1e6, high: float = 1e6, fallback: float = 0.0, keep: int = 8,
                 batched: bool = False):
        self.batched = batched
        if isolation == "process":
            self.caller: Caller = ProcessCaller(spec, search_path, timeout_s)
        elif isolation == "inline":
            self.caller = InlineCaller(import_reward(spec, search_path))
        else:
            raise ValueError(f"reward isolation {isolation!r}: expected 'process' or 'inline'")
        self.low, self.high, self.fallback = low, high, fallback
        self.counts: Counter[str] = Counter()
        self.recent: deque[RewardFailure] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self.caller.close)  # a forgotten guard leaves no worker

    def __call__(self, completion: str, row: dict[str, Any]) -> float:
        if self.batched:
            return self.group([completion], row)[0]
        with self._lock:
            return self._reward(self.caller.call(completion, row))

    def group(self, completions: list[str], row: dict[str, Any]) -> list[float]:
        """The rewards of one prompt's completions: one call of a batched function (a failure of the
        whole call fails each sample), else one call each."""
        if not self.batched:
            return [self(completion, row) for completion in completions]
        with self._lock:
            outcome = self.caller.call(list(completions), row)
            outcomes = outcome if isinstance(outcome, list) else [outcome] * len(completions)
            return [self._reward(one) for one in outcomes]

    def _reward(self, outcome: Outcome) -> float:
        kind, payload = outcome
        if kind == "value":
            kind, payload = judge(payload, self.low, self.high)
        if kind == "value":
            return payload
        self.counts[kind] += 1
        self.recent.append(RewardFailure(kind, payload))
        log.warning("reward failed (%s): %s; the sample gets %g", kind, payload, self.fallback)
        return self.fallback

    def close(self) -> None:
        with self._lock:
            self._finalizer()

