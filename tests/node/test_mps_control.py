"""MPS daemon lifecycle through the control binary (the stand-in here, same contract as NVIDIA's)."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fastshare.mps.control import MpsControl, MpsError
from tests.standins import stop_mps_standins

STANDIN = str(Path(sys.executable).with_name("fastshare-mps-standin"))
UUID = "GPU-11111111-2222-3333-4444-555555555555"
MIG = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


@pytest.fixture
def mps(tmp_path):
    control = MpsControl(STANDIN, tmp_path / "a-rather-long-directory-name-to-exceed-sun-path" / "mps",
                         timeout=20)
    yield control
    for uuid in control.running_devices():
        control.stop(uuid)


def _alive(pid):
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_start_is_verified_and_idempotent_stop_removes_everything(mps):
    pid = mps.start(UUID)
    assert pid is not None and _alive(pid)
    assert mps.answers(UUID)
    assert mps.paths(UUID).pipe_dir.is_dir() and (mps.paths(UUID).log_dir / "control.log").is_file()
    assert mps.start(UUID) == pid  # second start: same daemon
    assert mps.running_devices() == [UUID]
    mps.stop(UUID)
    assert not _alive(pid)
    assert not mps.paths(UUID).base.exists()
    assert not mps.answers(UUID)
    mps.stop(UUID)  # idempotent


def test_one_daemon_per_device_with_its_own_pipe(mps):
    a, b = mps.start(UUID), mps.start(MIG)
    assert a != b
    mps.stop(UUID)
    assert mps.answers(MIG) and not mps.answers(UUID)


def test_limits_become_defaults_and_apply_to_running_servers(mps):
    mps.start(UUID, active_thread_percentage=40, pinned_mem_limit=3 << 30)
    assert mps.command(UUID, "get_default_active_thread_percentage").strip() == "40"
    assert mps.command(UUID, "get_default_device_pinned_mem_limit 0").strip() == "3072M"
    mps.command(UUID, "start_server -uid 0")
    (server,) = mps.server_pids(UUID)
    mps.set_limits(UUID, 60, 4 << 30)
    assert mps.command(UUID, f"get_active_thread_percentage {server}").strip() == "60"
    assert mps.command(UUID, f"get_device_pinned_mem_limit {server} 0").strip() == "4096M"
    mps.stop(UUID)
    assert not _alive(server)


def test_stop_kills_a_daemon_that_does_not_answer(tmp_path):
    mps = MpsControl(STANDIN, tmp_path / "mps", timeout=3)
    pid = mps.start(UUID)
    os.kill(pid, signal.SIGSTOP)  # hung daemon: quit cannot reach it
    try:
        mps.stop(UUID)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not _alive(pid)
    assert not mps.paths(UUID).base.exists()


def test_daemon_found_without_its_pid_file(mps):
    pid = mps.start(UUID)
    (mps.paths(UUID).pipe_dir / "nvidia-cuda-mps-control.pid").unlink()
    assert mps.daemon_pid(UUID) == pid


def test_start_failure_is_reported(tmp_path):
    with pytest.raises(MpsError, match=r"cannot start|did not start"):
        MpsControl(tmp_path / "no-such-binary", tmp_path / "mps", timeout=3).start(UUID)
    with pytest.raises(MpsError, match="did not start"):
        MpsControl("/bin/false", tmp_path / "mps", timeout=3).start(UUID)


def test_device_uuid_cannot_escape_the_root(mps):
    with pytest.raises(ValueError, match="uuid"):
        mps.paths("../../etc")


def test_a_standin_daemon_whose_directory_is_deleted_exits_with_its_servers(mps):
    """Tests and benchmarks throw their directories away (or SIGKILL the agent): no stand-in
    daemon may outlive them."""
    import shutil
    import time

    pid = mps.start(UUID)
    mps.command(UUID, "start_server -uid 0")
    [server] = mps.server_pids(UUID)
    assert _alive(pid) and _alive(server)
    shutil.rmtree(mps.paths(UUID).base)
    deadline = time.monotonic() + 10
    while (_alive(pid) or _alive(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid) and not _alive(server)


def test_stop_leaves_alone_a_process_that_reused_a_dead_daemons_pid(tmp_path):
    """A daemon that crashed leaves its pid file behind; by the time the agent cleans up, that
    pid may belong to an unrelated process, which must not be signalled."""
    import subprocess

    mps = MpsControl(STANDIN, tmp_path / "mps", timeout=1)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        mps.paths(UUID).pipe_dir.mkdir(parents=True)
        (mps.paths(UUID).pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{stranger.pid}\n")
        assert mps.daemon_pid(UUID) is None
        mps.stop(UUID)
        assert stranger.poll() is None
        assert not mps.paths(UUID).base.exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_server_starting_while_limits_are_raised_gets_the_new_limits(mps, monkeypatch):
    """A client may start a server between the listing and the commands: it must get the
    new limits, from the defaults or by pid."""
    mps.start(UUID, active_thread_percentage=40, pinned_mem_limit=3 << 30)
    listed = mps.server_pids
    started = []

    def list_then_a_server_starts(device_uuid):
        pids = listed(device_uuid)
        if not started:   # once: the read-back lists the servers again
            started.append(mps.command(UUID, "start_server -uid 0"))
        return pids

    monkeypatch.setattr(mps, "server_pids", list_then_a_server_starts)
    mps.set_limits(UUID, 60, 4 << 30)
    (server,) = listed(UUID)
    assert mps.command(UUID, f"get_active_thread_percentage {server}").strip() == "60"
    assert mps.command(UUID, f"get_device_pinned_mem_limit {server} 0").strip() == "4096M"


def test_a_limit_the_daemon_rejects_is_an_error_not_silence(mps, monkeypatch):
    """The control binary exits 0 after rejecting a set_* command; the read-back catches it."""
    mps.start(UUID, active_thread_percentage=40, pinned_mem_limit=3 << 30)
    mps.command(UUID, "start_server -uid 0")
    with pytest.raises(MpsError, match="did not take the limit 150"):
        mps.set_limits(UUID, 150, None)
    monkeypatch.setattr("fastshare.mps.control._mem_arg", lambda _bytes: "4096X")
    with pytest.raises(MpsError, match="did not take the limit 4096X"):
        mps.set_limits(UUID, None, 4 << 30)
    assert mps.command(UUID, "get_default_active_thread_percentage").strip() == "40"


@pytest.mark.parametrize(("answer", "expected", "same"), [
    ("40", "40", True), ("40.0", "40", True), ("40.5", "40", False), ("Invalid percentage", "40", False),
    ("4096M", "4096M", True), ("4G", "4096M", True), ("4294967296", "4096M", True),
    ("4096 MiB", "4096M", True), ("3072M", "4096M", False), ("0", "4096M", False), ("", "40", False),
    # NVIDIA's documented answer for 3840M (GPU Operator, T4 with 4 MPS replicas): whole GiB
    ("3G", "3840M", True), ("4G", "3840M", False), ("2G", "3840M", False), ("0G", "512M", False),
    ("3.5G", "3840M", False), ("81559M", "81559M", True), ("79G", "81559M", True),
])
def test_limits_are_compared_as_values(answer, expected, same):
    from fastshare.mps.control import _same_limit
    assert _same_limit(answer, expected) is same


def test_a_server_that_exits_before_its_read_back_is_not_a_failure(mps, monkeypatch):
    """A server listed as running may exit before its limits are read back: the query about
    it then fails (the daemon no longer knows the pid). That server has no limits to check;
    the share must not fail for it."""
    mps.start(UUID, active_thread_percentage=40, pinned_mem_limit=3 << 30)
    mps.command(UUID, "start_server -uid 0")
    (server,) = mps.server_pids(UUID)
    command, gone = mps.command, []

    def server_exits_when_queried(device_uuid, *commands, **kwargs):
        if any(c.startswith(f"get_active_thread_percentage {server}") for c in commands):
            gone.append(server)
        if gone and commands == ("get_server_list",):
            return ""
        if gone and any(f" {server}" in c for c in commands):
            return "Server not found"
        return command(device_uuid, *commands, **kwargs)

    monkeypatch.setattr(mps, "command", server_exits_when_queried)
    mps.set_limits(UUID, 60, 4 << 30)
    assert gone == [server]
    monkeypatch.undo()
    assert mps.command(UUID, "get_default_active_thread_percentage").strip() == "60"
    # A limit that does not read back is still an error.
    monkeypatch.setattr("fastshare.mps.control._same_limit", lambda answer, expected: False)
    with pytest.raises(MpsError, match="did not take the limit"):
        mps.set_limits(UUID, 70, None)


def _daemons_of(pipe_dir):
    """Pids of live ``-d`` processes whose environment names this pipe directory."""
    needle = f"\0CUDA_MPS_PIPE_DIRECTORY={pipe_dir}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = b"\0" + (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and needle in environ and b"-d" in cmdline and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("deleted", ["pipe", "base"])
def test_stop_finds_a_daemon_whose_pipe_directory_was_deleted_by_hand(tmp_path, monkeypatch, deleted):
    """The real daemon outlives its pipe directory (an operator's rm -rf /tmp/nvidia-mps): no pipe,
    no pid file, but stop must still find and end it, with its servers, and a start afterwards
    must run exactly one daemon."""
    import shutil

    from fastshare.mps.standin import OUTLIVE_ENV

    monkeypatch.setenv(OUTLIVE_ENV, "1")
    mps = MpsControl(STANDIN, tmp_path / "mps", timeout=5)
    pipe_dir = mps.paths(UUID).pipe_dir
    try:
        pid = mps.start(UUID)
        mps.command(UUID, "start_server -uid 0")
        [server] = mps.server_pids(UUID)
        shutil.rmtree(pipe_dir if deleted == "pipe" else mps.paths(UUID).base)
        assert not mps.answers(UUID) and _alive(pid)
        mps.stop(UUID)
        assert not _alive(pid) and not _alive(server)
        assert not mps.paths(UUID).base.exists()
        new = mps.start(UUID)
        assert _daemons_of(pipe_dir) == [new]
        mps.stop(UUID)
        assert _daemons_of(pipe_dir) == []
    finally:
        for leftover in _daemons_of(pipe_dir):
            os.kill(leftover, signal.SIGKILL)


def test_stop_leaves_alone_a_client_process_that_names_the_pipe_directory(tmp_path):
    """A workload using the daemon has CUDA_MPS_PIPE_DIRECTORY in its environment too, and its
    arguments may include -d: with the pipe directory gone, stop must not take it for the daemon."""
    import subprocess

    mps = MpsControl(STANDIN, tmp_path / "mps", timeout=2)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(mps.paths(UUID).pipe_dir))
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-d"], env=env)
    try:
        assert mps.daemon_pid(UUID) is None
        mps.stop(UUID)
        assert client.poll() is None
    finally:
        client.kill()
        client.wait()


def test_start_ends_an_unreachable_daemon_instead_of_starting_a_second(tmp_path, monkeypatch):
    """The agent restarts a daemon that does not answer (housekeeping, reconcile after a crash)
    by start(): with its pipe directory deleted, the old daemon was left running beside the new."""
    import shutil

    from fastshare.mps.standin import OUTLIVE_ENV

    monkeypatch.setenv(OUTLIVE_ENV, "1")
    mps = MpsControl(STANDIN, tmp_path / "mps", timeout=5)
    pipe_dir = mps.paths(UUID).pipe_dir
    try:
        old = mps.start(UUID)
        shutil.rmtree(pipe_dir)
        new = mps.start(UUID)
        assert new != old and not _alive(old)
        assert _daemons_of(pipe_dir) == [new]
        mps.stop(UUID)
    finally:
        for leftover in _daemons_of(pipe_dir):
            os.kill(leftover, signal.SIGKILL)


def test_the_suite_stops_the_standins_left_under_its_directories(mps, tmp_path):
    """A node agent leaves its MPS daemons running when it stops (as with the real one); the
    suite's end stops those under its temporary directories, so a test run leaves none behind.
    A pid file naming a process that is no stand-in is left alone."""
    pid = mps.start(UUID)
    mps.command(UUID, "start_server -uid 0")
    servers = [int(x) for x in mps.command(UUID, "get_server_list").split()]
    assert servers, "no MPS server to stop with the daemon"
    stranger = tmp_path / "elsewhere" / "nvidia-cuda-mps-control.pid"
    stranger.parent.mkdir()
    stranger.write_text(f"{os.getpid()}\n")
    assert stop_mps_standins(tmp_path) == [pid]
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid), "the stand-in daemon still runs"
    assert not any(_alive(server) for server in servers), "its MPS server still runs"
