"""One controller (or node agent) per state directory: a second process is refused, a killed one is
not a blocker."""

import fcntl
import os
import subprocess
import sys
import threading

import pytest

from fastshare.state_lock import LockedError, StateDirLock
from fastshare.state_lock import holder as live_holder

HOLD = ("import sys, time\nfrom fastshare.state_lock import StateDirLock\n"
        "StateDirLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(120)\n")


def test_second_holder_is_refused_with_the_pid(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError, match=f"pid {holder.pid}.*different --state-dir"):
            StateDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the lock with the killed process.
    with StateDirLock(tmp_path):
        pass


def test_holder_names_the_live_owner_and_a_look_does_not_stop_it_starting(tmp_path):
    """`holder` (the mig commands' "is an agent starting?") takes the lock shared for an instant:
    an owner starting in that instant waits for it (patience) instead of refusing to start."""
    assert live_holder(tmp_path, "node agent") is None            # no lock file yet
    hold = HOLD.replace("(sys.argv[1])", "(sys.argv[1], 'node agent')")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert live_holder(tmp_path, "node agent") == str(holder.pid)
        assert live_holder(tmp_path, "controller") is None         # another owner's lock
    finally:
        holder.kill()
        holder.wait()
    assert live_holder(tmp_path, "node agent") is None             # its pid is still in the file
    fd = os.open(tmp_path / "node-agent.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)                                 # a look in progress
    threading.Timer(0.3, os.close, [fd]).start()
    lock = StateDirLock(tmp_path, "node agent")
    lock.acquire(patience=5.0)                                     # waits out the look
    lock.release()
    fd = os.open(tmp_path / "node-agent.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(LockedError, match="another node agent"):   # no patience: refused at once
            StateDirLock(tmp_path, "node agent").acquire()
    finally:
        os.close(fd)
