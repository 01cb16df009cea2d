"""The controller process alone: single instance, auth, validation over gRPC, no partial state."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import grpc
import pytest
from security.handmade import issue_client_cert, issue_roleless_cert

from fastshare.controller.client import Client, ClientConfig
from fastshare.controller.model import Gpu, Node
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.security import certs
from fastshare.security.tls import secure_channel
from fastshare.v1 import common_pb2
from fastshare.v1 import controller_pb2 as pb
from fastshare.v1 import controller_pb2_grpc as pb_grpc

from .conftest import GiB, Proc, allocate, assert_consistent, fastshare_bin, free_port, wait_for


def test_second_controller_on_same_state_dir_refuses(cluster):
    first = cluster.start_controller()
    out = subprocess.run([fastshare_bin(), "controller", "serve", "--state-dir", str(cluster.state_dir),
                          "--tls-dir", str(cluster.pki.dir), "--listen", f"127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"another controller (pid {first.pid})" in out.stderr
    assert first.alive()


def test_invalid_request_names_field_and_stores_nothing(cluster):
    cluster.start_controller()
    client = cluster.client()
    with pytest.raises(grpc.RpcError) as exc:
        allocate(client, "fastpod", sm_percent=0, memory_bytes=GiB)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.sm_percent" in exc.value.details() and "1..100" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        client.call("Allocate", pb.AllocateRequest(spec=pb.AllocationSpec(kind=9)))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.kind" in exc.value.details()
    listed = client.call("List", pb.ListAllocationsRequest(include_finished=True))
    assert list(listed.allocations) == []


def test_no_nodes_is_a_rejection_with_a_reason(cluster):
    cluster.start_controller()
    with pytest.raises(grpc.RpcError) as exc:
        allocate(cluster.client(), "mps", memory_bytes=GiB)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no nodes" in exc.value.details()


def test_client_without_certificate_or_token_is_refused(cluster):
    cluster.start_controller()
    with pytest.raises(ValueError, match="no client certificate"):
        ClientConfig(address=cluster.address, tls_dir=cluster.pki.dir, tls_name="nobody").channel()
    # A token without a certificate cannot even pass the mTLS handshake of the main port.
    token = cluster.root / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    client = cluster.client(tls_name="nobody", token_file=token)
    with pytest.raises(grpc.RpcError) as exc:
        client.call("Ping", common_pb2.Empty(), timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    # Plain text: no TLS at all, refused at the handshake.
    with grpc.insecure_channel(cluster.address) as plain, pytest.raises(grpc.RpcError) as exc:
        plain.unary_unary("/fastshare.v1.Controller/Ping")(b"", timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_expired_or_foreign_client_certificates_are_refused(cluster):
    cluster.start_controller()
    # Signed by the cluster CA but expired yesterday: refused at the handshake.
    issue_client_cert(cluster.pki.ca, "expired", cluster.pki.dir, ends_in_days=-1)
    # Valid, but issued by another CA (the client trusts the controller's CA to reach the handshake).
    foreign = cluster.root / "foreign"
    certs.init_ca(cluster.root / "other-ca")
    certs.issue(cluster.root / "other-ca", "client", foreign, role="client")
    shutil.copy(cluster.pki.dir / "ca.crt", foreign / "ca.crt")
    # The CLI's client refuses an expired certificate before dialling; the controller's own
    # refusal is shown with a channel made without that check.
    with pytest.raises(ValueError, match="expired on"):
        Client(ClientConfig(address=cluster.address, tls_dir=cluster.pki.dir, tls_name="expired"))
    for where, name in ((cluster.pki.dir, "expired"), (foreign, "client")):
        channel = secure_channel(cluster.address, cluster.pki.dir / "ca.crt", where / f"{name}.crt",
                                 where / f"{name}.key", server_name="controller")
        stub = pb_grpc.ControllerStub(channel)
        try:
            for method, request in (("Ping", common_pb2.Empty()), ("Allocate", pb.AllocateRequest())):
                with pytest.raises(grpc.RpcError) as exc:
                    getattr(stub, method)(request, timeout=10)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, (name, method)
        finally:
            channel.close()
    assert cluster.client(tls_name="client").call("Ping", common_pb2.Empty(), timeout=10) is not None


def test_token_port(cluster):
    tokens = cluster.root / "tokens"
    tokens.write_text("# accepted\ns3cret\n")
    tokens.chmod(0o644)
    out = subprocess.run([fastshare_bin(), "controller", "serve", "--state-dir", str(cluster.state_dir),
                          "--tls-dir", str(cluster.pki.dir), "--listen", cluster.address,
                          "--client-auth", "any", "--token-file", str(tokens)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--token-file" in out.stderr and "0644" in out.stderr
    assert "s3cret" not in out.stderr + out.stdout
    tokens.chmod(0o600)
    token_port = free_port()
    cluster.start_controller(extra=["--client-auth", "any", "--token-file", str(tokens), "--token-listen",
                                    f"127.0.0.1:{token_port}"])
    good, bad = cluster.root / "good", cluster.root / "bad"
    good.write_text("s3cret")
    bad.write_text("guess")
    good.chmod(0o600)
    bad.chmod(0o400)
    base = dict(address=f"127.0.0.1:{token_port}", tls_dir=cluster.pki.dir, tls_name="nobody")
    with Client(ClientConfig(**base, token_file=good)) as ok:
        ok.call("Ping", common_pb2.Empty())
    with Client(ClientConfig(**base, token_file=bad)) as wrong, pytest.raises(grpc.RpcError) as exc:
        wrong.call("Ping", common_pb2.Empty())
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token is not one this controller accepts" in exc.value.details(), exc.value.details()
    # Certificate clients still work on the main port.
    cluster.client().call("Ping", common_pb2.Empty())


def test_node_registry_needs_the_nodes_own_certificate(cluster):
    cluster.start_controller()
    from fastshare.security.tls import TlsPaths, mtls_channel
    from fastshare.v1 import controller_pb2_grpc as pb_grpc

    paths = TlsPaths.in_dir(cluster.pki.dir, "client")
    channel = mtls_channel(cluster.address, paths, server_name="controller")
    stub = pb_grpc.NodeRegistryStub(channel)
    with pytest.raises(grpc.RpcError) as exc:
        stub.RegisterNode(pb.RegisterNodeRequest(node="node-a", address="127.0.0.1:1"), timeout=10)
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    channel.close()


def test_only_a_node_certificate_for_the_node_registers_or_heartbeats_as_it(cluster):
    """It used to be enough that a certificate of the cluster CA *named* the node (CN or any
    SAN): a user's client certificate called n1, one issued before roles, the controller's own
    certificate listing host n1, or node n2's listing an alias n1 all registered as n1 (and
    would have been sent n1's GPU work). Only n1's node certificate may."""
    from fastshare.security.tls import TlsPaths, mtls_channel
    from fastshare.v1 import controller_pb2_grpc as pb_grpc

    cluster.start_controller()
    ca, root = cluster.pki.ca, cluster.root
    certs.issue(ca, "n1", root / "user", sans=["127.0.0.1"], role="client")
    issue_roleless_cert(ca, "n1", root / "old", sans=["127.0.0.1"])
    certs.issue(ca, "controller", root / "ctl", sans=["n1", "127.0.0.1"], role="controller")
    certs.issue(ca, "n2", root / "n2", sans=["n1", "127.0.0.1"], role="node")
    certs.issue(ca, "n1", root / "n1", sans=["127.0.0.1"], role="node")
    hint = "re-issue it with `fastshare certs issue --role node --name n1`"
    refused = [("user", "n1", f"certificate 'n1' has the client role, not the node role, so it cannot act as "
                              f"node 'n1'; {hint}"),
               ("old", "n1", "certificate 'n1' has no role (issued before certificates had roles)"),
               ("ctl", "controller", "has the controller role, not the node role"),
               ("n2", "n2", "the node certificate of 'n2' cannot act as node 'n1'")]

    def registry(where: str, name: str):
        channel = mtls_channel(cluster.address, TlsPaths.in_dir(root / where, name), server_name="controller")
        return channel, pb_grpc.NodeRegistryStub(channel)

    for where, name, why in refused:
        channel, stub = registry(where, name)
        register = pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1")
        heartbeat = pb.HeartbeatRequest(node="n1")
        with channel:
            for call, request in ((stub.RegisterNode, register), (stub.Heartbeat, heartbeat)):
                with pytest.raises(grpc.RpcError) as exc:
                    call(request, timeout=10)
                assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, (where, exc.value)
                assert why in exc.value.details(), (where, exc.value.details())
                assert "fastshare certs issue --role node --name n1" in exc.value.details()
    assert list(cluster.status().nodes) == []
    # n1's own certificate gets through: the heartbeat is answered (n1 is not registered yet)
    # and registration fails only where the controller dials the (absent) agent back.
    channel, stub = registry("n1", "n1")
    with channel:
        assert stub.Heartbeat(pb.HeartbeatRequest(node="n1"), timeout=10).registered is False
        with pytest.raises(grpc.RpcError) as exc:
            stub.RegisterNode(pb.RegisterNodeRequest(node="n1", address="127.0.0.1:1"), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "reach the agent back" in exc.value.details()



def test_a_refused_node_is_named_once_in_the_controllers_log(cluster):
    """During an upgrade (controller first, nodes' certificates re-issued with their role after)
    the controller refuses the nodes: its log must say so and why, not only that they missed
    their heartbeats, and once per node rather than at every retry."""
    from fastshare.security.tls import TlsPaths, mtls_channel
    from fastshare.v1 import controller_pb2_grpc as pb_grpc

    cluster.start_controller()
    issue_roleless_cert(cluster.pki.ca, "n1", cluster.root / "old", sans=["127.0.0.1"])
    channel = mtls_channel(cluster.address, TlsPaths.in_dir(cluster.root / "old", "n1"),
                           server_name="controller")
    with channel:
        stub = pb_grpc.NodeRegistryStub(channel)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as exc:
                stub.Heartbeat(pb.HeartbeatRequest(node="n1"), timeout=10)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    wait_for(lambda: "node n1 refused" in cluster.controller.output(), 10, "the refusal in the log")
    lines = [line for line in cluster.controller.output().splitlines() if "node n1 refused" in line]
    assert len(lines) == 1, lines
    assert "no role" in lines[0] and "fastshare certs issue --role node --name n1" in lines[0]

def test_a_node_certificate_may_only_read_and_cordon_its_own_node(cluster):
    """A GPU node's certificate is not a user's: it must not allocate, release or cordon other
    nodes through the client API (playbooks/mig_reconfigure.yml cordons a node with its own)."""
    cluster.start_controller()
    cluster.pki.issue("n1")
    node = cluster.client(tls_name="n1")
    assert node.call("Status", pb.ClusterStatusRequest(), timeout=10) is not None
    assert list(node.call("List", pb.ListAllocationsRequest(), timeout=10).allocations) == []
    for method, request in (("Allocate", pb.AllocateRequest(idempotency_key="k")),
                            ("Release", pb.ReleaseAllocationRequest(allocation_id="a")),
                            ("RenewLease", pb.RenewLeaseRequest(allocation_id="a")),
                            ("SetSchedulable", pb.SetSchedulableRequest(node="n2", schedulable=False))):
        with pytest.raises(grpc.RpcError) as exc:
            node.call(method, request, timeout=10)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
        assert "node certificate" in exc.value.details() and "--role client" in exc.value.details()
    # Its own node: past the authorisation, to the controller's "no such node".
    with pytest.raises(grpc.RpcError) as exc:
        node.call("SetSchedulable", pb.SetSchedulableRequest(node="n1", schedulable=False), timeout=10)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    # A client certificate still does what a user does.
    with pytest.raises(grpc.RpcError) as exc:
        allocate(cluster.client(), "mps", memory_bytes=GiB)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stops_cleanly_on_sigterm(cluster):
    proc = cluster.start_controller()
    assert proc.stop() == 0, proc.output()[-20000:]   # a hang: the threads' stacks (faulthandler)
    wait_for(lambda: not proc.alive(), 30, "controller exit")


def test_a_stop_with_an_allocate_waiting_on_a_hung_agent_ends_within_its_grace(cluster):
    """SIGTERM while an Allocate waits on an agent that does not answer (SIGSTOP): the call is
    cancelled after the 5 s grace, and its compensating release is refused at once instead of
    dialling the agent again for a whole deadline (the stop took 15 s with --agent-deadline 10,
    or the call's thread wrote to the closed store). After a restart and the agent's return the
    allocation settles."""
    cluster.add_machine("node-a", ["L4"])
    cluster.start_controller()
    cluster.start_agent("node-a")
    agent = cluster.agents["node-a"]
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        errors: list[grpc.RpcError] = []
        waiting = threading.Thread(target=lambda: _allocate_into(errors, cluster.client()))
        waiting.start()
        wait_for(lambda: [a.state for a in cluster.status().allocations] == [pb.ALLOCATION_STATE_PENDING],
                 30, "the allocation committed, its prepare sent")
        time.sleep(0.5)
        began = time.monotonic()
        stopped = cluster.controller
        assert stopped.stop(timeout=40) == 0
        took = time.monotonic() - began
        waiting.join(30)
        assert took < 9, f"the controller took {took:.1f} s to stop"
        assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE], errors
        # nothing was left to write to a closed store (it was, by the call's thread or the housekeeping)
        assert "Traceback" not in stopped.output(), stopped.output()
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    cluster.start_controller()
    wait_for(lambda: _consistent(cluster), 60, "the allocation settled, here and on the agent")


def test_a_pass_waiting_on_a_hung_agent_does_not_hold_up_the_liveness_checks(cluster):
    """A node that stops heartbeating is unavailable within its heartbeat timeout even while
    the periodic pass waits a whole agent deadline on another agent (hung: SIGSTOP). The checks
    ran in the pass's thread, after it: 20 s late here."""
    for name in ("node-a", "node-b"):
        cluster.add_machine(name, ["L4"])
    cluster.start_controller(extra=["--heartbeat-timeout", "3", "--agent-deadline", "20"])
    hung = cluster.start_agent("node-a")
    cluster.start_agent("node-b")
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        time.sleep(3)   # a pass (every 2 s) has begun, and waits on node-a until its deadline
        killed = time.monotonic()
        cluster.agents["node-b"].kill9()
        cluster.wait_node("node-b", available=False, timeout=60)
        took = time.monotonic() - killed
        assert took < 8, f"node-b was taken for available {took:.1f} s after it died (timeout 3 s)"
    finally:
        os.kill(hung.pid, signal.SIGCONT)


def test_a_hung_agent_does_not_hold_up_the_passes_of_the_others(cluster):
    """An agent that does not answer (SIGSTOP: its connection stays open) held each pass a whole
    deadline, for as long as it hung, and a registration's pass waited behind the pass under
    way (10.4 s here, deadline 10 s). Once its node is unavailable it is no longer asked."""
    for name in ("node-a", "node-b"):
        cluster.add_machine(name, ["L4"])
    cluster.start_controller(extra=["--heartbeat-timeout", "3"])
    hung = cluster.start_agent("node-a")
    cluster.start_agent("node-b")
    cluster.wait_taken_in("node-b")
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        cluster.wait_node("node-a", available=False, timeout=30)
        time.sleep(12)   # a pass that asked node-a before it was unavailable has waited out its deadline
        for _ in range(3):
            passes = cluster.registration_passes("node-b")
            cluster.agents["node-b"].kill9()
            cluster.start_agent("node-b")
            registered = time.monotonic()
            wait_for(lambda n=passes: cluster.registration_passes("node-b") > n, 30, "node-b's pass")
            took = time.monotonic() - registered
            assert took < 3, f"node-b's registration was reconciled {took:.1f} s after it (deadline 10 s)"
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    cluster.wait_node("node-a", available=True, timeout=60)


@pytest.mark.parametrize("hung_agents", [12, 70])
def test_a_start_with_hung_agents_waits_one_deadline_however_many(cluster, hung_agents):
    """At its start the controller asks every stored node's agent for its inventory before it
    serves. Agents that do not answer (here: listeners that accept and never speak, as a host cut
    off with its connection open) each hold a thread for a whole deadline: with 8 asked at a
    time, 12 of them held the start for two deadlines (20.4 s here); with 64, 70 of them did
    (20.4 s). The pass now waits one deadline (and 2 s) for all, however many hang."""
    hung = []
    cluster.state_dir.mkdir(parents=True)
    store = SqliteStore(cluster.state_dir / "state.db")
    try:
        for i in range(hung_agents):
            listener = socket.create_server(("127.0.0.1", 0))
            hung.append(listener)
            store.put_node(Node(name=f"gone-{i:02d}", address=f"127.0.0.1:{listener.getsockname()[1]}"))
    finally:
        store.close()
    try:
        began = time.monotonic()
        cluster.start_controller()
        took = time.monotonic() - began
        assert took < 17, f"the controller served {took:.1f} s after it was started (deadline 10 s)"
    finally:
        for listener in hung:
            listener.close()


def test_the_status_of_a_cluster_larger_than_grpc_default_message_limit(cluster):
    """gRPC refuses a message over 4 MiB by default: the status of some 6,300 nodes of 8 GPUs
    and no allocation (fewer with allocations; the engine is built for 10,000) was refused
    (RESOURCE_EXHAUSTED), and `fastshare status` with it."""
    cluster.state_dir.mkdir(parents=True)
    store = SqliteStore(cluster.state_dir / "state.db")
    try:
        for i in range(7000):
            gpus = [Gpu(index=g, uuid=f"GPU-{i:08d}-0000-0000-0000-{g:012d}", model="NVIDIA H100 80GB HBM3",
                        memory_bytes=80 * GiB, sm_count=132) for g in range(8)]
            store.put_node(Node(name=f"gpu-node-{i:05d}", address="127.0.0.1:1", gpus=gpus))
    finally:
        store.close()
    cluster.start_controller()
    status = cluster.status()
    size = status.ByteSize()
    assert len(status.nodes) == 7000 and size > 4 * 2**20, f"{len(status.nodes)} nodes, {size} bytes"
    listed = subprocess.run([fastshare_bin(), "status", "--json", "--controller", cluster.address,
                             "--tls-dir", str(cluster.pki.dir)], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)["nodes"]) == 7000


def test_the_status_of_named_nodes_reads_those_and_names_a_mistyped_one(cluster):
    """`fastshare status --node` shows only the nodes named and their allocations; a name the
    controller does not know is refused with the likeliest meant, not the whole cluster's."""
    cluster.state_dir.mkdir(parents=True)
    store = SqliteStore(cluster.state_dir / "state.db")
    try:
        for i in range(30):
            gpus = [Gpu(index=0, uuid=f"GPU-{i:08d}", model="NVIDIA L4", memory_bytes=22 * GiB, sm_count=58)]
            store.put_node(Node(name=f"gpu-node-{i:03d}", address="127.0.0.1:1", gpus=gpus))
    finally:
        store.close()
    cluster.start_controller()
    base = [fastshare_bin(), "status", "--controller", cluster.address, "--tls-dir", str(cluster.pki.dir)]
    listed = subprocess.run([*base, "--json", "--node", "gpu-node-007", "--node", "gpu-node-029",
                             "--node", "gpu-node-007"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert [n["name"] for n in json.loads(listed.stdout)["nodes"]] == ["gpu-node-007", "gpu-node-029"]
    mistyped = subprocess.run([*base, "--node", "gpu-node-O07"], capture_output=True, text=True, timeout=60)
    assert mistyped.returncode != 0
    assert "30 nodes" in mistyped.stderr and "did you mean gpu-node-007, " in mistyped.stderr, mistyped.stderr
    bad = subprocess.run([*base, "--node", "no/such"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "node" in bad.stderr, bad.stderr


def _consistent(cluster) -> bool:
    """Active here and held by its agent, or finished and not held (which one depends on when
    the agent, resumed, reads the call it was sent)."""
    try:
        assert_consistent(cluster)
    except AssertionError:
        return False
    return True


def _allocate_into(errors: list[grpc.RpcError], client: Client) -> None:
    try:
        allocate(client, "mps", memory_bytes=GiB)
    except grpc.RpcError as exc:
        errors.append(exc)


def test_config_file_and_its_errors(cluster):
    config = cluster.root / "controller.yaml"
    config.write_text(f"state_dir: {cluster.state_dir}\ntls_dir: {cluster.pki.dir}\n"
                      f"listen: {cluster.address}\nheartbeat_interval: 1\nreconcile_interval: 2\n")
    proc = Proc([fastshare_bin(), "controller", "serve", "--config", str(config)], cluster.root / "c.log")
    cluster.procs.append(proc)
    wait_for(lambda: cluster.client().call("Ping", common_pb2.Empty(), timeout=2) is not None, 60,
             "controller configured by file only")
    assert (cluster.state_dir / "state.db").exists()
    proc.stop()
    config.write_text("state_dir: /tmp/x\nlisen: 1.2.3.4:5\n")
    out = subprocess.run([fastshare_bin(), "controller", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "unknown setting(s) lisen" in out.stderr


def test_port_in_use_is_a_clear_error(cluster):
    cluster.start_controller()
    out = subprocess.run([fastshare_bin(), "controller", "serve", "--state-dir", str(cluster.root / "other"),
                          "--tls-dir", str(cluster.pki.dir), "--listen", cluster.address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "cannot start the controller" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_allocation_ids_and_node_names_are_checked_by_field(cluster):
    """An empty id was 'allocation  does not exist' (NOT_FOUND, no field named); a long one came
    back in the error, too big for gRPC's trailers ('Stream removed (received metadata size
    exceeds hard limit)')."""
    cluster.start_controller()
    client = cluster.client()
    calls = {"Get": lambda i: pb.GetAllocationRequest(allocation_id=i),
             "Release": lambda i: pb.ReleaseAllocationRequest(allocation_id=i),
             "RenewLease": lambda i: pb.RenewLeaseRequest(allocation_id=i)}
    for method, request in calls.items():
        for value, says in (("", "required"), ("x" * 100_000, "at most 128 characters, got 100000")):
            with pytest.raises(grpc.RpcError) as exc:
                client.call(method, request(value))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, exc.value.details())
            assert exc.value.details().startswith("allocation_id: ") and says in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        watch = pb.WatchAllocationsRequest(allocation_id="x" * 100_000)
        next(iter(client.stream("Watch", watch, timeout=30)))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "allocation_id: at most 128 characters" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        client.call("SetSchedulable", pb.SetSchedulableRequest(node="n" * 100_000))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == "node: at most 253 characters (a host name), got 100000"


def test_open_watches_cannot_take_every_worker(cluster):
    """Each Watch stream held one of the controller's 32 worker threads for as long as it was
    open: 32 of them, from any certificate (even a GPU node's, which may only read), left no
    thread for Ping, Allocate, RegisterNode or Heartbeat (every node then looked lost). Watches
    beyond half the workers are now refused, RESOURCE_EXHAUSTED, and the rest of the API answers."""
    import time

    cluster.pki.issue("n1")
    cluster.start_controller()
    watcher = cluster.client(tls_name="n1")
    streams = [watcher.stream("Watch", pb.WatchAllocationsRequest(), timeout=120) for _ in range(40)]
    try:
        time.sleep(2)
        cluster.client().call("Ping", common_pb2.Empty(), timeout=5)
        wait_for(lambda: sum(s.done() for s in streams) >= 24, 30, "watches over the limit refused")
        refused = [s for s in streams if s.done()]
        assert all(s.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for s in refused), \
            [(s.code(), s.details()) for s in refused]
        assert "16 watches are open" in refused[0].details(), refused[0].details()
        open_now = [s for s in streams if not s.done()]
        assert len(open_now) == 16
        open_now[0].cancel()   # a slot freed is a watch possible again
        again = wait_for(lambda: _watch_admitted(watcher), 30, "a watch admitted after one closed")
        again.cancel()
    finally:
        for s in streams:
            s.cancel()


def _watch_admitted(client):
    import time

    stream = client.stream("Watch", pb.WatchAllocationsRequest(), timeout=60)
    time.sleep(0.5)
    if stream.done():
        return None
    return stream
