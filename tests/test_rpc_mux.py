"""RpcMux: many calls in flight from one thread, against real RpcServer instances over ZMQ.

Every wait here is bounded by a count and a clock; servers and muxes are closed by fixtures.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import msgpack
import pytest
import zmq

from remote_g2.errors import (
    ProtocolError,
    RegistryError,
    RemoteError,
    RpcClosed,
    RpcTimeout,
    SourceError,
    TransportError,
)
from remote_g2.protocol.messages import Heartbeat, HeartbeatReply, Ping, Pong
from remote_g2.rpc.mux import RpcMux
from remote_g2.rpc.server import RpcServer
from remote_g2.protocol.wire import PROTOCOL_VERSION, decode_frame, encode_err, encode_ok

MARGIN_S = 0.5  # scheduling slack allowed on top of a call's timeout


# -- fixtures and helpers ----------------------------------------------------------------------------


@pytest.fixture
def serve():
    """``serve(handlers, **kw) -> endpoint``: a started RpcServer on 127.0.0.1, closed after the test."""
    servers = []

    def start(handlers=None, **kwargs):
        server = RpcServer(kwargs.pop("endpoint", "tcp://127.0.0.1:0"), handlers or {},
                           name=kwargs.pop("name", "test"), **kwargs)
        servers.append(server)
        return server.start()

    yield start
    for s in servers:
        s.close()


@pytest.fixture
def make_mux():
    """``make_mux(**kw) -> RpcMux``, closed after the test."""
    muxes = []

    def make(**kwargs):
        m = RpcMux(**kwargs)
        muxes.append(m)
        return m

    yield make
    for m in muxes:
        m.close()


@pytest.fixture
def releases():
    """Events the test's handlers block on; all set at teardown so no server thread stays stuck."""
    events: list[threading.Event] = []

    def new() -> threading.Event:
        e = threading.Event()
        events.append(e)
        return e

    yield new
    for e in events:
        e.set()


def drive(mux: RpcMux, done: Callable[[], bool], *, budget_s: float = 5.0, step_ms: float = 50,
          max_loops: int = 10_000) -> float:
    """Run the loop until ``done()``; fail if that takes more than ``budget_s``. Returns the seconds spent."""
    t0 = time.monotonic()
    for _ in range(max_loops):
        if done():
            return time.monotonic() - t0
        if time.monotonic() - t0 > budget_s:
            break
        mux.run_once(step_ms)
    assert done(), f"loop did not finish within {budget_s} s"
    return time.monotonic() - t0


def heartbeat_echo(offset: int):
    """A heartbeat handler whose reply carries the request's epoch (+ offset): it says which call it answers."""
    def handler(req, ctx):
        return HeartbeatReply(status="ok", lease_ttl_ms=req.epoch + offset)
    return handler


def unbound_ipc(tmp_path, name="nobody.sock") -> str:
    return f"ipc://{tmp_path}/{name}"


# -- replies -------------------------------------------------------------------------------------------


def test_calls_to_two_servers_are_in_flight_together_and_each_gets_its_own_reply(serve, make_mux):
    per_server = 3
    # Every handler waits for all six: the barrier passes only if all six calls are in flight at once.
    barrier = threading.Barrier(2 * per_server, timeout=5)

    def gated(offset):
        echo = heartbeat_echo(offset)

        def handler(req, ctx):
            barrier.wait()
            return echo(req, ctx)
        return handler

    ep_a = serve({"heartbeat": gated(0)}, workers=per_server, name="a")
    ep_b = serve({"heartbeat": gated(10_000)}, workers=per_server, name="b")
    mux = make_mux(timeout_ms=5000)

    results: dict[tuple[str, int], list] = {}
    state = {"in_call": False, "in_run_once": False}

    def callback_for(key):
        def cb(outcome):
            assert not state["in_call"], "callback ran inside call()"
            assert state["in_run_once"], "callback ran outside run_once()"
            results.setdefault(key, []).append(outcome)
        return cb

    expected = {}
    for i in range(per_server):
        for ep, offset in ((ep_a, 0), (ep_b, 10_000)):
            epoch = 100 + i
            state["in_call"] = True
            mux.call(ep, Heartbeat(worker_id=f"w{i}", epoch=epoch), callback_for((ep, epoch)))
            state["in_call"] = False
            expected[(ep, epoch)] = epoch + offset
    assert mux.pending() == 2 * per_server
    assert not results  # nothing ran inside call()

    # Give the replies time to arrive on the sockets: still nothing runs until the loop does.
    time.sleep(0.2)
    assert not results

    def loop_once():
        state["in_run_once"] = True
        try:
            mux.run_once(50)
        finally:
            state["in_run_once"] = False

    t0 = time.monotonic()
    for _ in range(200):
        if len(results) == len(expected) or time.monotonic() - t0 > 5:
            break
        loop_once()
    for _ in range(3):  # a few more turns: no callback may run twice
        loop_once()

    assert set(results) == set(expected)
    for key, outcomes in results.items():
        assert len(outcomes) == 1, f"{key} got {len(outcomes)} callbacks"
        (reply,) = outcomes
        assert isinstance(reply, HeartbeatReply)
        assert reply.lease_ttl_ms == expected[key]
    assert mux.pending() == 0


