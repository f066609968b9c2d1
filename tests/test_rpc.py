"""RPC server and client over real ZMQ sockets (TCP on 127.0.0.1, and IPC)."""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import pytest
import zmq

import remote_g2
from remote_g2.rpc.curve import CurveClientConfig, CurveServerConfig, generate_keypair
from remote_g2.errors import (
    ConfigError,
    RemoteError,
    RpcClosed,
    RpcTimeout,
    SourceError,
    UnknownMessage,
)
from remote_g2.protocol.messages import Ping, Pong, SiblingPin, SiblingPinReply, Stats
from remote_g2.rpc.client import RpcClient
from remote_g2.rpc.server import RpcServer
from remote_g2.protocol.wire import PROTOCOL_VERSION, encode_request


@pytest.fixture
def serve():
    servers, clients = [], []

    def start(handlers=None, **kwargs):
        server = RpcServer(kwargs.pop("endpoint", "tcp://127.0.0.1:0"), handlers or {}, name="test", **kwargs)
        servers.append(server)
        return server.start()

    def client(endpoint, **kwargs):
        c = RpcClient(endpoint, **kwargs)
        clients.append(c)
        return c

    start.client = client
    yield start
    for c in clients:
        c.close()
    for s in servers:
        s.close()


def raw_call(endpoint: str, data: bytes | list[bytes]) -> list:
    """Send raw frames and return the decoded reply envelope."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        if isinstance(data, list):
            sock.send_multipart(data)
        else:
            sock.send(data)
        assert sock.poll(5000), "server did not answer a malformed frame"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()


def test_ping_names_server_and_version(serve):
    ep = serve()
    pong = serve.client(ep).ping()
    assert isinstance(pong, Pong)
    assert pong.server == "test" and pong.version == remote_g2.__version__
    assert pong.uptime_s >= 0


def test_ipc_endpoint(serve, tmp_path):
    ep = serve(endpoint=f"ipc://{tmp_path}/rpc.sock")
    assert serve.client(ep).ping().server == "test"


def test_many_clients_are_served_concurrently(serve):
    n = 4
    barrier = threading.Barrier(n, timeout=10)

    def slow_ping(req, ctx):
        barrier.wait()  # passes only if n handlers run at the same time
        return Pong(server="slow", version="x", uptime_s=0.0)

    ep = serve({"ping": slow_ping}, workers=n)
    results, errors = [], []

    def call():
        try:
            results.append(serve.client(ep, timeout_ms=10_000).ping())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors
    assert [r.server for r in results] == ["slow"] * n


def test_timeout_names_the_call_and_a_late_reply_is_discarded(serve):
    release = threading.Event()
    calls = []

    def stuck_ping(req, ctx):
        calls.append(ctx.msg_id)
        if len(calls) == 1:
            release.wait(10)
            return Pong(server="late", version="x", uptime_s=0.0)
        return Pong(server="fresh", version="x", uptime_s=0.0)

    ep = serve({"ping": stuck_ping}, workers=1)
    client = serve.client(ep, timeout_ms=200)
    with pytest.raises(RpcTimeout) as info:
        client.ping()
    assert info.value.call == "ping" and info.value.endpoint == ep
    assert "calling ping" in str(info.value) and "200 ms" in str(info.value)
    release.set()
    # The late "late" reply arrives first on the socket and must be skipped.
    assert client.ping(timeout_ms=5000).server == "fresh"


def test_remote_errors_map_to_the_tree(serve):
    def fail(req, ctx):
        raise SourceError("lease 42 is unknown")

    ep = serve({"ping": fail})
    with pytest.raises(SourceError) as info:
        serve.client(ep).ping()
    assert info.value.remote == ep and "lease 42" in str(info.value)


def test_a_reply_the_wire_cannot_carry_is_internal_error_and_server_lives_on(serve):
    replies = iter([SiblingPinReply([-1]), SiblingPinReply([2**64]), SiblingPinReply([3, 4])])

    ep = serve({"sibling_pin": lambda req, ctx: next(replies)})
    client = serve.client(ep)
    for _ in range(2):  # ids a packed u64 list cannot hold
        with pytest.raises(RemoteError) as info:
            client.call(SiblingPin(1, [b"h"], 1000, b"o"))
        assert info.value.name == "InternalError" and "pack" in str(info.value)
    assert client.call(SiblingPin(1, [b"h"], 1000, b"o")).block_ids == [3, 4]


def test_unexpected_exception_is_internal_error_and_server_lives_on(serve):
    n = {"calls": 0}

    def flaky(req, ctx):
        n["calls"] += 1
        if n["calls"] == 1:
            raise KeyError("boom")
        if n["calls"] == 2:
            return "not a Pong"
        return Pong(server="ok", version="x", uptime_s=0.0)

    ep = serve({"ping": flaky})
    client = serve.client(ep)
    with pytest.raises(RemoteError) as info:
        client.ping()
    assert info.value.name == "InternalError" and "boom" in str(info.value)
    with pytest.raises(RemoteError, match="returned str"):
        client.ping()
    assert client.ping().server == "ok"


@pytest.mark.parametrize(
    "frames, name",
    [
        (b"garbage", "ProtocolError"),
        (msgpack.packb([{"v": PROTOCOL_VERSION, "id": 5}, "no_such_message", {}]), "UnknownMessage"),
        (msgpack.packb([{"v": PROTOCOL_VERSION, "id": 5}, "ping", {"junk": 1}]), "ProtocolError"),
        (msgpack.packb([{"v": 9, "id": 5}, "ping", {}]), "ProtocolError"),
        (msgpack.packb([{"v": PROTOCOL_VERSION, "id": 5, "re": 1}, "ping", {}]), "ProtocolError"),
        ([b"a", b"b"], "ProtocolError"),
        (b"\x00" * (2 * 1024 * 1024 + 1), "FrameTooLarge"),
    ],
)
def test_malformed_frames_get_err_and_server_keeps_serving(serve, frames, name):
    ep = serve(max_frame_bytes=2 * 1024 * 1024)
    reply = raw_call(ep, frames)
    assert reply[1] == "ERR"
    assert reply[2]["name"] == name
    if isinstance(frames, bytes) and frames.startswith(b"\x93"):
        assert reply[0]["re"] == 5  # the id was readable, so the ERR says which request
    assert serve.client(ep).ping().server == "test"


def test_server_that_does_not_serve_a_type_says_so():
    # "ping" is always served; drop it to see the refusal path.
    server = RpcServer("tcp://127.0.0.1:0", {}, name="bare")
    server._calls.handlers.pop("ping")
    ep = server.start()
    try:
        with RpcClient(ep) as c, pytest.raises(UnknownMessage, match="does not serve"):
            c.ping()
    finally:
        server.close()


def test_overload_is_backpressure_not_a_crash(serve):
    release = threading.Event()
    entered = threading.Event()

    def block(req, ctx):
        entered.set()
        release.wait(10)
        return Pong(server="x", version="x", uptime_s=0.0)

    ep = serve({"ping": block}, workers=1, queue_depth=1)
    first = serve.client(ep, timeout_ms=10_000)
    t = threading.Thread(target=first.ping)
    t.start()
    assert entered.wait(5)
    # The only handler thread is busy: a second caller waits, then times out by name.
    with pytest.raises(RpcTimeout, match="calling ping"):
        serve.client(ep, timeout_ms=300).ping()
    release.set()
    t.join(10)
    assert serve.client(ep).ping().server == "x"


def test_close_is_idempotent_and_calls_after_close_fail(serve):
    server = RpcServer("tcp://127.0.0.1:0", {}, name="x")
    ep = server.start()
    client = RpcClient(ep)
    assert client.ping().server == "x"
    client.close()
    client.close()
    with pytest.raises(RpcClosed):
        client.ping()
    server.close()
    server.close()


def test_bind_conflict_is_a_config_error(serve):
    ep = serve()
    with pytest.raises(ConfigError, match="cannot bind"):
        RpcServer(ep, {}, name="dup").start()


def test_handlers_for_unknown_messages_are_rejected():
    with pytest.raises(ConfigError):
        RpcServer("tcp://127.0.0.1:0", {"nope": lambda r, c: None})


def test_observer_sees_every_outcome(serve):
    seen = []
    ep = serve(on_call=lambda t, s, o: seen.append((t, o)))
    serve.client(ep).ping()
    raw_call(ep, b"junk")
    assert ("ping", "ok") in seen and ("?", "bad_request") in seen


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encrypts_and_authenticates(serve, tmp_path):
    server_pub, server_secret = generate_keypair(tmp_path / "server", "server")
    allowed = tmp_path / "clients"
    _, good_secret = generate_keypair(allowed, "good")
    _, bad_secret = generate_keypair(tmp_path / "other", "bad")

    # Without an allow-list: any client that knows the server key gets in; a plain one does not.
    ep = serve(curve=CurveServerConfig.from_files(server_secret))
    assert serve.client(ep, curve=CurveClientConfig.for_server(str(server_pub))).ping().server == "test"
    with pytest.raises(RpcTimeout):
        serve.client(ep, timeout_ms=300).ping()

    # With an allow-list: only listed client keys.
    ep2 = serve(curve=CurveServerConfig.from_files(server_secret, allowed))
    good = CurveClientConfig.for_server(str(server_pub), str(good_secret))
    bad = CurveClientConfig.for_server(str(server_pub), str(bad_secret))
    assert serve.client(ep2, curve=good).ping().server == "test"
    with pytest.raises(RpcTimeout):
        serve.client(ep2, curve=bad, timeout_ms=300).ping()


def test_a_client_the_curve_server_refuses_times_out_every_call_and_never_blocks(serve, tmp_path):
    """A keyless client's handshake keeps failing; each call still ends in RpcTimeout within its timeout.

    Its send once blocked for good (a DEALER without a pipe), taking the engine's
    loop with it; the calls run on a thread so a regression fails instead of hanging.
    """
    _, server_secret = generate_keypair(tmp_path / "server", "server")
    ep = serve(curve=CurveServerConfig.from_files(server_secret))
    slowest: list[float] = []
    errors: list[BaseException] = []

    def calls() -> None:
        for _ in range(30):
            c = RpcClient(ep, timeout_ms=100)
            try:
                for _ in range(3):
                    t0 = time.monotonic()
                    try:
                        c.ping()
                    except RpcTimeout:
                        pass
                    slowest.append(time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                c.close()

    worker = threading.Thread(target=calls, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "a call outlived its timeout (blocked in send)"
    assert not errors and len(slowest) == 90
    assert max(slowest) < 2.0


def test_curve_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        CurveServerConfig.from_files(tmp_path / "missing.key_secret")
    pub, _ = generate_keypair(tmp_path, "s")
    with pytest.raises(ConfigError, match="no secret key"):
        CurveServerConfig.from_files(pub)


def test_request_encoding_rejects_unregistered_types():
    class NotAMessage:
        pass

    with pytest.raises(UnknownMessage):
        encode_request(1, NotAMessage())


@pytest.mark.parametrize("workers", [1, 3])
def test_queued_requests_reach_a_batch_handler_together(serve, workers):
    """Requests that queue while the handler is busy are handed over as one batch."""
    entered, release = threading.Event(), threading.Event()
    batches = []

    def pings(calls):
        batches.append(len(calls))
        if len(batches) == 1:
            entered.set()
            release.wait(10)
        return [Pong(server=f"b{len(batches)}", version="x", uptime_s=float(ctx.msg_id)) for _, ctx in calls]

    ep = serve({}, batch_handlers={"ping": pings}, workers=workers)
    first = threading.Thread(target=lambda: serve.client(ep, timeout_ms=10_000).ping())
    first.start()
    assert entered.wait(10)
    # Four more calls on one socket while the first batch is held: they queue up.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(ep)
    try:
        for i in range(4):
            sock.send(encode_request(100 + i, Ping()))
        time.sleep(0.3)  # let them reach the server's queue
        release.set()
        replies = []
        for _ in range(4):
            assert sock.poll(5000)
            replies.append(msgpack.unpackb(sock.recv(), raw=False))
    finally:
        sock.close()
    first.join(10)
    assert sorted(r[0]["re"] for r in replies) == [100, 101, 102, 103]  # every call answered, by its own id
    assert all(r[1] == "OK" for r in replies)
    if workers == 1:  # direct mode: one thread drained all four at once
        assert batches == [1, 4]
    else:  # the proxy spreads them over the threads; every call still answered once
        assert batches[0] == 1 and sum(batches[1:]) == 4


def test_a_failing_batch_handler_answers_every_call_err(serve):
    def broken(calls):
        raise SourceError("backend is gone")

    def short(calls):
        return []  # answers none of them: a bug, reported per call as InternalError

    ep = serve({}, batch_handlers={"ping": broken}, workers=1)
    with pytest.raises(SourceError, match="backend is gone"):
        serve.client(ep).ping()
    ep2 = serve({}, batch_handlers={"ping": short}, workers=1)
    with pytest.raises(RemoteError) as info:
        serve.client(ep2).ping()
    assert info.value.name == "InternalError" and "answered 0 of 1" in str(info.value)
    with pytest.raises(SourceError):  # both servers keep serving after a failed batch
        serve.client(ep).ping()


def test_a_type_cannot_have_both_a_handler_and_a_batch_handler():
    with pytest.raises(ConfigError, match="both"):
        RpcServer("tcp://127.0.0.1:0", {"ping": lambda r, c: None}, batch_handlers={"ping": lambda calls: []})


def test_a_deferred_batch_does_not_hold_up_other_requests(serve):
    """A batch handler may answer later (its backend's socket turns readable); the thread keeps serving."""

    backend, far_end = socket.socketpair()
    calls_seen = []

    class Later:
        def fileno(self):
            return backend.fileno()

        def result(self):
            backend.recv(1)
            return [Pong(server="later", version="x", uptime_s=0.0) for _ in calls_seen[-1]]

    def pings(calls):
        calls_seen.append(calls)
        return Later()

    def broken_later(calls):
        class Fails(Later):
            def result(self):
                backend.recv(1)
                raise SourceError("backend said no")
        return Fails()

    try:
        ep = serve({}, batch_handlers={"ping": pings}, workers=1)
        slow = serve.client(ep, timeout_ms=5000)
        result = []
        t = threading.Thread(target=lambda: result.append(slow.ping()))
        t.start()
        deadline = time.monotonic() + 5
        while not calls_seen and time.monotonic() < deadline:
            time.sleep(0.01)
        # The ping is parked on the backend; an unknown-to-this-server request is still answered at once.
        with pytest.raises(UnknownMessage):
            serve.client(ep, timeout_ms=2000).call(Stats())
        assert t.is_alive() and not result
        far_end.send(b"x")  # the backend answers
        t.join(5)
        assert [p.server for p in result] == ["later"]

        ep2 = serve({}, batch_handlers={"ping": broken_later}, workers=1)
        far_end.send(b"x")
        with pytest.raises(SourceError, match="backend said no"):
            serve.client(ep2, timeout_ms=5000).ping()
    finally:
        backend.close()
        far_end.close()


def test_driven_server_answers_only_on_its_owners_thread(tmp_path):
    """workers=0: no thread of its own; the owner's loop polls ``socket`` and calls ``serve_ready``."""
    seen_on: list[str] = []

    def stats(req, ctx):
        seen_on.append(threading.current_thread().name)
        raise SourceError("driven handler ran")

    server = RpcServer(f"ipc://{tmp_path}/driven.sock", {"stats": stats}, name="driven", workers=0)
    ep = server.start()
    replies: list[object] = []

    def call() -> None:
        with RpcClient(ep, timeout_ms=5000) as c:
            replies.append(c.ping())
            try:
                c.call(Stats())
            except SourceError as e:
                replies.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        time.sleep(0.2)
        assert replies == []  # nobody served the socket yet: the ping waits
        poller = zmq.Poller()
        poller.register(server.socket, zmq.POLLIN)
        served, deadline = 0, time.monotonic() + 5
        while len(replies) < 2 and time.monotonic() < deadline:
            if poller.poll(50):
                served += server.serve_ready()
        caller.join(5)
        assert served == 2
        assert isinstance(replies[0], Pong) and replies[0].server == "driven"
        assert isinstance(replies[1], SourceError) and "driven handler ran" in str(replies[1])
        assert seen_on == [threading.current_thread().name]
        # a malformed frame gets its ERR from serve_ready too, and the server goes on
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(ep)
        sock.send(b"\xc1 not msgpack")
        deadline = time.monotonic() + 5
        while not sock.poll(10) and time.monotonic() < deadline:
            server.serve_ready()
        assert msgpack.unpackb(sock.recv(), raw=False)[1] == "ERR"
        sock.close()
    finally:
        caller.join(5)
        server.close()


def test_only_a_driven_server_exposes_its_socket(serve):
    server = RpcServer("tcp://127.0.0.1:0", {}, name="threaded", workers=1)
    server.start()
    try:
        with pytest.raises(ConfigError, match="only a driven server"):
            server.socket  # noqa: B018
    finally:
        server.close()
    with pytest.raises(ConfigError, match="workers must be >= 0"):
        RpcServer("tcp://127.0.0.1:0", {}, workers=-1)


class _Arrived:
    def __init__(self, peer: bytes, frame: bytes) -> None:
        self.peer, self.frame, self.abandoned = peer, frame, False

    def abandon(self) -> None:
        self.abandoned = True


def test_arrival_hook_sees_the_raw_frame_before_the_handler_and_abandons_refused_ones(serve):
    arrivals: list[_Arrived] = []
    seen: list[object] = []

    def hook(peer: bytes, frame: bytes) -> _Arrived:
        arrivals.append(_Arrived(peer, frame))
        return arrivals[-1]

    def handler(req: SiblingPin, ctx) -> SiblingPinReply:
        seen.append(ctx.arrival)
        return SiblingPinReply([1, 2])

    ep = serve({"sibling_pin": handler}, on_arrival={"sibling_pin": hook}, workers=2)
    frame = encode_request(5, SiblingPin(9, [b"h" * 8], 1000, b"o"))
    header, kind, _ = raw_call(ep, frame)
    assert kind == "OK" and header["re"] == 5
    assert len(arrivals) == 1 and arrivals[0].frame == frame and seen == [arrivals[0]]
    assert not arrivals[0].abandoned
    # A frame of that type the decoder refuses never reaches the handler: its arrival is abandoned.
    bad = msgpack.packb([{"v": PROTOCOL_VERSION, "id": 6}, "sibling_pin", {"lease_id": 0, "hashes": [], "ttl_ms": 1}])
    assert raw_call(ep, bad)[1] == "ERR"
    assert len(arrivals) == 2 and arrivals[1].frame == bad and arrivals[1].abandoned and len(seen) == 1
    # Other types, and frames whose type cannot be read, do not call the hook.
    assert serve.client(ep).call(Ping()).server == "test"
    assert raw_call(ep, b"\xc1garbage")[1] == "ERR"
    assert len(arrivals) == 2


def test_a_failing_arrival_hook_leaves_the_request_served(serve):
    def hook(peer: bytes, frame: bytes) -> None:
        raise RuntimeError("hook bug")

    ep = serve({"sibling_pin": lambda req, ctx: SiblingPinReply([ctx.arrival is None])},
               on_arrival={"sibling_pin": hook}, workers=1)
    assert serve.client(ep).call(SiblingPin(1, [b"h"], 10, b"o")).block_ids == [1]


def test_arrival_hooks_need_a_handler_of_their_type():
    with pytest.raises(ConfigError, match="without a handler"):
        RpcServer("tcp://127.0.0.1:0", {}, on_arrival={"sibling_pin": lambda peer, frame: None})
