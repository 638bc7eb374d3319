"""Hold Ctrl-C while the driver writes records that must be whole.

A KeyboardInterrupt can land between any two bytecodes of the main thread. Where the driver updates
several records that must agree (a step's metrics, its group audit and its step counter), it holds the
interrupt until they all are written and raises it right after, so a stop sees them all or none.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

# SIGTERM counts when the launcher made it stop the run like Ctrl-C (`launch(sigterm_stops=True)`).
_STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Run the block to its end; a Ctrl-C that came meanwhile is raised as KeyboardInterrupt after it.
    Keep the block short and free of waits on other processes: a second Ctrl-C cannot cut it either."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run only in the main thread: nothing can interrupt this one
        return
    caught: list[int] = []
    replaced = {sig: signal.getsignal(sig) for sig in _STOPPING_SIGNALS
                if signal.getsignal(sig) is signal.default_int_handler}
    for sig in replaced:
        signal.signal(sig, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, handler)
    if caught:
        raise KeyboardInterrupt
