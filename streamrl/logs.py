"""Per-process log files: `RUN_DIR/logs/<actor>.log` for every actor, `driver.log` for the launcher.

```
 driver  configure_run(log_dir, level) ─► driver.log (streamrl's and Ray's own records; the console
                                          keeps streamrl's progress lines and Ray's errors only)
         create_actor ─► actor_env(role) ─► the actor's environment: where to log, at what level, as whom
 actor   setup_actor_logging() first thing in __init__ ─► logs/<role>.log
```
An actor that starts further actors (the trainer's megatron ranks) hands the same directory on: the
environment it was given is where `actor_env` reads it from. Records go to files only, never to the
actor's stderr, which Ray would stream to the driver's console. Loggers are named after modules
(`logging.getLogger(__name__)`), so a record says where it comes from.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

LEVELS = ("debug", "info", "warning", "error")
_DIR, _LEVEL, _NAME = "STREAMRL_LOG_DIR", "STREAMRL_LOG_LEVEL", "STREAMRL_LOG_NAME"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_run: dict[str, str] = {}  # the driver's: where this run's logs go and at what level
_consoles: list[tuple[logging.Handler, int]] = []  # Ray's console handlers quietened, and their levels


def _file_handler(path: Path, level: str) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.setLevel(level.upper())
    handler.set_name("streamrl-run-log")
    return handler


def _detach(logger: logging.Logger) -> None:
    for old in [h for h in logger.handlers if h.get_name() == "streamrl-run-log"]:
        logger.removeHandler(old)
        old.close()


def _attach(logger: logging.Logger, handler: logging.Handler, level: str | None = None) -> None:
    """`handler` replaces the one a previous run in this process attached."""
    _detach(logger)
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level.upper())


def configure_run(log_dir: str | Path, level: str = "info") -> None:
    """The driver: streamrl's records and Ray's own warnings (such as its token-authentication notice) go
    to `log_dir/driver.log`; the console handlers Ray installed keep errors only."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    _run.update(dir=str(Path(log_dir).resolve()), level=level)
    handler = _file_handler(Path(log_dir) / "driver.log", level)
    streamrl = logging.getLogger("streamrl")
    _attach(streamrl, handler, level)
    streamrl.propagate = False
    ray_logger = logging.getLogger("ray")
    for console in ray_logger.handlers:
        if isinstance(console, logging.StreamHandler) and not isinstance(console, logging.FileHandler):
            _consoles.append((console, console.level))
            console.setLevel(logging.ERROR)
    _attach(ray_logger, handler)


def end_run() -> None:
    """The driver's run is over: its log file closed, Ray's console as it was, no actor told to log."""
    for name in ("streamrl", "ray"):
        _detach(logging.getLogger(name))
    logging.getLogger("streamrl").propagate = True
    while _consoles:
        console, level = _consoles.pop()
        console.setLevel(level)
    _run.clear()


def actor_env(role: str) -> dict[str, str]:
    """Environment variables telling an actor where to log (empty outside a run)."""
    directory, level = _run.get("dir") or os.environ.get(_DIR), _run.get("level") or os.environ.get(_LEVEL, "info")
    if not directory:
        return {}
    return {_DIR: directory, _LEVEL: level, _NAME: role.replace("/", "-")}


def setup_actor_logging() -> logging.Logger:
    """In an actor's process: streamrl's records to `logs/<role>.log` (nothing when not started by a run)."""
    streamrl = logging.getLogger("streamrl")
    directory, name = os.environ.get(_DIR), os.environ.get(_NAME)
    if directory and name:
        level = os.environ.get(_LEVEL, "info")
        _attach(streamrl, _file_handler(Path(directory) / f"{name}.log", level), level)
        streamrl.propagate = False  # to the file only: the actor's stderr is streamed to the console
    return streamrl
