"""Probe, from ctl1 over the cluster network, that agents and controller enforce mTLS.

For every endpoint: the TLS handshake succeeds with a server certificate issued by the cluster
CA for that host name (so it really is TLS with our CA, not a closed port), a read-only call
WITH a cluster client certificate succeeds (the server works), and a mutating call made
WITHOUT a client certificate is refused. Prints one line per endpoint; exits 1 if
any endpoint accepted the call or did not speak TLS with the cluster CA.

Runs with the fastshare virtualenv's python (grpc and the generated stubs come from there).
"""

from __future__ import annotations

import argparse
import socket
import ssl
import sys
from pathlib import Path

import grpc

from fastshare.v1 import agent_pb2, agent_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc

REFUSED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


def server_cert_ok(ca: str, host: str, port: int, server_name: str) -> str | None:
    ctx = ssl.create_default_context(cafile=ca)
    try:
        with socket.create_connection((host, port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=server_name):
            return None
    except (OSError, ssl.SSLError) as exc:
        return f"TLS handshake with {host}:{port} as {server_name!r} failed: {exc}"


def refused(call, request) -> tuple[bool, str]:
    try:
        call(request, timeout=15)
    except grpc.RpcError as exc:
        return exc.code() in REFUSED, f"{exc.code().name}: {(exc.details() or '')[:120]}"
    return False, "ACCEPTED without a client certificate"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ca", required=True)
    parser.add_argument("--agent", action="append", default=[], help="host:port (server name = host)")
    parser.add_argument("--controller", required=True, help="host:port")
    parser.add_argument("--controller-name", default="controller")
    parser.add_argument("--cert", required=True, help="a cluster client certificate (PEM)")
    parser.add_argument("--key", required=True, help="its key")
    args = parser.parse_args()
    ca = Path(args.ca).read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=ca)  # no client key/cert on purpose
    with_cert = grpc.ssl_channel_credentials(ca, Path(args.key).read_bytes(), Path(args.cert).read_bytes())
    bad = 0
    share = agent_pb2.Share(id="verify-mtls-probe", kind=common_pb2.SHARE_KIND_WHOLE)
    agent, ctl = agent_pb2_grpc.NodeAgentStub, controller_pb2_grpc.ControllerStub
    for target, name, make_call, request, make_read, read_request in [
        *[(a, a.rsplit(":", 1)[0], lambda ch: agent(ch).PrepareShare,
           agent_pb2.PrepareShareRequest(share=share),
           lambda ch: agent(ch).GetInventory, agent_pb2.GetInventoryRequest()) for a in args.agent],
        (args.controller, args.controller_name, lambda ch: ctl(ch).Allocate,
         controller_pb2.AllocateRequest(idempotency_key="verify-mtls-probe"),
         lambda ch: ctl(ch).Status, controller_pb2.ClusterStatusRequest()),
    ]:
        host, port = target.rsplit(":", 1)
        problem = server_cert_ok(args.ca, host, int(port), name)
        if problem:
            print(f"{target}: {problem}")
            bad += 1
            continue
        options = [("grpc.ssl_target_name_override", name)]
        with grpc.secure_channel(target, with_cert, options=options) as channel:
            try:
                make_read(channel)(read_request, timeout=15)
            except grpc.RpcError as exc:
                print(f"{target}: read-only call WITH a client certificate failed: {exc.code().name}: "
                      f"{exc.details()}")
                bad += 1
                continue
        with grpc.secure_channel(target, creds, options=options) as channel:
            ok, what = refused(make_call(channel), request)
        print(f"{target}: TLS with the cluster CA; mutation without client certificate -> {what}")
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
