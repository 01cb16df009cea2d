"""Who may change the node: mTLS clients of the cluster CA and the local unix socket."""

import os
import stat
import subprocess

import grpc
import pytest
from security.handmade import issue_client_cert

from fastshare.node.client import channel
from fastshare.security.tls import TlsPaths
from fastshare.v1 import agent_pb2, agent_pb2_grpc

from .harness import BIN, GPU_A, fastpod, rpc_error

INV = agent_pb2.GetInventoryRequest()


def _gpu(agent):
    return agent.unix().GetInventory(INV, timeout=30).gpus[GPU_A].uuid


def _expired_client(agent, tmp_path) -> agent_pb2_grpc.NodeAgentStub:
    """Signed by the cluster CA and named like the controller, but its validity ended yesterday."""
    issue_client_cert(agent.pki / "ca", "controller", tmp_path / "expired", ends_in_days=-1)
    paths = TlsPaths.in_dir(tmp_path / "expired", "controller")
    paths = TlsPaths(paths.cert, paths.key, agent.pki / "ca" / "ca.crt")
    return agent_pb2_grpc.NodeAgentStub(channel(f"127.0.0.1:{agent.ports['listen']}", tls=paths))


@pytest.mark.parametrize("client", ["no-cert", "wrong-ca", "expired", "plaintext"])
def test_mtls_port_refuses_clients_without_a_cluster_certificate(agent, client, tmp_path):
    agent.start()
    stub = {"no-cert": agent.no_client_cert, "wrong-ca": lambda: agent.mtls("intruder"),
            "expired": lambda: _expired_client(agent, tmp_path),
            "plaintext": lambda: agent_pb2_grpc.NodeAgentStub(
                grpc.insecure_channel(f"127.0.0.1:{agent.ports['listen']}"))}[client]()
    for call, request in ((stub.PrepareShare, fastpod("x", _gpu(agent))), (stub.GetInventory, INV)):
        assert rpc_error(call, request).code() == grpc.StatusCode.UNAVAILABLE  # TLS handshake refused
    assert agent.unix().GetInventory(INV, timeout=30).shares == []


def test_readonly_port_serves_inventory_but_refuses_mutations(agent):
    agent.start()
    anon = agent.no_client_cert("readonly_listen")
    assert anon.GetInventory(INV, timeout=30).node_name == "node-1"
    err = rpc_error(anon.PrepareShare, fastpod("x", _gpu(agent)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "client certificate" in err.details()
    err = rpc_error(anon.ReleaseShare, agent_pb2.ReleaseShareRequest(share_id="x"))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    batch = agent_pb2.PrepareSharesRequest(calls=[fastpod("x", _gpu(agent))])
    assert rpc_error(anon.PrepareShares, batch).code() == grpc.StatusCode.UNAUTHENTICATED
    assert agent.unix().GetInventory(INV, timeout=30).shares == []


def test_allowed_clients_restricts_mutations_to_named_certificates(agent):
    agent.settings["allowed_clients"] = ["controller"]
    agent.start()
    gpu = _gpu(agent)
    err = rpc_error(agent.mtls("stranger").PrepareShare, fastpod("x", gpu))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "stranger" in err.details()
    assert agent.mtls("stranger").GetInventory(INV, timeout=30).node_name == "node-1"
    assert agent.mtls("controller").PrepareShare(fastpod("x", gpu), timeout=60).created


def test_unix_socket_is_owner_and_group_only(agent):
    agent.start()
    mode = stat.S_IMODE(os.stat(agent.unix_socket).st_mode)
    assert mode == 0o660
    assert stat.S_IMODE(os.stat(agent.workdir / "state").st_mode) == 0o700


def test_tcp_without_tls_is_refused_at_start(tmp_path):
    out = subprocess.run([str(BIN / "fastshare"), "node", "serve", "--config", str(tmp_path / "none.yaml"),
                          "--listen", "127.0.0.1:0", "--gpu-backend", "sim", "--sim-state", "x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "config file" in out.stderr  # explicit --config must exist
    (tmp_path / "n.yaml").write_text("listen: 127.0.0.1:0\ndevice_backend: sim\nsim_state: x\n")
    out = subprocess.run([str(BIN / "fastshare"), "node", "serve", "--config", str(tmp_path / "n.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "tls.cert" in out.stderr
