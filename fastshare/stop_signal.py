"""SIGTERM/SIGINT as a threading.Event, safely.

A Python signal handler runs on the main thread between two bytecodes, wherever that thread
is. If it calls ``Event.set()`` while the main thread is inside the same event's ``wait()``
(which briefly holds the event's non-reentrant lock on entry and exit), the handler waits for
a lock its own thread holds: the process hangs until it is killed. And the kernel delivers a
process signal to any thread that does not block it (a gRPC thread, a worker): the main thread,
blocked in ``wait()`` without a timeout, is not woken, so a Python handler would not run at all.
So the signal's C-level handler writes to a wakeup pipe (``signal.set_wakeup_fd``), which it
does from whichever thread the signal lands on, and a thread reading that pipe sets the event;
the Python handler does nothing but replace the default action (termination)."""

from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(stop: threading.Event, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
    """Set ``stop`` when one of ``signals`` arrives (from the main thread, before work starts)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)   # a full pipe already says "stop"

    def relay() -> None:
        os.read(read_end, 1)
        stop.set()

    threading.Thread(target=relay, name="stop-signal", daemon=True).start()
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for sig in signals:
        signal.signal(sig, _ignore)


def _ignore(_signum: int, _frame: object) -> None:
    """The wakeup pipe says it (see the module's docstring)."""
