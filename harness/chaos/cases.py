"""The pieces every bad-input fuzzer shares: a case, its verdict, and expectations about errors."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Case:
    """One bad input: `attempt` must raise an error that `expect` finds right (it returns what is
    wrong with it, or None), and `state()` must read the same before and after (`settle` compares)."""

    description: str
    attempt: Callable[[], object]
    expect: Callable[[BaseException], str | None]
    state: Callable[[], object] = lambda: None
    settle: Callable[[object, object], str | None] | None = None  # default: equal
    after: Callable[[], str | None] | None = None  # a control once the bad input is refused


def judge(case: Case) -> tuple[str, str | None]:
    """`refused`, `accepted`, `wrong_error` or `state_changed`, and what went wrong."""
    before = case.state()
    try:
        case.attempt()
    except Exception as exc:  # noqa: BLE001 - judging every error is the point
        problem = case.expect(exc)
        if problem is not None:
            return "wrong_error", problem
    else:
        return "accepted", None
    after = case.state()
    problem = case.settle(before, after) if case.settle else (None if after == before else "state differs")
    if problem is None and case.after is not None:
        problem = case.after()
    return ("state_changed", problem) if problem else ("refused", None)


class Fuzzer:
    """Makes the cases of one kind in `workdir`; a context manager for what it sets up."""

    def __init__(self, workdir: Path, seed: int):
        self.workdir, self.seed = workdir, seed

    def __enter__(self) -> Fuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def case(self, index: int, rng: np.random.Generator) -> Case:
        raise NotImplementedError


def short(text: object, limit: int = 160) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "…"


def error_naming(types_: type | tuple[type, ...], *names: str | tuple[str, ...],
                 not_types: tuple[type, ...] = ()) -> Callable[[BaseException], str | None]:
    """An expectation: the error is one of `types_` (and none of `not_types`) and its message holds
    every name (a tuple: any one of its names)."""
    def expect(exc: BaseException) -> str | None:
        if not isinstance(exc, types_) or isinstance(exc, not_types):
            return f"{type(exc).__name__}: {short(exc)}"
        message = str(exc)
        missing = [n for n in names if not any(part in message for part in ((n,) if isinstance(n, str) else n))]
        return f"{type(exc).__name__} {short(message)!r} does not name {missing}" if missing else None
    return expect


def pick(rng: np.random.Generator, items: Sequence[Any]) -> Any:
    return items[int(rng.integers(len(items)))]


def file_state(directory: Path) -> list[tuple[str, str]]:
    """Every path under a directory with a digest of its bytes (directories: empty)."""
    listing = []
    for path in sorted(directory.rglob("*")):
        digest = hashlib.blake2b(path.read_bytes(), digest_size=8).hexdigest() if path.is_file() else ""
        listing.append((str(path.relative_to(directory)), digest))
    return listing