def test_one_socket_per_endpoint_serves_many_sequential_and_parallel_calls(serve, make_mux, tmp_path):
    ep = serve(endpoint=f"ipc://{tmp_path}/srv.sock", name="ipc-server")
    mux = make_mux(timeout_ms=3000)
    got = []
    for _ in range(20):
        mux.call(ep, Ping(), got.append)
    drive(mux, lambda: len(got) == 20)
    assert all(isinstance(p, Pong) and p.server == "ipc-server" for p in got)
    assert len(mux._peers) == 1  # one DEALER for the endpoint, however many calls


# -- remote errors -------------------------------------------------------------------------------------


def test_err_replies_arrive_as_the_named_error_class_with_remote_set(serve, make_mux):
    def source_fails(req, ctx):
        raise SourceError("lease 42 is unknown")

    def registry_fails(req, ctx):
        raise RegistryError("worker w9 is not registered")

    def crashes(req, ctx):
        raise KeyError("boom")

    ep_src = serve({"ping": source_fails}, name="src")
    ep_reg = serve({"ping": registry_fails}, name="reg")
    ep_bug = serve({"ping": crashes}, name="bug")
    mux = make_mux(timeout_ms=3000)
    got: dict[str, list] = {ep_src: [], ep_reg: [], ep_bug: []}
    for ep in got:
        mux.call(ep, Ping(), got[ep].append)
    drive(mux, lambda: all(got.values()))

    (src_err,) = got[ep_src]
    assert type(src_err) is SourceError and src_err.remote == ep_src and "lease 42" in str(src_err)
    (reg_err,) = got[ep_reg]
    assert type(reg_err) is RegistryError and reg_err.remote == ep_reg and "w9" in str(reg_err)
    (bug_err,) = got[ep_bug]
    assert type(bug_err) is RemoteError and bug_err.name == "InternalError" and bug_err.remote == ep_bug


# -- timeouts -----------------------------------------------------------------------------------------


def test_no_reply_from_an_unbound_endpoint_is_a_timeout_naming_call_and_endpoint(make_mux, tmp_path):
    ep = unbound_ipc(tmp_path)
    mux = make_mux(timeout_ms=5000)
    got = []
    t0 = time.monotonic()
    mux.call(ep, Ping(), got.append, timeout_ms=150)
    # run_once is asked to wait far longer; it must come back at the call's deadline instead.
    for _ in range(2000):
        if got or time.monotonic() - t0 > 0.15 + MARGIN_S:
            break
        mux.run_once(5000)
    elapsed = time.monotonic() - t0
    assert len(got) == 1
    err = got[0]
    assert isinstance(err, RpcTimeout)
    assert err.call == "ping" and err.endpoint == ep and err.timeout_ms == 150
    assert "calling ping" in str(err) and ep in str(err) and "150 ms" in str(err)
    assert 0.15 <= elapsed <= 0.15 + MARGIN_S
    assert mux.pending() == 0


