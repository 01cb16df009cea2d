"""Dialling a node agent: the local unix socket, or TCP with mTLS (or server-only TLS for
the read-only port). Used by the CLI (the local socket), the tests and the benchmark; the
controller dials agents through :mod:`fastshare.controller.agent_client`, which checks that the
certificate is the node's own."""

from __future__ import annotations

from pathlib import Path

import grpc

from fastshare.security.tls import TlsPaths, mtls_channel, secure_channel
from fastshare.v1 import agent_pb2_grpc


def channel(address: str | None = None, unix_socket: str | Path | None = None,
            tls: TlsPaths | None = None, ca: Path | None = None,
            server_name: str | None = None) -> grpc.Channel:
    """``unix_socket``, or ``address`` with ``tls`` (mTLS) or only ``ca`` (read-only port)."""
    if unix_socket:
        return grpc.insecure_channel(f"unix:{unix_socket}")
    if not address:
        raise ValueError("give a unix socket path or a HOST:PORT address")
    if tls is not None:
        return mtls_channel(address, tls, server_name=server_name)
    if ca is None:
        raise ValueError("a TCP address needs the cluster CA (and a client certificate for mutations)")
    return secure_channel(address, ca, server_name=server_name)


def stub(ch: grpc.Channel) -> agent_pb2_grpc.NodeAgentStub:
    return agent_pb2_grpc.NodeAgentStub(ch)
