"""Connection identities (remote_g2/rpc/connection_identity.py) on a real ROUTER: drawn by the server, per connection.

What leases are bound to (docs/security.md, "Who owns a lease"): the same
connection keeps its identity, another connection never shares it — not even
one that presents the same routing id on the descriptor a closed connection
freed — in direct and pooled servers, and with CURVE the client's key is part
of it.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
from zmq_clients import call_with_routing_id

from remote_g2.rpc.connection_identity import is_local, new_identity, peer_is_local
from remote_g2.rpc.curve import CurveClientConfig, CurveServerConfig, generate_keypair
from remote_g2.protocol.messages import Release, ReleaseReply
from remote_g2.rpc.client import RpcClient
from remote_g2.rpc.server import CallContext, RpcServer


class Recorder:
    """A ``release`` handler that remembers who called: lease id → identity."""

    def __init__(self) -> None:
        self.seen: dict[int, bytes | None] = {}
        self.lock = threading.Lock()

    def __call__(self, req: Release, ctx: CallContext) -> ReleaseReply:
        with self.lock:
            self.seen[req.lease_id] = ctx.identity
        return ReleaseReply(True)


def _dealer_call(endpoint: str, routing_id: bytes, lease_id: int, curve: CurveClientConfig | None = None) -> None:
    """A ``release`` from a DEALER that names its own routing id; the recorder answers it released."""
    assert call_with_routing_id(endpoint, routing_id, Release(lease_id), curve) == ReleaseReply(True)


@pytest.mark.parametrize("workers", [1, 3])
def test_identities_are_per_connection_and_never_follow_a_routing_id(workers: int) -> None:
    rec = Recorder()
    server = RpcServer("tcp://127.0.0.1:0", {"release": rec}, workers=workers, identify_clients=True)
    endpoint = server.start()
    try:
        with RpcClient(endpoint, timeout_ms=3000) as a, RpcClient(endpoint, timeout_ms=3000) as b:
            for i in range(5):
                a.call(Release(100 + i))
                b.call(Release(200 + i))
        a_ids = {rec.seen[100 + i] for i in range(5)}
        b_ids = {rec.seen[200 + i] for i in range(5)}
        assert len(a_ids) == 1 and len(b_ids) == 1 and a_ids != b_ids
        assert all(isinstance(x, bytes) and len(x) == 17 for x in a_ids | b_ids)
        assert all(is_local(x) for x in a_ids | b_ids)  # over loopback: a reader on this host
        # One routing id, three connections one after another (each on the descriptor the last one freed):
        # three identities.
        for k in range(3):
            _dealer_call(endpoint, b"same-id", 300 + k)
            time.sleep(0.05)
        assert len({rec.seen[300 + k] for k in range(3)}) == 3
        assert rec.seen[300] not in a_ids | b_ids
    finally:
        server.close()


def test_a_server_that_does_not_identify_clients_says_so() -> None:
    rec = Recorder()
    server = RpcServer("tcp://127.0.0.1:0", {"release": rec}, workers=1)
    endpoint = server.start()
    try:
        with RpcClient(endpoint, timeout_ms=3000) as c:
            c.call(Release(1))
        assert rec.seen == {1: None}
    finally:
        server.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_with_a_curve_allow_list_the_clients_key_is_part_of_its_identity(tmp_path: Path) -> None:
    _, server_secret = generate_keypair(tmp_path / "server", "server")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    clients = {}
    for name in ("one", "two"):
        public, secret = generate_keypair(tmp_path / name, name)
        (allowed / public.name).write_bytes(public.read_bytes())
        clients[name] = CurveClientConfig.for_server(str(tmp_path / "server" / "server.key"), str(secret))
    rec = Recorder()
    server = RpcServer("tcp://127.0.0.1:0", {"release": rec}, workers=1, identify_clients=True,
                       curve=CurveServerConfig.from_files(server_secret, allowed))
    endpoint = server.start()
    try:
        _dealer_call(endpoint, b"shared", 1, clients["one"])
        time.sleep(0.05)
        _dealer_call(endpoint, b"shared", 2, clients["two"])
        one_key = clients["one"].public_key  # Z85, as the key files hold it and ZAP names it
        two_key = clients["two"].public_key
        assert rec.seen[1].startswith(one_key + b"/") and rec.seen[2].startswith(two_key + b"/")
    finally:
        server.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_with_curve_and_no_allow_list_the_clients_key_is_still_part_of_its_identity(tmp_path: Path) -> None:
    _, server_secret = generate_keypair(tmp_path / "server", "server")
    _, secret = generate_keypair(tmp_path / "client", "client")
    client = CurveClientConfig.for_server(str(tmp_path / "server" / "server.key"), str(secret))
    anonymous = CurveClientConfig.for_server(str(tmp_path / "server" / "server.key"))  # a key drawn per socket
    rec = Recorder()
    server = RpcServer("tcp://127.0.0.1:0", {"release": rec}, workers=2, identify_clients=True,
                       curve=CurveServerConfig.from_files(server_secret))
    endpoint = server.start()
    try:
        _dealer_call(endpoint, b"a", 1, client)
        _dealer_call(endpoint, b"b", 2, anonymous)
        assert rec.seen[1].startswith(client.public_key + b"/")
        assert len(rec.seen[2]) == 40 + 1 + 17 and not rec.seen[2].startswith(client.public_key)
    finally:
        server.close()


class _Connected:
    """Stands in for a connected socket whose peer is another host (no second host is reachable from a unit test)."""

    family = socket.AF_INET

    def __init__(self, peer: str, own: str) -> None:
        self._peer, self._own = peer, own

    def getpeername(self) -> tuple[str, int]:
        return self._peer, 40000

    def getsockname(self) -> tuple[str, int]:
        return self._own, 5555


def test_an_identity_records_whether_its_peer_is_on_this_host() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        accepted, _ = listener.accept()
        with accepted:
            assert peer_is_local(accepted) and peer_is_local(client)
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_is_local(a)
    assert peer_is_local(_Connected("10.0.0.5", "10.0.0.5"))  # our own address: another process of this host
    assert not peer_is_local(_Connected("10.0.0.7", "10.0.0.5"))  # another host
    assert is_local(new_identity(local=True)) and not is_local(new_identity())  # unknown counts as elsewhere
    assert is_local(new_identity(b"K" * 40, local=True)) and not is_local(new_identity(b"K" * 40))


def test_the_stream_lane_marks_a_loopback_reader_local() -> None:
    from remote_g2.rpc.stream import StreamRpcServer

    rec = Recorder()
    server = StreamRpcServer("tcp+stream://127.0.0.1:0", {"release": rec})
    endpoint = server.start()
    try:
        with RpcClient(endpoint, timeout_ms=3000) as c:
            c.call(Release(7))
        assert is_local(rec.seen[7])
    finally:
        server.close()