def test_a_slow_server_times_out_the_late_reply_is_dropped_and_the_endpoint_still_works(
        serve, make_mux, releases):
    release = releases()
    entered = threading.Event()
    served = []

    def stuck_first(req, ctx):
        served.append(req.epoch)
        if req.epoch == 1:
            entered.set()
            release.wait(5)
        return HeartbeatReply(status="ok", lease_ttl_ms=req.epoch)

    # workers=1: the late reply to epoch 1 leaves the server before anything sent after it.
    ep = serve({"heartbeat": stuck_first}, workers=1)
    mux = make_mux(timeout_ms=5000)
    first, second = [], []
    t0 = time.monotonic()
    mux.call(ep, Heartbeat(worker_id="w", epoch=1), first.append, timeout_ms=200)
    elapsed = drive(mux, lambda: bool(first), budget_s=0.2 + MARGIN_S, step_ms=1000)
    assert time.monotonic() - t0 >= 0.2 and elapsed <= 0.2 + MARGIN_S
    assert entered.is_set()
    (err,) = first
    assert isinstance(err, RpcTimeout) and err.call == "heartbeat" and err.endpoint == ep

    release.set()  # the late reply to the timed-out call is now on its way
    mux.call(ep, Heartbeat(worker_id="w", epoch=2), second.append, timeout_ms=3000)
    drive(mux, lambda: bool(second))
    for _ in range(3):
        mux.run_once(20)
    assert served == [1, 2]
    assert len(first) == 1, "the late reply reached the timed-out call's callback"
    assert len(second) == 1
    assert isinstance(second[0], HeartbeatReply) and second[0].lease_ttl_ms == 2
    assert mux.pending() == 0


def test_timeouts_do_not_disturb_answered_calls_on_other_endpoints(serve, make_mux, tmp_path):
    ep = serve(name="alive")
    dead = unbound_ipc(tmp_path)
    mux = make_mux(timeout_ms=300)
    got: dict[str, list] = {ep: [], dead: []}
    for _ in range(3):
        mux.call(ep, Ping(), got[ep].append)
        mux.call(dead, Ping(), got[dead].append)
    drive(mux, lambda: len(got[ep]) == 3 and len(got[dead]) == 3, budget_s=0.3 + MARGIN_S + 1)
    assert all(isinstance(p, Pong) and p.server == "alive" for p in got[ep])
    assert all(isinstance(e, RpcTimeout) and e.endpoint == dead for e in got[dead])


# -- callbacks: failures and new calls -------------------------------------------------------------------


def test_a_callback_that_raises_is_logged_and_the_loop_goes_on(serve, make_mux, caplog):
    ep = serve(name="s")
    mux = make_mux(timeout_ms=3000)
    got = []

    def explodes(outcome):
        got.append(outcome)
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger="remote_g2.rpc"):
        for _ in range(3):
            mux.call(ep, Ping(), explodes)
        mux.call(ep, Ping(), got.append)
        drive(mux, lambda: len(got) == 4)
    assert all(isinstance(p, Pong) for p in got)
    failures = [r for r in caplog.records if "callback" in r.getMessage() and r.exc_info]
    assert len(failures) == 3
    assert all(r.exc_info[0] is RuntimeError for r in failures)
    # The mux still works afterwards.
    more = []
    mux.call(ep, Ping(), more.append)
    drive(mux, lambda: bool(more))
    assert isinstance(more[0], Pong)


def test_a_callback_may_start_new_calls(serve, make_mux):
    ep_a = serve({"heartbeat": heartbeat_echo(0)}, name="a")
    ep_b = serve({"heartbeat": heartbeat_echo(0)}, name="b")
    mux = make_mux(timeout_ms=3000)
    chain: list[tuple[str, int]] = []
    depth = {"now": 0}

    def hop(ep, n):
        def cb(reply):
            assert depth["now"] == 0, "a call's callback ran inside another callback's call()"
            depth["now"] += 1
            try:
                assert isinstance(reply, HeartbeatReply) and reply.lease_ttl_ms == n
                chain.append((ep, n))
                if n < 6:
                    nxt = ep_b if ep == ep_a else ep_a
                    mux.call(nxt, Heartbeat(worker_id="w", epoch=n + 1), hop(nxt, n + 1))
            finally:
                depth["now"] -= 1
        return cb

    mux.call(ep_a, Heartbeat(worker_id="w", epoch=1), hop(ep_a, 1))
    drive(mux, lambda: len(chain) == 6)
    assert chain == [(ep_a if n % 2 else ep_b, n) for n in range(1, 7)]
    assert mux.pending() == 0


