"""Hold Ctrl-C while the driver writes something that must be whole.

A KeyboardInterrupt can land between any two bytecodes of the main thread. Where the driver updates
several records that must agree (a step's metrics, its group audit and its step counter) or waits for
a checkpoint the actors are writing (cut short, the actors would go on writing into a directory the
driver removes, while the stop writes the same checkpoint again), the first Ctrl-C is held until the
block ends and raised right after it; a second one aborts at once, as Ctrl-C twice does everywhere else.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

# SIGTERM counts when the launcher made it stop the run like Ctrl-C (`launch(sigterm_stops=True)`).
_STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred(*, raise_after: bool = True, notice: Callable[[], None] | None = None) -> Iterator[None]:
    """Run the block to its end; a Ctrl-C that came meanwhile is raised as KeyboardInterrupt after it
    (with `raise_after=False`, only noted: the block was the stop already), a second one at once.
    `notice()` is called when the first one comes."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run only in the main thread: nothing can interrupt this one
        return
    caught: list[int] = []
    replaced = {sig: signal.getsignal(sig) for sig in _STOPPING_SIGNALS
                if signal.getsignal(sig) is signal.default_int_handler}

    def hold(signum: int, _frame: object) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)
        if notice is not None:
            notice()

    for sig in replaced:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, handler)
    if caught and raise_after:
        raise KeyboardInterrupt
