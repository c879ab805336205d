"""Stopping on SIGTERM the way Ctrl-C stops: through ``KeyboardInterrupt``, so ``finally`` blocks
run (children are stopped, weights written) instead of the process vanishing mid-write."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises KeyboardInterrupt (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
