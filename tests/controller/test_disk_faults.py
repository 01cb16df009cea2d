"""A damaged, read-only or full state directory: the controller refuses to start or fails the
request with a clear error, and nothing already recorded is lost (root: real mounts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest

from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount small file systems")


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 4 MiB tmpfs: big enough for the state file, small enough to fill up."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as f:   # unbuffered: nothing left over for close to flush
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return ballast


def test_damaged_state_file_is_refused_and_left_as_it_was(cluster):
    cluster.state_dir.mkdir(parents=True)
    state = cluster.state_dir / "state.db"
    state.write_bytes(b"not a database" * 400)
    before = state.read_bytes()
    proc = cluster.start_controller(wait=False)
    assert proc.popen.wait(timeout=60) != 0
    out = proc.output()
    assert "is damaged" in out and str(state) in out and "Restore it from a backup" in out
    assert "Traceback" not in out
    assert state.read_bytes() == before


def test_read_only_state_directory_is_refused(cluster, small_fs):
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    cluster.state_dir = small_fs / "state"
    proc = cluster.start_controller(wait=False)
    assert proc.popen.wait(timeout=60) != 0
    out = proc.output()
    assert "Read-only file system" in out and "Traceback" not in out


def test_full_disk_fails_requests_clearly_and_loses_nothing(cluster, small_fs):
    cluster.state_dir = small_fs / "state"
    cluster.add_machine("node-a", ["L4"])
    cluster.start_controller()
    cluster.start_agent("node-a")
    c = cluster.client()
    kept = allocate(c, "fastpod", sm_percent=10, memory_bytes=GiB)
    ballast = fill(small_fs)
    failures = []
    for _ in range(40):   # the WAL may still have room for a few commits
        try:
            allocate(c, "fastpod", sm_percent=1, memory_bytes=GiB // 16)
        except grpc.RpcError as exc:
            failures.append(exc)
            break
    assert failures, "every allocation succeeded on a full disk"
    assert failures[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot be written" in failures[0].details() and "free space" in failures[0].details()
    assert cluster.controller.alive()
    ballast.unlink()
    # Nothing recorded before is lost, and the controller works again once there is room.
    assert c.call("Get", pb.GetAllocationRequest(allocation_id=kept.id)).state == pb.ALLOCATION_STATE_ACTIVE
    wait_for(lambda: allocate(c, "fastpod", sm_percent=1, memory_bytes=GiB // 16), 60, "allocating again")
    cluster.controller.stop()
    cluster.start_controller()
    states = {a.id: a.state for a in cluster.client().call("List", pb.ListAllocationsRequest()).allocations}
    assert states.get(kept.id) == pb.ALLOCATION_STATE_ACTIVE
