"""SIGTERM/SIGINT as a threading.Event, safely.

A Python signal handler runs on the main thread between two bytecodes, wherever that thread
is. If it calls ``Event.set()`` while the main thread is inside the same event's ``wait()``
(which briefly holds the event's non-reentrant lock on entry and exit), the handler waits for
a lock its own thread holds: the process hangs until it is killed. So the handler here only
writes a byte to a pipe, and a thread reading that pipe sets the event."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(stop: threading.Event, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
    """Set ``stop`` when one of ``signals`` arrives (from the main thread, before work starts)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def handler(_signum: int, _frame: object) -> None:
        with contextlib.suppress(BlockingIOError):   # a full pipe already says "stop"
            os.write(write_end, b"\0")

    def relay() -> None:
        os.read(read_end, 1)
        stop.set()

    threading.Thread(target=relay, name="stop-signal", daemon=True).start()
    for sig in signals:
        signal.signal(sig, handler)
