"""fastshare.node.local_agent: how `fastshare mig ...` and the mig_config module tell whether a node
agent runs, and hold its state directory while they change MIG without it."""

from __future__ import annotations

import fcntl
import os
import threading

from fastshare.node.config import AGENT_LOCK_OWNER
from fastshare.node.local_agent import without_agent
from fastshare.state_lock import StateDirLock, lock_name


def test_a_direct_change_is_not_refused_for_a_look_at_the_lock(tmp_path):
    """Another `fastshare mig plan` (or check-mode run) looking whether an agent runs takes the lock
    shared for an instant: a direct change starting at that instant waited for nothing and was refused
    as if a node agent (with the pid of whoever held the lock last) were starting."""
    ran = StateDirLock(tmp_path, AGENT_LOCK_OWNER)
    ran.acquire()   # an agent that ran (and left its pid)
    ran.release()
    fd = os.open(tmp_path / lock_name(AGENT_LOCK_OWNER), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)                      # what holder_and_note takes, for an instant
    timer = threading.Timer(0.3, os.close, (fd,))
    timer.start()
    try:
        with without_agent(tmp_path):
            pass
    finally:
        timer.join()
