"""The registry mirror (registry/client/mirror.py) against real registry servers and their change feeds.

Every backend (memory, a real redis-server, a real Redis Cluster) serves the
mirror; each test drives writes through a real ``RegistryClient`` and checks
that the mirror's lookups converge on the server's own answers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from remote_g2.errors import ConfigError, MirrorNotReady, RegistryError
from remote_g2.protocol.messages import BlockEvent, LayoutFingerprint
from remote_g2.registry import MemoryStore, RegistryClient, RegistryMirror, RegistryServer

FP = LayoutFingerprint(model_id="m", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=4, num_kv_heads=8, head_dim=64, tp_size=2)
OTHER_FP = LayoutFingerprint(model_id="other", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                             num_layers=4, num_kv_heads=8, head_dim=64, tp_size=2)


def chain(c: int, n: int = 24) -> list[bytes]:
    return [(c * 1000 + i).to_bytes(8, "big") for i in range(n)]


@pytest.fixture
def served(make_store) -> Iterator[Callable[..., tuple[RegistryServer, RegistryClient]]]:
    """``served(lease_ttl_ms)`` → a started server with a change feed on this backend, and a client of it."""
    started: list[tuple[RegistryServer, RegistryClient]] = []

    def start(lease_ttl_ms: int = 10_000, bind: str = "tcp://127.0.0.1:0", store=None):
        server = RegistryServer(store or make_store(lease_ttl_ms=lease_ttl_ms), bind=bind,
                                feed_bind="tcp://127.0.0.1:0")
        client = RegistryClient(server.start(), timeout_s=5.0)
        started.append((server, client))
        return server, client

    yield start
    for server, client in started:
        client.close()
        server.close()


def converged(mirror: RegistryMirror, client: RegistryClient, queries, *, timeout_s: float = 3.0) -> None:
    """Assert the mirror answers every query as the server does, within ``timeout_s`` (a feed hop of lag)."""
    deadline = time.monotonic() + timeout_s
    while True:
        diffs = []
        for q in queries:
            kw = {"requester": q[1], "want_all_holders": True} if isinstance(q, tuple) else {"want_all_holders": True}
            hashes = q[0] if isinstance(q, tuple) else q
            want = client.lookup(hashes, **kw)
            try:
                got = mirror.lookup(hashes, **kw)
            except MirrorNotReady as e:
                got = e
            # The best of a tie is round-robin on each side; compare everything else.
            if isinstance(got, Exception) or (got.reason, got.matched, got.holders) != (
                    want.reason, want.matched, want.holders):
                diffs.append((hashes[0].hex(), got, want))
        if not diffs:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"mirror did not converge: {diffs[:3]}")
        time.sleep(0.02)


def test_mirror_follows_every_kind_of_write(served):
    server, c = served()
    mirror = RegistryMirror(c.endpoint).start()
    try:
        assert mirror.wait_ready(10), mirror.last_error
        queries = [chain(k) for k in range(4)] + [(chain(0), "w1"), (chain(1), "w2")]
        c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
        c.register_worker("w2", "tcp://127.0.0.1:1200", FP, 1)
        c.register_worker("w3", "tcp://127.0.0.1:1300", OTHER_FP, 1)
        c.events("w1", 1, 1, [BlockEvent("stored", chain(0) + chain(1)[:10])])
        c.events("w2", 1, 1, [BlockEvent("stored", chain(0)[:12] + chain(1))])
        c.events("w3", 1, 1, [BlockEvent("stored", chain(2))])
        converged(mirror, c, queries)
        assert mirror.lookup(chain(0)).matched == 24
        c.events("w1", 1, 2, [BlockEvent("removed", chain(0)[5:7])])              # a hole: w1 now matches 5
        c.heartbeat("w2", 1, load=7)
        converged(mirror, c, queries)
        c.resync("w2", 1, 2, chain(3)[:4], first=True, last=False)               # w2 replaced by a snapshot
        c.resync("w2", 1, 2, chain(3)[4:], first=False, last=True)
        c.events("w2", 1, 2, [BlockEvent("stored", chain(0)[:3])])
        converged(mirror, c, queries)
        c.events("w1", 1, 3, [BlockEvent("cleared")])
        c.register_worker("w2", "tcp://127.0.0.1:1200", FP, 2)                   # new epoch: w2's blocks go
        converged(mirror, c, queries)
        c.events("w2", 2, 1, [BlockEvent("stored", chain(1))])
        c.drain_worker("w3")
        converged(mirror, c, queries)
        assert mirror.lookup(chain(2)).reason == "no_candidate"
        assert mirror.lookup(chain(1)).best.worker_id == "w2"
        stats = mirror.stats()
        assert stats.ready and stats.snapshots == 1 and stats.resyncs == {} and stats.applied >= 14
    finally:
        mirror.close()


def test_a_late_mirror_snapshots_in_chunks_then_follows(served):
    server, c = served()
    rng = random.Random(7)
    for w in range(3):
        c.register_worker(f"w{w}", f"tcp://127.0.0.1:1{w}00", FP, 1)
        c.events(f"w{w}", 1, 1, [BlockEvent("stored", [h for k in range(40) if rng.random() < 0.6
                                                        for h in chain(k)])])
    mirror = RegistryMirror(c.endpoint, scan_count=50).start()  # several chunks per worker
    try:
        assert mirror.wait_ready(10), mirror.last_error
        queries = [chain(k) for k in range(40)]
        converged(mirror, c, queries)
        assert mirror.stats().block_entries == sum(w.blocks for w in c.list_workers())
        c.events("w0", 1, 2, [BlockEvent("stored", chain(41))])
        converged(mirror, c, queries + [chain(41)])
    finally:
        mirror.close()


@pytest.mark.parametrize("make_store", ["memory"], indirect=True)
def test_writes_during_the_snapshot_are_not_lost(served):
    """Writes keep coming while the mirror scans: the replayed backlog fills in what the scan missed."""
    server, c = served()
    c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
    c.events("w1", 1, 1, [BlockEvent("stored", [h for k in range(60) for h in chain(k)])])
    mirror = RegistryMirror(c.endpoint, scan_count=40)
    seq = 2
    mirror.start()
    try:
        while not mirror.ready:  # writes interleave with the scan's chunks
            c.events("w1", 1, seq, [BlockEvent("removed", chain(seq % 60)[:2]), BlockEvent("stored", chain(100 + seq))])
            seq += 1
            assert seq < 5000, "mirror never became ready"
        converged(mirror, c, [chain(k) for k in range(60)] + [chain(100 + s) for s in range(2, seq)])
        assert seq > 3, "the test wrote nothing during the snapshot"
    finally:
        mirror.close()


def test_a_worker_whose_lease_lapses_leaves_the_mirror_without_a_frame(served):
    server, c = served(lease_ttl_ms=600)
    mirror = RegistryMirror(c.endpoint).start()
    try:
        assert mirror.wait_ready(10)
        c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
        c.events("w1", 1, 1, [BlockEvent("stored", chain(0))])
        converged(mirror, c, [chain(0)])
        assert mirror.lookup(chain(0)).reason == "ok"
        time.sleep(0.75)
        assert mirror.lookup(chain(0)).reason == "no_candidate"
        assert c.lookup(chain(0)).reason == "no_candidate"
    finally:
        mirror.close()


def _skip_a_number(feed) -> None:
    feed._seq += 1  # the frame numbered here never goes out, as PUB drops past its high-water mark


def _send_garbage(feed) -> None:
    feed._sock.send_multipart([feed.instance.encode(), b"\xc1 not msgpack"])


@pytest.mark.parametrize("make_store", ["memory"], indirect=True)
@pytest.mark.parametrize(("fault", "reason", "malformed"), [(_skip_a_number, "gap", 0),
                                                             (_send_garbage, "malformed", 1)])
def test_a_lost_or_malformed_frame_makes_the_mirror_resnapshot(served, fault, reason, malformed):
    """Fault injection through the real publisher: the mirror counts it, retakes its copy and converges."""
    server, c = served()
    mirror = RegistryMirror(c.endpoint).start()
    try:
        assert mirror.wait_ready(10)
        c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
        with server.feed._lock:
            fault(server.feed)
        c.events("w1", 1, 1, [BlockEvent("stored", chain(0))])
        converged(mirror, c, [chain(0)])
        stats = mirror.stats()
        assert stats.resyncs == {reason: 1} and stats.snapshots == 2 and stats.malformed == malformed
    finally:
        mirror.close()


@pytest.mark.parametrize("make_store", ["redis"], indirect=True)
def test_the_mirror_survives_a_server_restart(served, make_store):
    """Over Redis the state outlives the server: the mirror notices the lost feed, waits, and resnapshots."""
    store = make_store(lease_ttl_ms=30_000)
    server, c = served(store=store)
    endpoint = c.endpoint
    mirror = RegistryMirror(endpoint, stale_after_s=0.5, retry_s=0.2, timeout_s=0.5).start()
    try:
        assert mirror.wait_ready(10)
        c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
        c.events("w1", 1, 1, [BlockEvent("stored", chain(0))])
        converged(mirror, c, [chain(0)])
        c.close()
        server.close()
        time.sleep(1.0)
        with pytest.raises(MirrorNotReady):
            mirror.lookup(chain(0))
        server2 = RegistryServer(store, bind=endpoint, feed_bind="tcp://127.0.0.1:0")
        server2.start()
        try:
            c2 = RegistryClient(endpoint)
            c2.events("w1", 1, 2, [BlockEvent("stored", chain(1))])
            assert mirror.wait_ready(10), mirror.last_error
            converged(mirror, c2, [chain(0), chain(1)])
            assert mirror.stats().resyncs.get("server_lost", 0) >= 1  # the closed feed, not its silence
            c2.close()
        finally:
            server2.close()
    finally:
        mirror.close()


def test_a_mirror_without_a_server_is_not_ready_and_says_why():
    mirror = RegistryMirror("tcp://127.0.0.1:9", timeout_s=0.3, retry_s=0.1).start()
    try:
        assert not mirror.wait_ready(0.8)
        with pytest.raises(MirrorNotReady, match="RpcTimeout|no complete copy"):
            mirror.lookup(chain(0))
    finally:
        mirror.close()


def test_a_server_without_a_feed_is_refused_by_name():
    server = RegistryServer(MemoryStore(), bind="tcp://127.0.0.1:0")
    endpoint = server.start()
    try:
        assert RegistryClient(endpoint).feed_info().endpoint == ""
        mirror = RegistryMirror(endpoint, retry_s=0.1).start()
        try:
            assert not mirror.wait_ready(0.8)
            assert "publishes no change feed" in mirror.last_error
            with pytest.raises(RegistryError, match="publishes no change feed"):
                mirror.lookup(chain(0))
        finally:
            mirror.close()
    finally:
        server.close()


def test_a_bad_scan_cursor_is_an_err_and_the_server_keeps_serving(served):
    server, c = served()
    c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
    c.events("w1", 1, 1, [BlockEvent("stored", chain(0))])
    if server.store.name != "memory":  # the memory store's cursor is any hash: nothing to refuse
        with pytest.raises(RegistryError, match="cursor"):
            c.scan_worker("w1", b"not-a-cursor")
    assert set(c.scan_worker("w1").hashes) == set(chain(0))


@pytest.mark.parametrize("make_store", ["redis", pytest.param("redis-cluster", marks=pytest.mark.cluster)],
                         indirect=True)
def test_servers_answering_lookups_from_their_mirrors(make_store):
    """Two servers on one store, each following both feeds: a write through either shows in both's lookups."""
    store_a, store_b = make_store(lease_ttl_ms=10_000), make_store(lease_ttl_ms=10_000)  # one Redis, one prefix
    a = RegistryServer(store_a, bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0")
    ep_a = a.start()
    b = RegistryServer(store_b, bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0",
                       mirror_lookups=True, mirror_peers=[ep_a])
    ep_b = b.start()
    try:
        assert b.mirror is not None and b.mirror.wait_ready(10), b.mirror.last_error
        with RegistryClient(ep_a) as ca, RegistryClient(ep_b) as cb:
            ca.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
            ca.events("w1", 1, 1, [BlockEvent("stored", chain(0))])   # through the peer
            cb.register_worker("w2", "tcp://127.0.0.1:1200", FP, 1)
            cb.events("w2", 1, 1, [BlockEvent("stored", chain(0)[:9])])  # through the server itself
            deadline = time.monotonic() + 3
            while (cb.lookup(chain(0), want_all_holders=True).holders != ca.lookup(chain(0), want_all_holders=True)
                   .holders) and time.monotonic() < deadline:
                time.sleep(0.02)
            reply = cb.lookup(chain(0), want_all_holders=True)
            assert [(h.worker_id, h.matched) for h in reply.holders] == [("w1", 24), ("w2", 9)]
            assert b.metrics.mirror_lookups._value.get() >= 1
            assert a.metrics.mirror_lookups._value.get() == 0  # a answers from the store
    finally:
        b.close()
        a.close()


def test_mirror_lookups_need_a_feed():
    with pytest.raises(ConfigError, match="feed"):
        RegistryServer(MemoryStore(), bind="tcp://127.0.0.1:0", mirror_lookups=True)


@pytest.mark.parametrize("make_store", ["memory"], indirect=True)
def test_a_bug_while_following_drops_the_copy_and_the_mirror_recovers(served, monkeypatch):
    """Fault injection: applying one write raises. The copy must not stay "ready" behind a dead thread."""
    from remote_g2.registry.client.mirror import MirrorIndex

    server, c = served()
    mirror = RegistryMirror(c.endpoint, retry_s=0.05).start()
    try:
        assert mirror.wait_ready(10)
        real = MirrorIndex.replay
        calls = {"n": 0}

        def flaky(self, req):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return real(self, req)

        monkeypatch.setattr(MirrorIndex, "replay", flaky)
        c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
        c.events("w1", 1, 1, [BlockEvent("stored", chain(0))])
        converged(mirror, c, [chain(0)])
        assert calls["n"] >= 2 and mirror.stats().snapshots == 2
    finally:
        mirror.close()


def test_a_curve_registry_feeds_only_mirrors_holding_its_key(tmp_path):
    from remote_g2.rpc.curve import CurveClientConfig, CurveServerConfig, generate_keypair

    public, secret = generate_keypair(tmp_path / "keys", "registry")
    other_public, _ = generate_keypair(tmp_path / "keys", "other")
    server = RegistryServer(MemoryStore(), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0",
                            curve=CurveServerConfig.from_files(secret))
    endpoint = server.start()
    good = RegistryMirror(endpoint, curve=CurveClientConfig.for_server(str(public))).start()
    bad = RegistryMirror(endpoint, curve=CurveClientConfig.for_server(str(other_public)), timeout_s=0.3,
                         retry_s=0.1).start()
    try:
        assert good.wait_ready(10), good.last_error
        with RegistryClient(endpoint, curve=CurveClientConfig.for_server(str(public))) as c:
            c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
            c.events("w1", 1, 1, [BlockEvent("stored", chain(0))])  # arrives over the encrypted feed
            converged(good, c, [chain(0)])
        deadline = time.monotonic() + 5
        while not bad.last_error and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not bad.ready and "RpcTimeout" in bad.last_error  # a wrong key gets nothing, not even a snapshot
    finally:
        bad.close()
        good.close()
        server.close()


@pytest.mark.parametrize("make_store", ["redis"], indirect=True)
def test_a_mirroring_server_behind_an_allow_list_reads_itself_with_its_own_key(tmp_path, make_store):
    import shutil

    from remote_g2.rpc.curve import CurveClientConfig, CurveServerConfig, generate_keypair

    public, secret = generate_keypair(tmp_path / "keys", "registry")
    client_public, client_secret = generate_keypair(tmp_path / "keys", "client")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for key in (public, client_public):  # the server's own public key, as operations.md says
        shutil.copy(key, allowed / key.name)
    server = RegistryServer(make_store(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0",
                            feed_bind="tcp://127.0.0.1:0", mirror_lookups=True,
                            curve=CurveServerConfig.from_files(secret, allowed))
    endpoint = server.start()
    try:
        assert server.mirror is not None and server.mirror.wait_ready(10), server.mirror.last_error
        with RegistryClient(endpoint, curve=CurveClientConfig.for_server(str(public), str(client_secret))) as c:
            c.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
            c.events("w1", 1, 1, [BlockEvent("stored", chain(0))])
            deadline = time.monotonic() + 3
            while c.lookup(chain(0)).matched != 24 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert c.lookup(chain(0)).matched == 24 and c.stats().mirror == "ready"
            assert server.metrics.mirror_lookups._value.get() >= 1
    finally:
        server.close()


def test_a_mirror_of_one_layout_holds_only_its_workers_and_answers_its_lookups_as_the_server(served):
    """A target's mirror (``compat_key`` of its own layout) copies and follows only the workers of that layout —
    in the snapshot and in every later write, also a worker that changes layout — and answers every lookup
    of that layout as the server does."""
    server, c = served()
    c.register_worker("a1", "tcp://127.0.0.1:1100", FP, 1)
    c.register_worker("b1", "tcp://127.0.0.1:1200", OTHER_FP, 1)
    c.events("a1", 1, 1, [BlockEvent("stored", chain(0))])
    c.events("b1", 1, 1, [BlockEvent("stored", chain(1) + chain(0)[:8])])
    mirror = RegistryMirror(c.endpoint, compat_key=FP.compat_key()).start()
    try:
        assert mirror.wait_ready(10), mirror.last_error
        c.register_worker("a2", "tcp://127.0.0.1:1300", FP, 1)
        c.register_worker("b2", "tcp://127.0.0.1:1400", OTHER_FP, 1)
        c.events("a2", 1, 1, [BlockEvent("stored", chain(2))])
        c.events("b2", 1, 1, [BlockEvent("stored", chain(3))])
        c.events("b1", 1, 2, [BlockEvent("removed", chain(1)[:2])])
        c.heartbeat("b2", 1, load=3)
        fp_key = FP.compat_key()
        queries = [chain(k) for k in range(4)]

        def same_as_server() -> list[tuple[int, object, object]]:
            out = []
            for k, hashes in enumerate(queries):
                want = c.lookup(hashes, compat_key=fp_key, want_all_holders=True)
                got = mirror.lookup(hashes, compat_key=fp_key, want_all_holders=True)
                # It cannot tell "only other layouts hold these" from "nobody does": both are no reuse.
                reason = "no_candidate" if want.reason == "incompatible_layout" else want.reason
                if (got.reason, got.matched, got.holders) != (reason, want.matched, want.holders):
                    out.append((k, got, want))
            return out

        deadline = time.monotonic() + 3
        while (diffs := same_as_server()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert diffs == []
        index = mirror._index
        assert index is not None and index.counts()[:2] == (2, 2) and index.ignored == 2  # a1, a2 held
        assert index.counts()[2] == 24 + 24  # only their hashes: the other layout's 24 + 8 + 24 are not here
        c.register_worker("b2", "tcp://127.0.0.1:1400", FP, 2)  # b2 comes back with this layout: followed
        c.events("b2", 2, 1, [BlockEvent("stored", chain(3)[:5])])
        c.register_worker("a1", "tcp://127.0.0.1:1100", OTHER_FP, 2)  # a1 leaves this layout: dropped
        deadline = time.monotonic() + 3
        while (diffs := same_as_server()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert diffs == []
        assert mirror.lookup(chain(3), compat_key=fp_key).best.worker_id == "b2"
        assert mirror.lookup(chain(0), compat_key=fp_key).reason == "no_candidate"
        assert mirror.stats().resyncs == {} and mirror.stats().snapshots == 1
    finally:
        mirror.close()


def test_a_mirror_of_two_servers_follows_the_one_left_while_the_other_is_down(served, make_store):
    """Two servers on one store, the mirror following both: one goes away (its feed falls silent); the
    mirror takes a copy from the other, follows it, and takes the returning one back in."""
    store = make_store(lease_ttl_ms=30_000)
    server_a, a = served(store=store)
    server_b, b = served(store=store)
    endpoint_b = b.endpoint
    mirror = RegistryMirror([a.endpoint, endpoint_b], stale_after_s=0.5, retry_s=0.2, timeout_s=0.5).start()
    try:
        assert mirror.wait_ready(10), mirror.last_error
        a.register_worker("w1", "tcp://127.0.0.1:1100", FP, 1)
        b.register_worker("w2", "tcp://127.0.0.1:1200", FP, 1)
        a.events("w1", 1, 1, [BlockEvent("stored", chain(0))])
        b.events("w2", 1, 1, [BlockEvent("stored", chain(1))])
        converged(mirror, a, [chain(0), chain(1)])
        b.close()
        server_b.close()
        time.sleep(0.8)  # B's feed is silent past stale_after_s: the mirror drops its copy and takes one from A
        a.events("w1", 1, 2, [BlockEvent("stored", chain(2))])
        a.events("w2", 1, 2, [BlockEvent("removed", chain(1)[20:])])  # w2 writes through A from now on
        assert mirror.wait_ready(10), mirror.last_error
        converged(mirror, a, [chain(0), chain(1), chain(2)])
        server_b2 = RegistryServer(store, bind=endpoint_b, feed_bind="tcp://127.0.0.1:0")
        server_b2.start()
        try:
            deadline = time.monotonic() + 15  # asked again every 5 s; a fresh copy then follows both
            while mirror.stats().resyncs.get("server_back", 0) == 0:
                assert time.monotonic() < deadline, mirror.stats()
                time.sleep(0.05)
            b2 = RegistryClient(endpoint_b)
            b2.events("w2", 1, 3, [BlockEvent("stored", chain(3))])
            assert mirror.wait_ready(10), mirror.last_error
            converged(mirror, a, [chain(0), chain(1), chain(2), chain(3)])
            b2.close()
        finally:
            server_b2.close()
    finally:
        mirror.close()
