"""SIGTERM while the main thread is inside the stop event's own wait() must not hang."""

import subprocess
import sys
import textwrap

import pytest

# The signal is sent while the main thread holds the event's internal lock, which is where
# Event.wait() is when a signal lands on its entry or exit. A handler that calls stop.set()
# there waits for a lock its own thread holds, for ever.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    {install}
    with stop._cond:                      # what Event.wait() holds on entry and exit
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):             # bytecodes: the handler runs in here
            pass
    sys.exit(0 if stop.wait(10) else 3)
""")
SAFE = ("from fastshare.stop_signal import stop_on_signals\n"
        "stop = threading.Event()\nstop_on_signals(stop)")
NAIVE = ("stop = threading.Event()\n"
         "signal.signal(signal.SIGTERM, lambda *_: stop.set())")


def _run(install: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(install=install)], timeout=timeout,
                          capture_output=True, text=True)


def test_stop_signal_sets_the_event_even_when_it_lands_inside_wait():
    done = _run(SAFE, timeout=30)
    assert done.returncode == 0, done.stderr


def test_the_naive_handler_really_hangs_there():
    """Proves the test above can fail: the pattern the servers used before hangs."""
    with pytest.raises(subprocess.TimeoutExpired):
        _run(NAIVE, timeout=5)
