"""The stream lane (``tcp+stream://``): a StreamRpcServer on real TCP sockets, called by RpcClient and RpcMux.

Every wait is bounded by a count and a clock; servers, clients and muxes are closed by fixtures.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import pytest

from remote_g2.rpc.curve import CurveClientConfig, generate_keypair
from remote_g2.errors import ConfigError, FrameTooLarge, RpcTimeout, SourceError, TransportError
from remote_g2.protocol.messages import Heartbeat, HeartbeatReply, Ping, Pong, Release
from remote_g2.rpc.client import RpcClient
from remote_g2.rpc.mux import RpcMux
from remote_g2.rpc.stream import (
    StreamRpcServer,
    parse_stream_endpoint,
    stream_endpoint_on_host_of,
)
from remote_g2.protocol.wire import PROTOCOL_VERSION, encode_request, stream_frame, take_stream_frames

from test_rpc_mux import drive


@pytest.fixture
def serve():
    """``serve(handlers, **kw) -> endpoint``: a started StreamRpcServer on 127.0.0.1, closed after the test."""
    servers: list[StreamRpcServer] = []

    def start(handlers=None, **kwargs):
        server = StreamRpcServer(kwargs.pop("endpoint", "tcp+stream://127.0.0.1:0"), handlers or {},
                                 name=kwargs.pop("name", "lane"), **kwargs)
        servers.append(server)
        return server.start()

    start.servers = servers
    yield start
    for s in servers:
        s.close()


@pytest.fixture
def clients():
    made: list = []

    def make(endpoint, **kwargs):
        c = RpcMux(**kwargs) if endpoint is None else RpcClient(endpoint, timeout_ms=kwargs.pop("timeout_ms", 3000))
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def who_calls(req: Heartbeat, ctx) -> HeartbeatReply:
    """Answers with the caller's connection id folded into a number: which connection a call came on."""
    return HeartbeatReply(status="ok", lease_ttl_ms=int.from_bytes(ctx.peer[-4:], "big") * 1000 + req.epoch % 1000)


def raw_exchange(endpoint: str, data: bytes, *, replies: int = 1, timeout_s: float = 3.0) -> tuple[list, bool]:
    """Send raw bytes on a fresh connection; the decoded replies, and whether the server closed it after them."""
    host, port = parse_stream_endpoint(endpoint)
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(data)
        buf, frames, closed = bytearray(), [], False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not closed:
            s.settimeout(max(0.01, deadline - time.monotonic()) if len(frames) < replies else 0.3)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            closed = not chunk
            buf += chunk
            frames += [msgpack.unpackb(f) for f in take_stream_frames(buf)]
        return frames, closed


def test_endpoint_spelling():
    assert parse_stream_endpoint("tcp+stream://127.0.0.1:7461") == ("127.0.0.1", 7461)
    assert parse_stream_endpoint("tcp+stream://[::1]:80") == ("::1", 80)
    assert stream_endpoint_on_host_of("tcp://10.1.2.3:7460") == "tcp+stream://10.1.2.3:0"
    assert stream_endpoint_on_host_of("tcp://*:7460") == "tcp+stream://0.0.0.0:0"
    for bad in ("tcp://127.0.0.1:1", "tcp+stream://127.0.0.1", "tcp+stream://:5", "tcp+stream://h:99999"):
        with pytest.raises(ConfigError):
            parse_stream_endpoint(bad)


