"""`fastshare run` and `fastshare status` as a user runs them, against real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import grpc
import pytest

from fastshare.cli.run import NO_LEASE_CHECK_S

from .conftest import assert_consistent, fastshare_bin, states, wait_for


@pytest.fixture
def env(cluster):
    cluster.add_machine("node-a", ["A100-SXM4-40GB", "L4"], mig_enabled=True)
    cluster.start_controller()
    cluster.start_agent("node-a")
    return {**{k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")},
            "FASTSHARE_CONTROLLER": cluster.address, "FASTSHARE_TLS_DIR": str(cluster.pki.dir)}


def _run(env, *args, timeout=120):
    return subprocess.run([fastshare_bin(), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _active(cluster) -> list[str]:
    return [i for i, s in states(cluster).items() if s == "active"]


def test_runs_command_with_the_allocation_env_and_propagates_exit_code(cluster, env):
    out = _run(env, "run", "--sm", "30", "--mem", "1GiB", "--quota", "0.2:0.5", "--model", "L4", "--",
               "sh", "-c", 'echo "$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_VISIBLE_DEVICES '
                           '$CUDA_MPS_PIPE_DIRECTORY"; exit 3')
    assert out.returncode == 3, out.stderr
    sm, visible, pipe = out.stdout.split()
    assert sm == "30" and visible.startswith("GPU-") and pipe.endswith("/pipe")
    assert "released" in out.stderr
    assert _active(cluster) == []
    assert_consistent(cluster)


def test_releases_when_the_command_crashes(cluster, env):
    out = _run(env, "run", "--kind", "exclusive", "--mig-profile", "1g.5gb", "--", "sh", "-c", "kill -9 $$")
    assert out.returncode == 128 + 9, out.stderr
    assert _active(cluster) == []
    assert_consistent(cluster)


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """A signal to one thread of another process (tgkill(2); Python has none for that)."""
    import ctypes
    import platform

    number = {"x86_64": 234, "aarch64": 131}.get(platform.machine())
    if number is None:
        pytest.skip(f"tgkill's syscall number on {platform.machine()} is not known here")
    assert ctypes.CDLL(None, use_errno=True).syscall(number, pid, tid, sig) == 0, ctypes.get_errno()


@pytest.mark.parametrize("to_thread", [False, True], ids=["process", "other-thread"])
def test_forwards_signals_to_the_command(cluster, env, to_thread):
    """``to_thread``: the signal lands on a thread other than the main one. The kernel delivers a
    signal sent to the process to any thread not blocking it; the Python handler that forwards it
    runs only on the main thread, which sat in the command's wait(): a SIGTERM landing on a gRPC or
    lease thread was never forwarded (`systemctl stop`, a Pod's termination and Ctrl-C at times did
    nothing until the kill). Now the main thread wakes for it."""
    script = 'trap "echo got-term; exit 7" TERM; echo ready; while :; do sleep 0.1; done'
    args = [fastshare_bin(), "run", "--kind", "mps", "--mem", "1GiB", "--", "sh", "-c", script]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        if to_thread:
            others = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
            assert others, "fastshare run has no thread but the main one"
            _tgkill(proc.pid, others[0], signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "got-term" in stdout
    assert proc.returncode == 7, stderr
    assert _active(cluster) == []


def test_kill_9_of_run_is_covered_by_the_lease(cluster, env):
    args = [fastshare_bin(), "run", "--kind", "mps", "--mem", "1GiB", "--lease-ttl", "5", "--",
            "sleep", "300"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        wait_for(lambda: len(_active(cluster)) == 1, 60, "allocation")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # The command goes too (it ran on, unsupervised, on capacity the lease's expiry gives to
        # the next workload): `sleep` was the last of the process group.
        wait_for(lambda: not _group_alive(proc.pid), 10, "the command to end with fastshare run")
        wait_for(lambda: set(states(cluster).values()) == {"released"}, 60,
                 "the lease to expire and the reconciler to release")
        assert_consistent(cluster)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_rejected_and_invalid_requests_fail_clearly(cluster, env):
    out = _run(env, "run", "--kind", "whole", "--gpus", "2", "--", "true")
    assert out.returncode == 1 and "rejected: no node has 2 idle" in out.stderr
    out = _run(env, "run", "--sm", "30", "--mem", "1GiB", "--quota", "0.6:0.3", "--", "true")
    assert out.returncode == 1 and "spec.quota_limit" in out.stderr
    out = _run(env, "run", "--mem", "lots", "--", "true")
    assert out.returncode != 0 and "--mem" in out.stderr
    assert states(cluster) == {}


def test_status_json_and_table(cluster, env):
    proc = subprocess.Popen([fastshare_bin(), "run", "--kind", "exclusive", "--mig-profile", "3g.20gb", "--",
                             "sleep", "300"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(_active(cluster)) == 1, 60, "allocation")
        data = json.loads(_run(env, "status", "--json").stdout)
        (node,) = data["nodes"]
        assert node["name"] == "node-a" and node["available"]
        a100 = node["gpus"][0]
        assert a100["mig_slices"][0]["mig_profile"] == "3g.20gb"
        assert data["allocations"][0]["state"] == "ALLOCATION_STATE_ACTIVE"
        table = _run(env, "status").stdout
        assert "node-a" in table and "MIG" in table and "exclusive" in table
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert _active(cluster) == []


@pytest.mark.parametrize(("lease_ttl", "wait_s"), [("6", 0.0), ("0", NO_LEASE_CHECK_S + 1)])
def test_command_is_stopped_when_its_allocation_is_released_elsewhere(cluster, env, lease_ttl, wait_s):
    """With a lease the renewal finds the allocation gone; without one (`--lease-ttl 0`) a check
    every NO_LEASE_CHECK_S does, and nothing is renewed (the old code renewed every second and
    printed "lease renewal failed" each time: renewing no lease is refused)."""
    from fastshare.v1 import controller_pb2 as pb

    args = [fastshare_bin(), "run", "--kind", "mps", "--mem", "1GiB", "--lease-ttl", lease_ttl, "--",
            "sleep", "300"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        (alloc_id,) = wait_for(lambda: _active(cluster), 60, "allocation")
        time.sleep(wait_s)     # without a lease: at least one check of the allocation in between
        cluster.client().call("Release", pb.ReleaseAllocationRequest(allocation_id=alloc_id))
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "the allocation was released; stopping the command" in stderr
    if lease_ttl == "0":
        assert "failed" not in stderr, stderr


def test_an_allocation_run_cannot_use_is_released_not_left_behind(cluster):
    """Allocate can answer with a pending allocation (its node went down before it was
    prepared; here: the controller crashed after storing it, and the retry finds it). `run`
    said it was not usable and exited, leaving it: without a lease nothing ever released it,
    and once the node was back the reconciler made it active for nobody."""
    from fastshare.controller import faults

    from .conftest import GiB, allocate

    cluster.add_machine("node-a", ["L4"])
    cluster.start_controller(env={faults.ENV: "controller.after_commit"})
    cluster.start_agent("node-a")
    with pytest.raises(grpc.RpcError):
        allocate(cluster.client(), "mps", key="job-1", owner="me", memory_bytes=GiB)
    cluster.controller.popen.wait(timeout=60)
    cluster.controller.stop()
    cluster.agents["node-a"].stop()
    cluster.start_controller()
    (alloc_id, state), = states(cluster).items()
    assert state == "pending"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")},
           "FASTSHARE_CONTROLLER": cluster.address, "FASTSHARE_TLS_DIR": str(cluster.pki.dir)}
    out = _run(env, "run", "--kind", "mps", "--mem", "1GiB", "--owner", "me", "--key", "job-1",
               "--lease-ttl", "0", "--", "true")
    assert out.returncode == 1 and f"allocation {alloc_id} (pending)" in out.stderr, out.stderr
    assert states(cluster)[alloc_id] == "releasing"
    cluster.start_agent("node-a")
    wait_for(lambda: states(cluster)[alloc_id] == "failed", 60, "the release to finish once the node is back")
    assert_consistent(cluster)


def test_the_command_starts_with_sigpipe_and_sigxfsz_at_their_defaults():
    # the exec wrapper is Python, which ignores SIGPIPE and SIGXFSZ, and an ignored signal stays
    # ignored across exec: under `fastshare run`, `yes | head -1` printed "yes: standard output:
    # Broken pipe" and a writer whose reader had gone ran on
    from fastshare.cli.run import _argv

    out = subprocess.run(_argv(["sh", "-c", "yes | head -1; grep SigIgn /proc/self/status"]),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    line, ignored = out.stdout.split("\n", 1)
    assert line == "y"
    mask = int(ignored.split()[1], 16)
    assert not mask & (1 << (signal.SIGPIPE - 1) | 1 << (signal.SIGXFSZ - 1)), ignored


def _running(pid: int) -> bool:
    """``pid`` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_kill_9_of_run_ends_what_the_command_started_too(cluster, env):
    # the parent-death signal reached CMD, here a shell, and not the worker it started: the
    # worker ran on with its GPU share gone once the lease lapsed
    script = "sleep 1000 >/dev/null 2>&1 & echo $!; wait"
    args = [fastshare_bin(), "run", "--kind", "mps", "--mem", "1GiB", "--lease-ttl", "5", "--",
            "sh", "-c", script]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        worker = int(proc.stdout.readline())
        assert _running(worker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: not _running(worker), 5, "the shell's worker to end with fastshare run")
        wait_for(lambda: set(states(cluster).values()) == {"released"}, 60, "the lease to lapse")
    finally:
        proc.stdout.close()
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_what_the_command_leaves_running_ends_before_the_release(cluster, env):
    # a shell that put a worker in the background and exited: `run` released the allocation
    # and the worker ran on, on the GPU share it no longer had
    out = _run(env, "run", "--kind", "mps", "--mem", "1GiB", "--", "sh", "-c",
               "sleep 1000 >/dev/null 2>&1 & echo $!; exit 4")
    try:
        assert out.returncode == 4, out.stderr
        assert not _running(int(out.stdout))
        assert _active(cluster) == []
    finally:
        if _running(int(out.stdout)):
            os.kill(int(out.stdout), signal.SIGKILL)


def test_the_command_run_does_not_inherit_the_cli_s_grpc_verbosity(cluster, env):
    """The CLI quiets gRPC's own log for itself (GRPC_VERBOSITY=NONE while grpc is imported);
    the user's command, maybe a gRPC program, gets the environment the user gave."""
    env = {k: v for k, v in env.items() if k != "GRPC_VERBOSITY"}
    out = _run(env, "run", "--kind", "mps", "--mem", "1GiB", "--", "sh", "-c",
               'echo "${GRPC_VERBOSITY-unset}"')
    assert out.returncode == 0 and out.stdout.split() == ["unset"], out
    out = _run({**env, "GRPC_VERBOSITY": "DEBUG"}, "run", "--kind", "mps", "--mem", "1GiB", "--", "sh", "-c",
               'echo "$GRPC_VERBOSITY"')
    assert out.returncode == 0 and out.stdout.split() == ["DEBUG"], out
