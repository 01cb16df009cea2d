"""Who may change the node: mTLS clients of the cluster CA and the local unix socket."""

import os
import signal
import stat
import subprocess
import time

import grpc
import pytest
from security.handmade import issue_client_cert, issue_roleless_cert, issue_unchecked

from fastshare.node.client import channel
from fastshare.security import certs as pki
from fastshare.security.tls import TlsPaths
from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2

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


def test_only_the_controller_may_change_the_node_over_tcp(agent, tmp_path):
    """Any certificate of the cluster CA used to be enough to prepare or release shares and
    change MIG: another node's, a user's, even one called "controller" without the controller
    role (or issued before roles). Reads stay open to all of them; the unix socket is local."""
    agent.start()
    gpu = _gpu(agent)
    ca = agent.pki / "ca"
    pki.issue(ca, "node-2", tmp_path / "other-node", sans=["127.0.0.1"], role="node", days=1)
    issue_unchecked(ca, "controller", tmp_path / "user", role="client")   # `certs issue` refuses it now
    issue_roleless_cert(ca, "controller", tmp_path / "old", sans=["127.0.0.1"])
    target = f"127.0.0.1:{agent.ports['listen']}"
    for where, name, role in (("other-node", "node-2", "the node role"),
                              ("user", "controller", "the client role"),
                              ("old", "controller", "no role (issued before certificates had roles)")):
        stub = agent_pb2_grpc.NodeAgentStub(channel(target, tls=TlsPaths.in_dir(tmp_path / where, name)))
        for call, request in ((stub.PrepareShare, fastpod("x", gpu)),
                              (stub.ReleaseShare, agent_pb2.ReleaseShareRequest(share_id="x")),
                              (stub.PrepareShares, agent_pb2.PrepareSharesRequest(calls=[fastpod("x", gpu)])),
                              (stub.SetMigMode, agent_pb2.SetMigModeRequest(gpu_uuid=gpu, enabled=True))):
            err = rpc_error(call, request)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (where, err)
            assert "only the controller may call it" in err.details() and role in err.details(), err.details()
            assert f"fastshare certs issue --role controller --name {name}" in err.details()
        assert stub.GetInventory(INV, timeout=30).node_name == "node-1"
    assert agent.unix().GetInventory(INV, timeout=30).shares == []
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


def test_anonymous_long_polls_cannot_take_every_worker(agent):
    """A Watch waits up to 30 s in one of the agent's 16 worker threads, and the read-only port
    takes it from anyone: 16 of them left no thread for the controller's calls, nor for the
    unix socket's, and again 30 s later. Waits beyond half the workers are now refused."""
    import time

    agent.start()
    reply = agent.unix().Watch(agent_pb2.WatchRequest(), timeout=30)
    wait = agent_pb2.WatchRequest(since_generation=reply.generation, boot_id=reply.boot_id, wait_ms=30_000)
    anon = agent.no_client_cert("readonly_listen")
    polls = [anon.Watch.future(wait, timeout=60) for _ in range(16)]
    try:
        time.sleep(2)
        assert agent.mtls("controller").Ping(common_pb2.Empty(), timeout=5) is not None
        assert agent.unix().GetInventory(INV, timeout=5).node_name == "node-1"
        refused = [p for p in polls if p.done()]
        assert len(refused) == 8, len(refused)
        for p in refused:
            assert p.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (p.code(), p.details())
            assert "8 Watch calls are waiting" in p.details(), p.details()
        # an answer that needs no wait is still given
        now = anon.Watch(agent_pb2.WatchRequest(since_generation=reply.generation + 1, wait_ms=30_000),
                         timeout=5)
        assert now.changed
    finally:
        for p in polls:
            p.cancel()


def test_a_cancelled_long_poll_frees_its_place_at_once(agent):
    """A Watch the caller cancels (or lets time out) stops waiting: its place among the waits
    the agent allows is free for the next caller, not held for the rest of its 30 s."""
    agent.start()
    reply = agent.unix().Watch(agent_pb2.WatchRequest(), timeout=30)
    wait = agent_pb2.WatchRequest(since_generation=reply.generation, boot_id=reply.boot_id, wait_ms=30_000)
    anon = agent.no_client_cert("readonly_listen")
    first = [anon.Watch.future(wait, timeout=60) for _ in range(8)]
    time.sleep(1)
    assert not any(p.done() for p in first)
    for p in first:
        p.cancel()
    time.sleep(1)
    second = [anon.Watch.future(wait, timeout=60) for _ in range(8)]
    try:
        time.sleep(1)
        refused = [p.details() for p in second if p.done()]
        assert refused == [], refused
    finally:
        for p in second:
            p.cancel()


def test_the_agent_stops_promptly_while_long_polls_wait(agent):
    """SIGTERM with Watch calls waiting: the agent ends them and exits in seconds, instead of
    sitting out each wait (up to 30 s) in threads the process joins before it exits."""
    agent.start()
    reply = agent.unix().Watch(agent_pb2.WatchRequest(), timeout=30)
    wait = agent_pb2.WatchRequest(since_generation=reply.generation, boot_id=reply.boot_id, wait_ms=30_000)
    polls = [agent.unix().Watch.future(wait, timeout=60) for _ in range(4)]
    time.sleep(1)
    assert not any(p.done() for p in polls)
    began = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait_exit(timeout=60) == 0
    took = time.monotonic() - began
    assert took < 15, f"the agent took {took:.1f} s to stop"
    assert all(p.done() for p in polls)
