"""One controller (or node agent) per state directory: a second process is refused, a killed one is
not a blocker."""

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from fastshare.state_lock import Holder, LockedError, StateDirLock, held_by, lock_name
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


def test_the_lock_file_is_private_and_named_after_its_owner(tmp_path):
    """The state directory is made 0700 when absent and the lock file is 0600 (least privilege)."""
    state = tmp_path / "new" / "state"
    with StateDirLock(state, "node agent") as lock:
        assert lock.path == state / "node-agent.lock"
        assert (os.stat(state).st_mode & 0o777, os.stat(lock.path).st_mode & 0o777) == (0o700, 0o600)
        assert lock_name("controller") == "controller.lock"
        assert live_holder(state, "node agent") == str(os.getpid())


def test_the_holder_leaves_its_pid_and_note_for_whoever_finds_it_held(tmp_path):
    """An flock conflicts between two opens of the file, in one process too: no second process needed."""
    first = StateDirLock(tmp_path, "node agent", "--agent-journal")
    first.acquire(note="a MIG change made while no node agent runs")
    note = "a MIG change made while no node agent runs"
    try:
        assert held_by(tmp_path, "node agent") == (str(os.getpid()), note, "")
        with pytest.raises(LockedError) as caught:
            StateDirLock(tmp_path, "node agent", "--agent-journal").acquire()
        assert caught.value.holder == Holder(str(os.getpid()), note)
        assert str(caught.value) == (f"{note} (pid {os.getpid()}) is already using the state directory "
                                     f"{tmp_path}; stop it first or give this one a different "
                                     "--agent-journal")
    finally:
        first.release()
    assert held_by(tmp_path, "node agent") is None   # released: the pid left in the file is no holder
    with StateDirLock(tmp_path, "node agent") as lock:        # a shorter record replaces the whole file
        assert held_by(tmp_path, "node agent") == (str(os.getpid()), "", "")
        assert (tmp_path / "node-agent.lock").read_text() == f"{os.getpid()}\n\n\n"
        lock.status("serving on /run/x.sock")                # what it does now, the note kept
        assert held_by(tmp_path, "node agent") == Holder(str(os.getpid()), "", "serving on /run/x.sock")
        lock.status("")
        assert (tmp_path / "node-agent.lock").read_text() == f"{os.getpid()}\n\n\n"


def test_a_holder_that_left_no_pid_is_named_unknown(tmp_path):
    """The instant between taking the lock and writing the pid (or an empty file of an old version)."""
    path = tmp_path / "controller.lock"
    path.write_text("")
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert held_by(tmp_path, "controller") == Holder("unknown")
        with pytest.raises(LockedError, match=r"^another controller \(pid unknown\) is already") as caught:
            StateDirLock(tmp_path).acquire()
        assert caught.value.holder == Holder("unknown", "", "")
        os.pwrite(fd, b" 41 \n", 0)
        assert held_by(tmp_path, "controller") == Holder("41")
    finally:
        os.close(fd)


def test_patience_waits_for_the_holder_then_gives_up(tmp_path):
    held = StateDirLock(tmp_path)
    held.acquire()
    started = time.monotonic()
    with pytest.raises(LockedError, match="another controller"):
        StateDirLock(tmp_path).acquire(patience=0.5)
    assert 0.5 <= time.monotonic() - started < 3
    threading.Timer(0.3, held.release).start()
    waiting = StateDirLock(tmp_path)
    waiting.acquire(patience=10)
    assert live_holder(tmp_path, "controller") == str(os.getpid())
    waiting.release()
    waiting.release()                                                # twice: nothing to do
    assert live_holder(tmp_path, "controller") is None


def test_the_context_manager_releases_also_on_an_error(tmp_path):
    with pytest.raises(RuntimeError), StateDirLock(tmp_path):
        assert live_holder(tmp_path, "controller") == str(os.getpid())
        raise RuntimeError("boom")
    assert live_holder(tmp_path, "controller") is None


def test_without_patience_a_held_lock_is_refused_at_once(tmp_path):
    """The controller (and a MIG change made without an agent) must not wait: refused on the spot
    even though the holder lets go a moment later."""
    held = StateDirLock(tmp_path)
    held.acquire()
    threading.Timer(0.8, held.release).start()
    with pytest.raises(LockedError):
        StateDirLock(tmp_path).acquire()
    StateDirLock(tmp_path).release()                                 # never acquired: nothing to do


def test_no_descriptor_is_left_open_by_a_refusal_or_a_release(tmp_path):
    """The agent retries a refused lock (a MIG change under way); each try must not leak its file."""
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    held = StateDirLock(tmp_path)
    held.acquire()
    before = open_fds()
    for _ in range(3):
        with pytest.raises(LockedError):
            StateDirLock(tmp_path).acquire()
    assert open_fds() == before
    held.release()
    assert open_fds() == before - 1


def test_a_failed_record_write_leaves_the_lock_free_and_no_descriptor(tmp_path, monkeypatch):
    """A full disk when the holder writes its pid: the acquire fails, and neither the lock nor its
    file stays held by a process that goes on (a caller's ``with`` never reaches ``__exit__``)."""
    import errno

    before = len(os.listdir("/proc/self/fd"))

    def no_space(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr("fastshare.state_lock.os.pwrite", no_space)
        with pytest.raises(OSError, match="No space"):
            StateDirLock(tmp_path).acquire()
    assert len(os.listdir("/proc/self/fd")) == before
    assert live_holder(tmp_path, "controller") is None
    with StateDirLock(tmp_path):
        pass


def test_a_damaged_record_still_names_what_it_can(tmp_path):
    (tmp_path / "controller.lock").write_bytes(b"\xff12\n\xfe\n")
    fd = os.open(tmp_path / "controller.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert held_by(tmp_path, "controller") == ("\ufffd12", "\ufffd", "")
    finally:
        os.close(fd)
