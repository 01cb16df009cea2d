"""mTLS over real gRPC on loopback: who gets in, what the servicer sees, rotation on disk.

The node agent and the controller both build their ports from ``server_credentials``; their
own tests repeat the refusals against the real services."""

from concurrent import futures

import grpc
import pytest

from fastshare.security import certs as pki
from fastshare.security.tls import (
    TlsPaths,
    mtls_channel,
    peer_identity,
    require_peer,
    secure_channel,
    server_credentials,
)

from .handmade import issue_client_cert, served_certificate

METHOD = "/test.Echo/Who"


class _Who(grpc.GenericRpcHandler):
    """Replies with the caller's CN; a second method demands a peer from an allow-list."""

    def service(self, details):
        if details.method == METHOD:
            def who(_req, ctx):
                peer = peer_identity(ctx)
                return (peer.common_name if peer else "anonymous").encode()
            return grpc.unary_unary_rpc_method_handler(who)
        if details.method == "/test.Echo/Admin":
            def admin(_req, ctx):
                return require_peer(ctx, allowed={"admin"}).common_name.encode()
            return grpc.unary_unary_rpc_method_handler(admin)
        return None


@pytest.fixture
def pkis(tmp_path):
    """Two independent CAs: the cluster's and a stranger's, with certs from each."""
    for ca in ("ca", "other-ca"):
        pki.init_ca(tmp_path / ca)
    pki.issue(tmp_path / "ca", "server", tmp_path / "server", sans=["127.0.0.1"], role="node", days=1)
    pki.issue(tmp_path / "ca", "admin", tmp_path / "admin", role="client", days=1)
    pki.issue(tmp_path / "ca", "worker", tmp_path / "worker", role="client", days=1)
    pki.issue(tmp_path / "other-ca", "admin", tmp_path / "intruder", role="client", days=1)
    issue_client_cert(tmp_path / "ca", "admin", tmp_path / "expired", ends_in_days=-1)
    issue_client_cert(tmp_path / "ca", "admin", tmp_path / "handmade", ends_in_days=1)  # control
    return tmp_path


def _serve(paths: TlsPaths, require: bool):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_Who(),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(paths, require_client_cert=require))
    server.start()
    return server, f"127.0.0.1:{port}"


def _call(channel, method=METHOD):
    with channel:
        return channel.unary_unary(method)(b"", timeout=10)


def test_mtls_admits_cluster_clients_and_exposes_their_name(pkis):
    server, target = _serve(TlsPaths.in_dir(pkis / "server", "server"), require=True)
    try:
        assert _call(mtls_channel(target, TlsPaths.in_dir(pkis / "admin", "admin"))) == b"admin"
        # The hand-made certificate the "expired" case uses is fine while it is valid.
        assert _call(secure_channel(target, pkis / "ca" / "ca.crt", pkis / "handmade" / "admin.crt",
                                    pkis / "handmade" / "admin.key")) == b"admin"
        assert _call(mtls_channel(target, TlsPaths.in_dir(pkis / "admin", "admin")),
                     "/test.Echo/Admin") == b"admin"
        with pytest.raises(grpc.RpcError) as err:
            _call(mtls_channel(target, TlsPaths.in_dir(pkis / "worker", "worker")), "/test.Echo/Admin")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(0)


@pytest.mark.parametrize("client", ["none", "wrong-ca", "expired", "plaintext"])
def test_mtls_refuses_clients_without_a_cluster_certificate(pkis, client):
    server, target = _serve(TlsPaths.in_dir(pkis / "server", "server"), require=True)
    try:
        if client == "none":
            channel = secure_channel(target, pkis / "ca" / "ca.crt")
        elif client == "wrong-ca":  # trusts the server, but its own certificate comes from another CA
            channel = secure_channel(target, pkis / "ca" / "ca.crt", pkis / "intruder" / "admin.crt",
                                     pkis / "intruder" / "admin.key")
        elif client == "expired":  # the cluster CA signed it, but its validity is over
            channel = secure_channel(target, pkis / "ca" / "ca.crt", pkis / "expired" / "admin.crt",
                                     pkis / "expired" / "admin.key")
        else:
            channel = grpc.insecure_channel(target)
        with pytest.raises(grpc.RpcError) as err:
            _call(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_server_only_tls_sees_everyone_as_anonymous(pkis):
    server, target = _serve(TlsPaths.in_dir(pkis / "server", "server"), require=False)
    try:
        assert _call(secure_channel(target, pkis / "ca" / "ca.crt")) == b"anonymous"
        with pytest.raises(grpc.RpcError) as err:
            _call(secure_channel(target, pkis / "ca" / "ca.crt"), "/test.Echo/Admin")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_server_follows_certificates_rotated_on_disk(pkis):
    """Re-issue the server's files from a new CA in place: new connections use them."""
    paths = TlsPaths.in_dir(pkis / "server", "server")
    server, target = _serve(paths, require=True)
    try:
        assert _call(mtls_channel(target, TlsPaths.in_dir(pkis / "admin", "admin"))) == b"admin"
        pki.issue(pkis / "other-ca", "server", pkis / "server", sans=["127.0.0.1"], role="node", days=1)
        assert _call(mtls_channel(target, TlsPaths.in_dir(pkis / "intruder", "admin"))) == b"admin"
    finally:
        server.stop(0)


def test_a_half_renewed_pair_is_not_served(pkis):
    """A renewal replaces the key, then the certificate (each atomically). A handshake between
    the two renames gets the old pair (gRPC refuses to load a key that does not match its
    certificate); the renewed controller certificate relies on it."""
    paths = TlsPaths.in_dir(pkis / "server", "server")
    admin = TlsPaths.in_dir(pkis / "admin", "admin")
    ca = pkis / "ca" / "ca.crt"
    server, target = _serve(paths, require=True)
    try:
        old = served_certificate(target, ca, "127.0.0.1", (admin.cert, admin.key))
        pki.issue(pkis / "ca", "server", pkis / "new", sans=["127.0.0.1"], role="node", days=1)
        pki.write_atomic(paths.key, (pkis / "new" / "server.key").read_bytes(), 0o600)
        assert not paths.pair_matches()
        assert _call(mtls_channel(target, admin)) == b"admin"
        assert served_certificate(target, ca, "127.0.0.1", (admin.cert, admin.key)) == old
        pki.write_atomic(paths.cert, (pkis / "new" / "server.crt").read_bytes(), 0o644)
        assert paths.pair_matches()
        assert _call(mtls_channel(target, admin)) == b"admin"
        new = served_certificate(target, ca, "127.0.0.1", (admin.cert, admin.key))
        assert new.serial_number != old.serial_number and new.public_bytes(
            pki.serialization.Encoding.PEM) == paths.cert.read_bytes()
    finally:
        server.stop(0)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tls\.cert"):
        server_credentials(TlsPaths(tmp_path / "x.crt", tmp_path / "x.key", tmp_path / "ca.crt"))
