"""The test control plane itself: it honours KUBEBUILDER_ASSETS, reports start failures with the
log, and leaves no process or file behind."""

from __future__ import annotations

import os

import pytest

from fastshare.k8s import envtest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once reaped or defunct.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_kubebuilder_assets_is_honoured(control_plane, monkeypatch, tmp_path):
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(control_plane.assets))
    assert envtest.find_assets() == control_plane.assets
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    with pytest.raises(envtest.AssetsUnavailable, match="no executable kube-apiserver and etcd"):
        envtest.find_assets()


def test_stop_ends_both_processes_and_removes_the_data(control_plane):
    plane = envtest.ControlPlane(control_plane.assets)
    plane.start()
    pids = [proc.pid for _, proc in plane._procs]
    workdir = plane.workdir
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    assert (workdir / "etcd").is_dir()
    plane.stop()
    plane.stop()  # idempotent
    assert not any(_alive(pid) for pid in pids)
    assert not workdir.exists()


def test_a_failing_apiserver_is_reported_with_its_log_and_etcd_is_stopped(control_plane, tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "etcd").symlink_to(control_plane.assets / "etcd")
    script = assets / "kube-apiserver"
    script.write_text("#!/bin/sh\necho 'error: unknown flag --frobnicate' >&2\nexit 3\n")
    script.chmod(0o755)
    plane = envtest.ControlPlane(assets, start_timeout=60)
    with pytest.raises(envtest.ControlPlaneError, match="unknown flag --frobnicate") as info:
        plane.start()
    assert "exited with 3" in str(info.value)
    assert plane._procs == []
    assert not plane.workdir.exists()