# -- watch ---------------------------------------------------------------------------------------------


def test_watch_wakes_run_once_for_a_readable_pipe(make_mux):
    mux = make_mux()
    r, w = os.pipe()
    seen = []
    timer = threading.Timer(0.1, os.write, (w, b"x"))
    try:
        mux.watch(r, lambda: seen.append(os.read(r, 16)))
        # Nothing to read: run_once waits out its timeout and does not call the handler.
        t0 = time.monotonic()
        mux.run_once(100)
        assert not seen and time.monotonic() - t0 >= 0.09

        # A write from another thread wakes a long run_once early.
        timer.start()
        t0 = time.monotonic()
        for _ in range(5):
            if seen:
                break
            mux.run_once(3000)
        elapsed = time.monotonic() - t0
        assert seen == [b"x"]
        assert elapsed < 1.5, f"run_once woke only after {elapsed:.2f} s"

        # Drained: the handler does not run again.
        mux.run_once(50)
        assert seen == [b"x"]
    finally:
        timer.cancel()
        timer.join(2)
        os.close(r)
        os.close(w)


def test_a_watch_handler_that_raises_does_not_stop_the_loop(serve, make_mux):
    ep = serve()
    mux = make_mux(timeout_ms=3000)
    r, w = os.pipe()
    try:
        calls = []

        def bad():
            os.read(r, 16)
            calls.append(1)
            raise RuntimeError("watch bug")

        mux.watch(r, bad)
        got = []
        mux.call(ep, Ping(), got.append)
        os.write(w, b"x")
        drive(mux, lambda: bool(got) and bool(calls))
        assert calls == [1] and isinstance(got[0], Pong)
    finally:
        os.close(r)
        os.close(w)


# -- close and forget ----------------------------------------------------------------------------------


def test_close_fails_open_calls_with_rpc_closed_then_calls_fail_on_the_next_loop(
        serve, make_mux, releases, tmp_path):
    release = releases()

    def stuck(req, ctx):
        release.wait(5)
        return Pong(server="late", version="x", uptime_s=0.0)

    ep = serve({"ping": stuck}, workers=2)
    dead = unbound_ipc(tmp_path)
    mux = make_mux(timeout_ms=5000)
    got: dict[str, list] = {"a": [], "b": [], "dead": []}
    mux.call(ep, Ping(), got["a"].append)
    mux.call(ep, Ping(), got["b"].append)
    mux.call(dead, Ping(), got["dead"].append)
    mux.run_once(50)
    assert not any(got.values()) and mux.pending() == 3

    mux.close()  # runs the open calls' callbacks itself
    for key, outcomes in got.items():
        assert len(outcomes) == 1, key
        assert isinstance(outcomes[0], RpcClosed) and "calling ping" in str(outcomes[0])
    assert dead in str(got["dead"][0]) and ep in str(got["a"][0])
    assert mux.pending() == 0
    mux.close()  # idempotent, and runs nothing twice
    assert all(len(v) == 1 for v in got.values())

    # A call after close: delivered as RpcClosed by the next run_once, never inside call().
    after = []
    mux.call(ep, Ping(), after.append)
    assert after == [] and mux.pending() == 1
    t0 = time.monotonic()
    mux.run_once(2000)
    assert time.monotonic() - t0 < 1.0
    assert len(after) == 1 and isinstance(after[0], RpcClosed) and "closed" in str(after[0])
    assert mux.pending() == 0

    # The stuck server answers now: nobody hears it, nothing runs twice.
    release.set()
    mux.run_once(100)
    assert all(len(v) == 1 for v in got.values()) and len(after) == 1


def test_a_callback_run_by_close_may_call_again_and_gets_rpc_closed(make_mux, tmp_path):
    ep = unbound_ipc(tmp_path)
    mux = make_mux(timeout_ms=5000)
    got = []

    def retry(outcome):
        got.append(outcome)
        if len(got) == 1:
            mux.call(ep, Ping(), retry)

    mux.call(ep, Ping(), retry)
    mux.close()
    assert len(got) == 2 and all(isinstance(e, RpcClosed) for e in got)
    assert mux.pending() == 0


