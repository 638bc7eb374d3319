"""Fail points: named places in the runtime where a test or `streamrl bench chaos` injects a fault.

```
 STREAMRL_FAILPOINTS="trainer.publish=sleep:3@2;producer.after_commit=kill"
 STREAMRL_FAILPOINTS_DIR=/tmp/x      each firing logged to DIR/log ("NAME PID TIME" per line)
```
`NAME=ACTION[@N]`: on the N-th time this process reaches NAME (default the first), do ACTION —
`kill` (SIGKILL this process: no cleanup code runs), `sleep:S` (hold the phase S seconds so a signal can
land inside it), `raise` (a `FailPointError`). Each fail point fires at most once per run directory of
fail points, across processes: the first to reach it claims `DIR/NAME.fired` (so a replacement producer
does not kill itself again). Without the environment variable `hit()` costs one dict lookup.
The variables reach actors through their runtime environment (`actor_env()`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

ENV_SPEC, ENV_DIR = "STREAMRL_FAILPOINTS", "STREAMRL_FAILPOINTS_DIR"
_lock = threading.Lock()
_hits: dict[str, int] = {}
_parsed: tuple[str, dict[str, tuple[str, int]]] = ("", {})


class FailPointError(RuntimeError):
    """Raised by a fail point whose action is `raise`."""


def parse(spec: str) -> dict[str, tuple[str, int]]:
    """`"a=kill@2;b=sleep:1"` → {"a": ("kill", 2), "b": ("sleep:1", 1)}; a malformed entry raises ValueError."""
    points: dict[str, tuple[str, int]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, rest = entry.partition("=")
        action, _, nth = rest.partition("@")
        if not sep or not name or not action:
            raise ValueError(f"{ENV_SPEC}: {entry!r} is not NAME=ACTION[@N]")
        if action not in ("kill", "raise") and not (action.startswith("sleep:") and _is_number(action[6:])):
            raise ValueError(f"{ENV_SPEC}: {entry!r}: action must be kill, raise or sleep:SECONDS")
        if nth and not (nth.isdigit() and int(nth) >= 1):
            raise ValueError(f"{ENV_SPEC}: {entry!r}: @N must be a positive integer")
        points[name] = (action, int(nth or 1))
    return points


def _is_number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def _points() -> dict[str, tuple[str, int]]:
    global _parsed
    spec = os.environ.get(ENV_SPEC, "")
    if spec != _parsed[0]:
        _parsed = (spec, parse(spec))
    return _parsed[1]


def hit(name: str) -> None:
    """Mark that this process reached `name`; fire its fault if one is armed."""
    points = _points()
    if name not in points:
        return
    action, nth = points[name]
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] != nth or not _claim(name):
            return
    directory = os.environ.get(ENV_DIR)
    if directory:
        with open(Path(directory) / "log", "a") as log:
            log.write(f"{name} {os.getpid()} {time.time():.3f}\n")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise FailPointError(f"fail point {name!r}")
    else:
        time.sleep(float(action[len("sleep:"):]))


def _claim(name: str) -> bool:
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return True
    try:
        os.close(os.open(Path(directory) / f"{name}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def fired(directory: str | Path) -> list[str]:
    """The fail points that fired, in order (read from DIR/log)."""
    log = Path(directory) / "log"
    return [line.split()[0] for line in log.read_text().splitlines()] if log.is_file() else []


def actor_env() -> dict[str, str]:
    """The fail-point variables of this process, for an actor's runtime environment (empty when unset)."""
    return {key: os.environ[key] for key in (ENV_SPEC, ENV_DIR) if os.environ.get(key)}
