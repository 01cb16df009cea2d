"""`fastshare k8s controller` as real processes: leader election between two of them, kill -9 of the
leader, take-over by the standby, clean SIGTERM shutdown that hands the Lease back."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from kubernetes import client

from fastshare.k8s.resources import GROUP, PLURAL, VERSION, fastpod_manifest
from fastshare.security import certs

from .agents import start_controller
from .conftest import wait_for


@pytest.fixture
def tls_dir(tmp_path) -> Path:
    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "controller", tmp_path / "pki", sans=["127.0.0.1"], role="controller")
    return tmp_path / "pki"


def _start(control_plane, namespace, tls_dir, identity, log: Path) -> subprocess.Popen:
    return start_controller(control_plane.kubeconfig, namespace, tls_dir, identity, log)


def _holder(api_client, namespace):
    try:
        return client.CoordinationV1Api(api_client).read_namespaced_lease("fastshare-controller",
                                                                          namespace).spec.holder_identity
    except client.ApiException:
        return None


def _scheduled(objects, namespace, name):
    fp = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return any(c["type"] == "Scheduled" for c in (fp.get("status") or {}).get("conditions") or [])


def test_standby_takes_over_after_kill_9_and_sigterm_hands_the_lease_back(
        control_plane, api_client, fastpod_crd, namespace, tls_dir, tmp_path):
    objects = client.CustomObjectsApi(api_client)
    procs = {}
    try:
        procs["a"] = _start(control_plane, namespace, tls_dir, "a", tmp_path / "a.log")
        wait_for(lambda: _holder(api_client, namespace) == "a", "a leads", timeout=90)
        procs["b"] = _start(control_plane, namespace, tls_dir, "b", tmp_path / "b.log")
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                fastpod_manifest("one", {"kind": "mps", "memory": "1Gi"}))
        wait_for(lambda: _scheduled(objects, namespace, "one"), "a reconciled", timeout=60)
        assert _holder(api_client, namespace) == "a"
        assert procs["b"].poll() is None  # the standby waits, it does not exit

        os.killpg(procs["a"].pid, signal.SIGKILL)
        procs["a"].wait(30)
        wait_for(lambda: _holder(api_client, namespace) == "b", "b takes over", timeout=90)
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                fastpod_manifest("two", {"kind": "mps", "memory": "1Gi"}))
        wait_for(lambda: _scheduled(objects, namespace, "two"), "b reconciled", timeout=60)

        procs["b"].send_signal(signal.SIGTERM)
        assert procs["b"].wait(60) == 0, (tmp_path / "b.log").read_text()
        assert _holder(api_client, namespace) is None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