def test_forget_fails_open_calls_on_the_next_loop_and_leaves_other_endpoints_alone(
        serve, make_mux, releases):
    release = releases()
    entered = threading.Event()
    n = {"calls": 0}

    def stuck_once(req, ctx):
        n["calls"] += 1
        if n["calls"] == 1:
            entered.set()
            release.wait(5)
            return Pong(server="late", version="x", uptime_s=0.0)
        return Pong(server="fresh", version="x", uptime_s=0.0)

    ep = serve({"ping": stuck_once}, workers=2, name="forgotten")
    other_release = releases()

    def slow_other(req, ctx):
        other_release.wait(5)
        return Pong(server="other", version="x", uptime_s=0.0)

    other = serve({"ping": slow_other}, name="other")
    mux = make_mux(timeout_ms=5000)
    dropped, kept = [], []
    mux.call(ep, Ping(), dropped.append)
    mux.call(other, Ping(), kept.append)
    for _ in range(100):
        if entered.is_set():
            break
        mux.run_once(20)
    assert entered.is_set()

    mux.forget(ep)
    assert dropped == [] and mux.pending() == 2  # not run inside forget()
    mux.run_once(0)
    assert len(dropped) == 1 and isinstance(dropped[0], RpcClosed)
    assert ep in str(dropped[0]) and "calling ping" in str(dropped[0])
    assert kept == [] and mux.pending() == 1  # the other endpoint's call is still open

    mux.forget(ep)  # forgetting again, or an endpoint never used, is a no-op
    mux.forget("tcp://127.0.0.1:1")

    other_release.set()
    drive(mux, lambda: bool(kept))
    assert isinstance(kept[0], Pong) and kept[0].server == "other"

    # The forgotten endpoint can be called again (a fresh socket); the old late reply reaches nobody.
    release.set()
    again = []
    mux.call(ep, Ping(), again.append)
    drive(mux, lambda: bool(again))
    for _ in range(3):
        mux.run_once(20)
    assert len(again) == 1 and isinstance(again[0], Pong) and again[0].server == "fresh"
    assert len(dropped) == 1 and len(kept) == 1


# -- pending and next_deadline ----------------------------------------------------------------------------


def test_pending_and_next_deadline_track_open_calls(make_mux, tmp_path):
    mux = make_mux(timeout_ms=5000)
    assert mux.pending() == 0 and mux.next_deadline() is None
    ep = unbound_ipc(tmp_path)
    got = []

    t0 = time.monotonic()
    mux.call(ep, Ping(), got.append, timeout_ms=400)
    t1 = time.monotonic()
    assert mux.pending() == 1
    assert t0 + 0.4 <= mux.next_deadline() <= t1 + 0.4

    mux.call(ep, Ping(), got.append, timeout_ms=150)  # sooner: the earliest wins
    t2 = time.monotonic()
    assert mux.pending() == 2
    assert t1 + 0.15 <= mux.next_deadline() <= t2 + 0.15

    mux.call(ep, Ping(), got.append, timeout_ms=1000)  # later: the earliest is unchanged
    assert mux.pending() == 3
    assert mux.next_deadline() <= t2 + 0.15

    drive(mux, lambda: len(got) == 1, budget_s=0.15 + MARGIN_S, step_ms=1000)
    assert mux.pending() == 2
    assert t0 + 0.4 <= mux.next_deadline() <= t1 + 0.4
    assert got[0].timeout_ms == 150

    drive(mux, lambda: len(got) == 2, budget_s=0.4 + MARGIN_S, step_ms=1000)
    assert mux.pending() == 1 and got[1].timeout_ms == 400

    mux.forget(ep)
    assert mux.pending() == 1  # the RpcClosed outcome is still waiting for the loop
    mux.run_once(0)
    assert mux.pending() == 0 and len(got) == 3 and isinstance(got[2], RpcClosed)


def test_next_deadline_is_none_once_every_call_is_answered(serve, make_mux):
    ep = serve()
    mux = make_mux(timeout_ms=3000)
    got = []
    mux.call(ep, Ping(), got.append)
    drive(mux, lambda: bool(got))
    assert mux.pending() == 0
    assert mux.next_deadline() is None


