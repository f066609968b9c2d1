"""Local links (remote_g2.rpc.local_link): real Unix sockets between a leader and its ranks, in one process."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from remote_g2.errors import ConfigError, LinkClosed, ProtocolError, TransportError
from remote_g2.rpc.local_link import LinkListener, MessageLink, connect_link
from remote_g2.protocol.messages import LinkHello, Ping, RankBlocks, TargetDone, TargetLoad
from remote_g2.rpc.client import RpcClient
from remote_g2.rpc.server import RpcServer
from remote_g2.protocol.wire import encode_request


def _wait_readable(link: MessageLink, timeout_s: float = 5.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = link.receive()
        if got:
            return got
        time.sleep(0.001)
    raise AssertionError("nothing arrived")


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "leader.sock")


def _pair(path: str, ranks: tuple[int, ...] = (1,), **options) -> tuple[LinkListener, dict[int, MessageLink],
                                                                          dict[int, MessageLink]]:
    listener = LinkListener(path)
    theirs: dict[int, MessageLink] = {}

    def connect(r: int) -> None:
        theirs[r] = connect_link(path, rank=r, worker_id="w", timeout_s=5, **options)

    threads = [threading.Thread(target=connect, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    ours = listener.accept_ranks(set(ranks), "w", timeout_s=5, **options)
    for t in threads:
        t.join()
    return listener, ours, theirs


def _load(n: int, load_id: int = 1, source_tp: int = 1) -> TargetLoad:
    return TargetLoad(load_id, "src", 7, source_tp, False, 0, [RankBlocks(r, list(range(n))) for r in range(source_tp)],
                      [], list(range(n)), 1000)


def test_messages_cross_both_ways_in_order_and_ranks_are_identified(sock_path: str) -> None:
    listener, ours, theirs = _pair(sock_path, ranks=(1, 2, 3))
    assert sorted(ours) == [1, 2, 3]
    for r, link in ours.items():
        for i in range(50):
            link.send(_load(1, load_id=100 * r + i + 1))
    for r, link in theirs.items():
        got: list = []
        while len(got) < 50:
            got += _wait_readable(link)
        assert [m.load_id for m in got] == [100 * r + i + 1 for i in range(50)]
        link.send(TargetDone(7, r, True, "", 4096, 1))
    for r, link in ours.items():
        assert _wait_readable(link) == [TargetDone(7, r, True, "", 4096, 1)]
    listener.close()
    assert not os.path.exists(sock_path)


def test_a_message_larger_than_the_socket_buffers_arrives_whole(sock_path: str) -> None:
    _, ours, theirs = _pair(sock_path)
    big = _load(60_000, source_tp=8)  # ~1.6 MB of msgpack: several socket-buffer fills
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(_wait_readable(theirs[1], 20)))
    reader.start()
    ours[1].send(big)
    reader.join(20)
    while not got:  # the reader may have returned the first batch only once everything was in
        got += _wait_readable(theirs[1])
    assert got == [big]


def test_a_peer_that_closes_is_noticed_after_what_it_sent(sock_path: str) -> None:
    _, ours, theirs = _pair(sock_path)
    theirs[1].send(TargetDone(1, 1, False, "bye"))
    theirs[1].close()
    assert _wait_readable(ours[1]) == [TargetDone(1, 1, False, "bye")]
    with pytest.raises(LinkClosed, match="closed"):
        ours[1].receive()
    assert ours[1].closed and ours[1].fileno() == -1
    with pytest.raises(LinkClosed):
        ours[1].send(_load(1))


def test_garbage_and_oversized_frames_raise_protocol_errors_and_close_the_link(sock_path: str) -> None:
    listener = LinkListener(sock_path)
    for bad, why in [(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", "not valid msgpack"),
                     (struct.pack(">I", 1 << 30), "frame of 1073741824 bytes"),
                     (struct.pack(">I", 4) + b"\x93\x01\x02\x03", "header must be a map")]:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(sock_path)
        conn, _ = listener._sock.accept()
        link = MessageLink(conn, "raw peer", max_frame_bytes=1 << 20)
        raw.sendall(bad)
        with pytest.raises(ProtocolError, match=why):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                link.receive()
                time.sleep(0.001)
        assert link.closed
        raw.close()
    listener.close()


def test_send_to_a_peer_that_stopped_reading_gives_up_after_its_timeout(sock_path: str) -> None:
    _, ours, theirs = _pair(sock_path, send_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(LinkClosed, match="read nothing for 0.3 s"):
        for i in range(10_000):  # never read by `theirs`: the buffers fill, then the wait times out
            ours[1].send(_load(20_000, load_id=i + 1, source_tp=4))
    assert time.monotonic() - t0 < 5
    assert ours[1].closed


def test_accept_names_the_ranks_that_never_connected(sock_path: str) -> None:
    listener = LinkListener(sock_path)
    early = connect_link(sock_path, rank=2, worker_id="w", timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"rank\(s\) \[1, 3\] did not connect .* within 0.3 s"):
        listener.accept_ranks({1, 2, 3}, "w", timeout_s=0.3)
    assert time.monotonic() - t0 < 3
    early.close()
    listener.close()


def test_accept_ignores_strays_and_refuses_an_impostor(sock_path: str) -> None:
    listener = LinkListener(sock_path)
    stray = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stray.connect(sock_path)
    stray.sendall(b"\x00\x00\x00\x02hi")  # not a frame: dropped, accepting goes on
    wrong_type = connect_link(sock_path, rank=1, worker_id="w", timeout_s=5)
    wrong_type.send(Ping())  # a valid frame right after the hello: kept for later
    good = connect_link(sock_path, rank=2, worker_id="w", timeout_s=5)
    links = listener.accept_ranks({1, 2}, "w", timeout_s=5)
    assert sorted(links) == [1, 2]
    assert _wait_readable(links[1]) == [Ping()]  # what followed the hello is not lost
    impostor = connect_link(sock_path, rank=1, worker_id="other-worker", timeout_s=5)
    with pytest.raises(TransportError, match="rank 1 of worker 'other-worker'"):
        listener.accept_ranks({1}, "w", timeout_s=5)
    for c in (stray, wrong_type, good, impostor):
        c.close()
    listener.close()


def test_a_listener_does_not_take_over_a_path_someone_serves(sock_path: str) -> None:
    first = LinkListener(sock_path)
    with pytest.raises(ConfigError, match="served by another process"):
        LinkListener(sock_path)
    first._sock.close()  # crashed without cleaning up: the stale file is reclaimed
    second = LinkListener(sock_path)
    second.close()


def test_one_way_messages_are_not_rpcs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one-way"):
        RpcServer(f"ipc://{tmp_path}/x.sock", {"target_done": lambda req, ctx: None})
    server = RpcServer(f"ipc://{tmp_path}/y.sock", {}, name="plain", workers=1)
    endpoint = server.start()
    try:
        with RpcClient(endpoint, timeout_ms=2000) as client:
            with pytest.raises(Exception, match="does not serve 'link_hello'"):
                client.call(LinkHello("w", 1))
            assert client.ping().server == "plain"  # and it keeps serving
    finally:
        server.close()


def test_frames_are_the_rpc_envelope(sock_path: str) -> None:
    """A link frame is a length prefix plus exactly the bytes an RPC request would carry."""
    listener = LinkListener(sock_path)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(sock_path)
    frame = encode_request(1, LinkHello("w", 1))
    raw.sendall(struct.pack(">I", len(frame)) + frame)
    links = listener.accept_ranks({1}, "w", timeout_s=5)
    assert links[1].peer == "rank 1"
    raw.close()
    listener.close()


def test_a_send_to_a_vanished_peer_raises_even_with_sigpipe_at_its_default(tmp_path: Path) -> None:
    """Engines may restore SIGPIPE's default (terminate); a link must still fail with LinkClosed, not kill them."""
    script = f"""
import signal, sys, threading, time
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
from remote_g2.errors import LinkClosed
from remote_g2.rpc.local_link import LinkListener, connect_link
from remote_g2.protocol.messages import TargetDone
path = {str(tmp_path / "pipe.sock")!r}
listener = LinkListener(path)
theirs = {{}}
t = threading.Thread(target=lambda: theirs.setdefault(1, connect_link(path, rank=1, worker_id="w", timeout_s=5)))
t.start()
ours = listener.accept_ranks({{1}}, "w", timeout_s=5)
t.join()
theirs[1].close()
time.sleep(0.05)
try:
    for _ in range(5):
        ours[1].send(TargetDone(1, 1, True))
except LinkClosed:
    sys.exit(0)
sys.exit(3)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr.decode()[-2000:])  # -13 would be death by SIGPIPE