def test_client_and_mux_calls_round_trip_and_errors_keep_their_class(serve, clients):
    def refuse(req, ctx):
        raise SourceError("lease 7 refused here")

    ep = serve({"heartbeat": who_calls, "release": refuse})
    assert ep.startswith("tcp+stream://127.0.0.1:") and not ep.endswith(":0")
    client = clients(ep)
    pong = client.ping()
    assert isinstance(pong, Pong) and pong.server == "lane"
    first = client.call(Heartbeat("w", 5))
    assert first.lease_ttl_ms % 1000 == 5 and client.call(Heartbeat("w", 6)).lease_ttl_ms == first.lease_ttl_ms + 1
    with pytest.raises(SourceError, match="lease 7 refused here") as info:
        client.call(Release(7))
    assert info.value.remote == ep

    mux = clients(None, timeout_ms=3000)
    got: list = []
    for i in range(50):  # all in flight on one connection; each reply reaches its own callback
        mux.call(ep, Heartbeat("w", i), got.append)
    drive(mux, lambda: len(got) == 50)
    assert sorted(r.lease_ttl_ms % 1000 for r in got) == list(range(50))
    assert len({r.lease_ttl_ms // 1000 for r in got}) == 1  # one connection
    assert got[0].lease_ttl_ms // 1000 != first.lease_ttl_ms // 1000  # not the client's


def test_malformed_frames_get_err_and_the_connection_and_server_keep_serving(serve, clients):
    ep = serve({"heartbeat": who_calls}, max_frame_bytes=1 << 16)
    bad = [b"garbage",
           msgpack.packb([{"v": PROTOCOL_VERSION, "id": 5}, "no_such_message", {}]),
           msgpack.packb([{"v": PROTOCOL_VERSION, "id": 6}, "ping", {"junk": 1}])]
    good = encode_request(7, Ping())
    replies, closed = raw_exchange(ep, b"".join(stream_frame(f) for f in [*bad, good]), replies=4)
    assert not closed
    assert [(r[1], r[2].get("name")) for r in replies[:3]] == [
        ("ERR", "ProtocolError"), ("ERR", "UnknownMessage"), ("ERR", "ProtocolError")]
    assert [r[0].get("re") for r in replies] == [None, 5, 6, 7] and replies[3][1] == "OK"
    assert clients(ep).ping().server == "lane"


def test_requests_sent_just_before_the_client_hangs_up_are_still_handled(serve):
    seen: list[int] = []

    def note(req, ctx):
        seen.append(req.epoch)
        return who_calls(req, ctx)

    ep = serve({"heartbeat": note})
    host, port = parse_stream_endpoint(ep)
    with socket.create_connection((host, port), timeout=3) as s:
        s.sendall(b"".join(stream_frame(encode_request(i, Heartbeat("w", i))) for i in (1, 2, 3)))
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [1, 2, 3]


def test_an_oversized_length_is_answered_err_and_closes_only_that_connection(serve, clients):
    ep = serve({"heartbeat": who_calls}, max_frame_bytes=1 << 16)
    client = clients(ep)
    assert client.call(Heartbeat("w", 1)).lease_ttl_ms % 1000 == 1
    replies, closed = raw_exchange(ep, struct.pack(">I", 1 << 30) + b"x" * 100)
    assert closed and len(replies) == 1
    assert replies[0][1] == "ERR" and replies[0][2]["name"] == "FrameTooLarge" and "re" not in replies[0][0]
    assert client.call(Heartbeat("w", 2)).lease_ttl_ms % 1000 == 2  # the others' connections are untouched


def test_a_server_that_hangs_up_fails_the_open_calls_at_once_and_the_next_call_connects_again(clients):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ep = f"tcp+stream://127.0.0.1:{port}"

    def accept_read_hang_up() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        conn.recv(100)
        conn.close()

    t = threading.Thread(target=accept_read_hang_up, daemon=True)
    t.start()
    mux = clients(None, timeout_ms=10_000)
    got: list = []
    mux.call(ep, Heartbeat("w", 1), got.append)
    mux.call(ep, Heartbeat("w", 2), got.append)
    spent = drive(mux, lambda: len(got) == 2)
    assert spent < 3 and all(isinstance(g, TransportError) for g in got), got  # not the 10 s timeout
    t.join(5)
    listener.close()
    again = StreamRpcServer(ep, {"heartbeat": who_calls}, name="again")  # same port: the next call reconnects
    try:
        assert again.start() == ep
        last: list = []
        mux.call(ep, Heartbeat("w", 3), last.append)
        drive(mux, lambda: bool(last))
        assert isinstance(last[0], HeartbeatReply) and last[0].lease_ttl_ms % 1000 == 3
    finally:
        again.close()


def test_a_client_whose_server_closes_mid_call_gets_transport_error_not_a_timeout(clients):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = clients(f"tcp+stream://127.0.0.1:{port}", timeout_ms=10_000)

    def accept_and_hang_up() -> None:
        conn, _ = listener.accept()
        conn.recv(100)
        conn.close()

    t = threading.Thread(target=accept_and_hang_up, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="closed the connection"):
        client.ping()
    assert time.monotonic() - t0 < 3
    t.join(5)
    listener.close()


def test_nothing_listening_is_a_transport_error_for_the_client_and_the_mux(clients):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = f"tcp+stream://127.0.0.1:{port}"
    with pytest.raises(TransportError):
        clients(ep).ping()
    mux = clients(None, timeout_ms=5000)
    got: list = []
    mux.call(ep, Ping(), got.append)
    t = drive(mux, lambda: bool(got))
    assert isinstance(got[0], TransportError) and t < 2


def test_curve_is_never_silently_dropped(clients, tmp_path):
    server_pub, _ = generate_keypair(tmp_path / "server", "server")
    curve = CurveClientConfig.for_server(str(server_pub))
    with pytest.raises(ConfigError, match="CURVE"):
        RpcClient("tcp+stream://127.0.0.1:1", curve=curve)
    mux = clients(None, curve=curve)
    got: list = []
    mux.call("tcp+stream://127.0.0.1:1", Ping(), got.append)
    drive(mux, lambda: bool(got))
    assert isinstance(got[0], TransportError) and "in the clear" in str(got[0])


def test_a_timed_out_call_leaves_the_connection_usable_and_its_late_reply_is_dropped(serve, clients):
    slow_once = threading.Event()

    def handler(req, ctx):
        if req.epoch == 1 and not slow_once.is_set():
            slow_once.set()
            time.sleep(0.4)
        return who_calls(req, ctx)

    ep = serve({"heartbeat": handler})
    client = clients(ep)
    with pytest.raises(RpcTimeout, match="heartbeat"):
        client.call(Heartbeat("w", 1), timeout_ms=100)
    assert client.call(Heartbeat("w", 2), timeout_ms=3000).lease_ttl_ms % 1000 == 2


def test_replies_a_client_does_not_read_are_bounded(serve):
    ep = serve({}, max_frame_bytes=1 << 12)
    host, port = parse_stream_endpoint(ep)
    with socket.create_connection((host, port), timeout=3) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        ping = stream_frame(encode_request(1, Ping()))
        closed = False
        for _ in range(200_000):  # never read: the server's outbox passes its bound and it hangs up
            try:
                s.sendall(ping * 64)
            except OSError:
                closed = True
                break
        assert closed, "the server kept queueing replies for a client that reads none"
    with RpcClient(ep, timeout_ms=3000) as c:
        assert c.ping().server == "lane"


def test_take_stream_frames_keeps_a_partial_frame_and_refuses_an_oversized_length():
    buf = bytearray(stream_frame(b"a") + stream_frame(b"bc") + b"\x00\x00")
    assert take_stream_frames(buf) == [b"a", b"bc"] and buf == bytearray(b"\x00\x00")
    buf += b"\x00\x03ab"
    assert take_stream_frames(buf) == [] and len(buf) == 6
    buf += b"c"
    assert take_stream_frames(buf) == [b"abc"] and not buf
    with pytest.raises(FrameTooLarge, match="100 bytes"):
        take_stream_frames(bytearray(struct.pack(">I", 100)), max_frame_bytes=10)