def test_pending_inside_a_callback_counts_the_callbacks_still_to_run(make_mux, tmp_path):
    mux = make_mux()
    mux.close()
    seen = []
    ep = unbound_ipc(tmp_path)
    for _ in range(3):
        mux.call(ep, Ping(), lambda outcome: seen.append(mux.pending()))
    assert mux.pending() == 3
    mux.run_once(0)
    # "Calls sent whose callback has not run yet": 2, then 1, then 0.
    assert seen == [2, 1, 0]


# -- transport and protocol errors ---------------------------------------------------------------------------


def test_a_full_send_queue_is_a_transport_error_delivered_by_the_loop(make_mux, tmp_path):
    ep = unbound_ipc(tmp_path)
    mux = make_mux(timeout_ms=200, queue_depth=1)
    got: list[list] = [[] for _ in range(50)]
    for i in range(50):
        mux.call(ep, Ping(), got[i].append)
    assert not any(got)  # nothing runs inside call(), not even the refusal
    drive(mux, lambda: all(got), budget_s=0.2 + MARGIN_S + 1)
    assert all(len(g) == 1 for g in got)
    outcomes = [g[0] for g in got]
    refused = [e for e in outcomes if type(e) is TransportError]
    timed_out = [e for e in outcomes if isinstance(e, RpcTimeout)]
    assert refused, "a DEALER with queue_depth=1 and no peer accepted 50 messages"
    assert len(refused) + len(timed_out) == 50
    assert all("calling ping" in str(e) and ep in str(e) for e in refused)


@pytest.fixture
def raw_router():
    """A bare ROUTER on 127.0.0.1 that the test answers by hand."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()


def _recv_request(sock: zmq.Socket) -> tuple[bytes, int]:
    assert sock.poll(3000), "the mux's request did not arrive"
    ident, data = sock.recv_multipart()
    return ident, decode_frame(data).id


def test_a_reply_that_fails_validation_is_a_protocol_error(make_mux, raw_router):
    sock, ep = raw_router
    mux = make_mux(timeout_ms=3000)
    got = []
    mux.call(ep, Ping(), got.append)
    ident, msg_id = _recv_request(sock)
    sock.send_multipart([ident, msgpack.packb([{"v": PROTOCOL_VERSION, "id": 7, "re": msg_id}, "OK", {"server": 5}])])
    drive(mux, lambda: bool(got))
    assert len(got) == 1 and isinstance(got[0], ProtocolError)


def test_garbage_and_unknown_ids_are_dropped_and_err_without_re_settles_a_lone_call(make_mux, raw_router):
    sock, ep = raw_router
    mux = make_mux(timeout_ms=3000)
    got = []
    mux.call(ep, Ping(), got.append)
    ident, msg_id = _recv_request(sock)
    sock.send_multipart([ident, b"not msgpack"])
    sock.send_multipart([ident, encode_ok(1, msg_id + 1000, Pong(server="stray", version="x", uptime_s=0.0))])
    for _ in range(3):
        mux.run_once(50)
    assert got == [] and mux.pending() == 1  # neither one settles the open call

    sock.send_multipart([ident, encode_err(2, None, "SourceError", "could not read your id")])
    drive(mux, lambda: bool(got))
    assert len(got) == 1 and type(got[0]) is SourceError and got[0].remote == ep


def test_err_without_re_is_ignored_while_several_calls_are_open(make_mux, raw_router):
    sock, ep = raw_router
    mux = make_mux(timeout_ms=3000)
    got_a, got_b = [], []
    mux.call(ep, Ping(), got_a.append)
    mux.call(ep, Ping(), got_b.append)
    ident, id_a = _recv_request(sock)
    _, id_b = _recv_request(sock)
    sock.send_multipart([ident, encode_err(1, None, "SourceError", "whose?")])
    for _ in range(3):
        mux.run_once(50)
    assert got_a == [] and got_b == []  # ambiguous: it settles neither
    sock.send_multipart([ident, encode_ok(2, id_b, Pong(server="b", version="x", uptime_s=0.0))])
    sock.send_multipart([ident, encode_ok(3, id_a, Pong(server="a", version="x", uptime_s=0.0))])
    drive(mux, lambda: bool(got_a) and bool(got_b))
    assert got_a[0].server == "a" and got_b[0].server == "b"
