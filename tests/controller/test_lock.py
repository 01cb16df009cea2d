"""One controller per state directory: a second process is refused, a killed one is not a blocker."""

import subprocess
import sys

import pytest

from fastshare.state_lock import LockedError, StateDirLock

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
