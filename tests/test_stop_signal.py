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


def test_a_stop_signal_delivered_to_another_thread_wakes_a_main_thread_waiting_without_timeout():
    """The kernel delivers a process signal to any thread that does not block it (a gRPC or worker
    thread as well). The Python handler runs only on the main thread, and only once that thread
    runs bytecode: blocked in the stop event's wait() without a timeout, as the servers are, it
    never did, and the controller, stopped by SIGTERM, hung until killed (CI: test_server's
    test_stops_cleanly_on_sigterm, 1 run in ~20 under load). The C-level handler now writes to a
    wakeup pipe, from whichever thread the signal lands on."""
    script = textwrap.dedent("""
        import signal, sys, threading, time
        from fastshare.stop_signal import stop_on_signals
        stop = threading.Event()
        stop_on_signals(stop)
        other = threading.Thread(target=time.sleep, args=(60,), daemon=True)
        other.start()
        def fire():
            time.sleep(0.5)
            signal.pthread_kill(other.ident, signal.SIGTERM)   # lands on that thread, not main
        threading.Thread(target=fire, daemon=True).start()
        stop.wait()                                           # no timeout, as the servers wait
        sys.exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=30, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
