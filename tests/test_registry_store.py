"""The registry store contract (registry/stores/contract.py), one suite over every backend.

``make_store`` (tests/conftest.py) yields memory, a real single-node
redis-server and a real 3-master Redis Cluster in turn.
"""

from __future__ import annotations

import random
import time

import pytest

from remote_g2.errors import StaleEpoch
from remote_g2.protocol.messages import BlockEvent, Events, Heartbeat, LayoutFingerprint, Lookup, RegisterWorker, Resync

FP = LayoutFingerprint(model_id="m", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=4, num_kv_heads=8, head_dim=64, tp_size=2)


def fp(**changes) -> LayoutFingerprint:
    fields = {f: getattr(FP, f) for f in FP.__dataclass_fields__}
    fields.update(changes)
    return LayoutFingerprint(**fields)


def h(i: int, n: int = 8) -> bytes:
    return i.to_bytes(n, "big")


CHAIN = [h(i) for i in range(1, 21)]


def register(store, wid: str, epoch: int = 1, fingerprint: LayoutFingerprint = FP, endpoint: str | None = None):
    return store.register_worker(RegisterWorker(wid, endpoint or f"tcp://127.0.0.1:1{wid[-1:] or 0}00",
                                                fingerprint, epoch))


def stored(store, wid: str, seq: int, hashes, epoch: int = 1, kind: str = "stored"):
    return store.apply_events(Events(wid, epoch, seq, [BlockEvent(kind, list(hashes))]))


@pytest.fixture
def store(make_store):
    return make_store(lease_ttl_ms=10_000)


def test_register_new_and_repeat(store):
    r = register(store, "w1")
    assert (r.next_seq, r.new_incarnation, r.lease_ttl_ms) == (1, True, 10_000)
    assert stored(store, "w1", 1, CHAIN[:3]).status == "ok"
    again = register(store, "w1")
    assert (again.next_seq, again.new_incarnation) == (2, False)
    assert store.lookup(CHAIN[:3]).matched == 3  # same epoch keeps the blocks


def test_new_epoch_drops_old_blocks_at_once(store):
    register(store, "w1", epoch=1)
    stored(store, "w1", 1, CHAIN[:5])
    r = register(store, "w1", epoch=2)
    assert (r.next_seq, r.new_incarnation) == (1, True)
    assert store.lookup(CHAIN[:5]).reason == "no_candidate"
    assert store.worker_info("w1").blocks == 0
    # Events from the old epoch are refused.
    assert stored(store, "w1", 2, CHAIN[:1], epoch=1).status == "unknown_worker"


def test_stale_or_conflicting_epoch_is_refused(store):
    register(store, "w1", epoch=5)
    with pytest.raises(StaleEpoch):
        register(store, "w1", epoch=4)
    with pytest.raises(StaleEpoch):
        register(store, "w1", epoch=5, endpoint="tcp://127.0.0.1:9")


def test_events_sequence_gap_asks_for_resync_and_applies_nothing(store):
    register(store, "w1")
    assert stored(store, "w1", 1, CHAIN[:2]).expected_seq == 2
    gap = stored(store, "w1", 3, CHAIN[2:4])
    assert (gap.status, gap.expected_seq, gap.applied) == ("resync_needed", 2, 0)
    assert store.lookup(CHAIN[:4]).matched == 2
    assert stored(store, "w1", 1, CHAIN[:2]).status == "resync_needed"  # a replay is a gap too
    assert stored(store, "nobody", 1, CHAIN[:2]).status == "unknown_worker"


def test_stored_removed_cleared(store):
    register(store, "w1")
    ev = [BlockEvent("stored", CHAIN[:6], parent=None), BlockEvent("removed", [CHAIN[3]])]
    r = store.apply_events(Events("w1", 1, 1, ev))
    assert (r.status, r.applied) == ("ok", 7)
    assert store.lookup(CHAIN[:6]).matched == 3  # the gap at index 3 ends the prefix
    assert store.who_has([CHAIN[3], CHAIN[4]]) == [[], ["w1"]]
    assert stored(store, "w1", 2, [], kind="cleared").status == "ok"
    assert store.lookup(CHAIN[:6]).reason == "no_candidate"
    assert store.worker_info("w1").blocks == 0
    assert stored(store, "w1", 3, CHAIN[:2]).applied == 2
    assert store.lookup(CHAIN[:2]).matched == 2


def test_resync_replaces_the_snapshot_in_chunks(store):
    register(store, "w1")
    stored(store, "w1", 1, CHAIN[10:15])
    assert store.resync(Resync("w1", 1, 7, CHAIN[:4], first=True, last=False)).status == "ok"
    r = store.resync(Resync("w1", 1, 7, CHAIN[4:8], first=False, last=True))
    assert (r.status, r.expected_seq, r.stored) == ("ok", 7, 8)
    assert store.who_has([CHAIN[10]]) == [[]]
    assert store.lookup(CHAIN[:8]).matched == 8
    assert stored(store, "w1", 7, CHAIN[8:9]).status == "ok"
    assert store.resync(Resync("ghost", 1, 1, CHAIN[:1], True, True)).status == "unknown_worker"


def test_lookup_longest_prefix_wins_and_reports_all_holders(store):
    for wid, n in (("w1", 3), ("w2", 7), ("w3", 5)):
        register(store, wid)
        stored(store, wid, 1, CHAIN[:n])
    r = store.lookup(CHAIN[:10], want_all_holders=True)
    assert (r.reason, r.matched, r.best.worker_id) == ("ok", 7, "w2")
    assert r.best.endpoint == "tcp://127.0.0.1:1200" and r.best.tp_size == 2
    assert [(x.worker_id, x.matched) for x in r.holders] == [("w2", 7), ("w3", 5), ("w1", 3)]
    assert store.lookup(CHAIN[:10]).holders == []  # only on request
    assert store.lookup([h(999)]).reason == "no_candidate"
    # A worker missing the *first* block is no candidate even if it holds later ones.
    register(store, "w4")
    stored(store, "w4", 1, CHAIN[1:15])
    assert store.lookup(CHAIN[:10]).best.worker_id == "w2"


def test_held_prefixes_are_what_a_lookup_of_every_holder_says(store):
    """The scoring API's question: every live holder of the first hash, of one layout, and how far it holds."""
    other = fp(dtype="fp8")
    for wid, n, layout in (("w1", 3, FP), ("w2", 9, FP), ("w3", 9, FP), ("w4", 4, other), ("w5", 6, FP)):
        register(store, wid, fingerprint=layout)
        stored(store, wid, 1, CHAIN[:n])
    register(store, "w6")
    stored(store, "w6", 1, CHAIN[1:12])  # no first block: no holder
    store.drain_worker("w5")  # gone: no holder
    key = FP.compat_key()
    want = {x.worker_id: x.matched for x in store.lookup(CHAIN[:10], compat_key=key, want_all_holders=True).holders}
    assert store.held_prefixes(CHAIN[:10], key) == want == {"w1": 3, "w2": 9, "w3": 9}
    assert store.held_prefixes(CHAIN[:10], other.compat_key()) == {"w4": 4}
    assert store.held_prefixes([h(999)], key) == {}
    # who holds a hash at all (live or not, any layout), where the store can tell without a round trip
    local = store.name == "memory"
    assert store.holds_any(CHAIN[11]) is (True if local else None)  # w6's, whose chain has no first block
    assert store.holds_any(h(999)) is (False if local else None)


def test_lookup_many_answers_each_as_lookup_would(store):
    """The batched path (one pipelined round trip on single-node Redis) gives lookup's answers, in order."""
    register(store, "w1")
    register(store, "w2", fingerprint=fp(dtype="fp8"))
    stored(store, "w1", 1, CHAIN[:6])
    stored(store, "w2", 1, CHAIN[:9])
    requests = [
        Lookup(CHAIN[:10]),
        Lookup([h(999)]),
        Lookup(CHAIN[:10], requester="w1", want_all_holders=True),
        Lookup(CHAIN[:4], compat_key=FP.compat_key()),
        Lookup(CHAIN[2:5]),
    ]
    one_by_one = [store.lookup(r.hashes, compat_key=r.compat_key, requester=r.requester,
                               want_all_holders=r.want_all_holders, tie_breaker=i) for i, r in enumerate(requests)]
    assert store.lookup_many(requests, list(range(len(requests)))) == one_by_one
    assert [r.reason for r in one_by_one] == ["ok", "no_candidate", "incompatible_layout", "ok", "ok"]
    assert [r.matched for r in one_by_one] == [9, 0, 0, 4, 3]
    assert one_by_one[3].best.worker_id == "w1"  # the compat key leaves out w2's layout


def test_lookup_ties_break_on_load_then_tie_breaker(store):
    for wid in ("w1", "w2", "w3"):
        register(store, wid)
        stored(store, wid, 1, CHAIN[:4])
    picks = {store.lookup(CHAIN[:4], tie_breaker=i).best.worker_id for i in range(3)}
    assert picks == {"w1", "w2", "w3"}  # round-robin over the tie
    assert store.lookup(CHAIN[:4], tie_breaker=4).best.worker_id == "w2"  # 4 % 3 = 1 → sorted ids
    store.heartbeat(Heartbeat("w1", 1, load=5))
    store.heartbeat(Heartbeat("w2", 1, load=5))
    assert {store.lookup(CHAIN[:4], tie_breaker=i).best.worker_id for i in range(3)} == {"w3"}


def test_requester_and_layout_filtering(store):
    register(store, "me")
    stored(store, "me", 1, CHAIN[:5])
    assert store.lookup(CHAIN[:5], requester="me").reason == "source_is_target"
    register(store, "other", fingerprint=fp(dtype="fp8"))
    stored(store, "other", 1, CHAIN[:5])
    # The requester's own fingerprint sets the compat key when none is given.
    assert store.lookup(CHAIN[:5], requester="me").reason == "incompatible_layout"
    assert store.lookup(CHAIN[:5], compat_key=FP.compat_key()).best.worker_id == "me"
    assert store.lookup(CHAIN[:5], compat_key=fp(dtype="fp8").compat_key()).best.worker_id == "other"
    # A different TP size is compatible (heterogeneous TP).
    register(store, "tp4", fingerprint=fp(tp_size=4))
    stored(store, "tp4", 1, CHAIN[:2])
    r = store.lookup(CHAIN[:5], requester="me")
    assert (r.best.worker_id, r.best.tp_size, r.matched) == ("tp4", 4, 2)


def test_heartbeat_keeps_a_worker_alive_and_lapsed_lease_hides_it(make_store):
    store = make_store(lease_ttl_ms=600)
    register(store, "w1")
    register(store, "w2")
    stored(store, "w1", 1, CHAIN[:3])
    stored(store, "w2", 1, CHAIN[:2])
    for _ in range(4):
        time.sleep(0.25)
        assert store.heartbeat(Heartbeat("w1", 1)).status == "ok"
    # w2 never heartbeated: dead at once for lookups, heartbeats and events.
    assert [x.worker_id for x in store.lookup(CHAIN[:3], want_all_holders=True).holders] == ["w1"]
    assert store.heartbeat(Heartbeat("w2", 1)).status == "unknown_worker"
    assert stored(store, "w2", 2, CHAIN[:1]).status == "unknown_worker"
    assert [w.worker_id for w in store.list_workers()] == ["w1"]
    dead = {w.worker_id: w for w in store.list_workers(include_dead=True)}
    assert not dead["w2"].live and dead["w2"].lease_expires_in_ms < 0
    assert store.who_has([CHAIN[0]]) == [["w1"]]
    assert store.who_has([CHAIN[0]], include_dead=True) == [["w1", "w2"]]
    # The sweeper removes it for good; re-registering starts afresh.
    for _ in range(50):
        store.sweep()
        if store.worker_info("w2") is None:
            break
    assert store.worker_info("w2") is None
    assert store.who_has([CHAIN[0]], include_dead=True) == [["w1"]]
    assert register(store, "w2").new_incarnation


def test_reregistering_after_lapse_starts_a_new_incarnation(make_store):
    store = make_store(lease_ttl_ms=200)
    register(store, "w1")
    stored(store, "w1", 1, CHAIN[:3])
    time.sleep(0.35)
    r = register(store, "w1")  # same epoch, but the lease lapsed: blocks may be half-swept
    assert (r.new_incarnation, r.next_seq) == (True, 1)
    assert store.lookup(CHAIN[:3]).reason == "no_candidate"


def test_a_record_keeps_the_kind_it_was_registered_with(store):
    register(store, "w1")
    store.register_worker(RegisterWorker("stock", "events-only://stock", fp(kv_layout="events-only"), 1,
                                         kind="events-only"))
    assert {w.worker_id: w.kind for w in store.list_workers()} == {"w1": None, "stock": "events-only"}
    assert store.worker_info("stock").kind == "events-only"
    with pytest.raises(StaleEpoch, match="kind"):  # the same epoch under another kind is another worker
        store.register_worker(RegisterWorker("stock", "events-only://stock", fp(kv_layout="events-only"), 1))
    assert store.register_worker(RegisterWorker("stock", "tcp://127.0.0.1:7000", FP, 2)).new_incarnation
    assert store.worker_info("stock").kind is None


def test_worker_records_and_drain(store):
    register(store, "w2", fingerprint=fp(tp_size=4))
    register(store, "w1")
    stored(store, "w1", 1, CHAIN[:4])
    rec = store.worker_info("w1")
    assert (rec.worker_id, rec.epoch, rec.tp_size, rec.blocks, rec.last_seq, rec.live) == ("w1", 1, 2, 4, 1, True)
    assert rec.fingerprint == FP and 0 < rec.lease_expires_in_ms <= 10_000
    assert [w.worker_id for w in store.list_workers()] == ["w1", "w2"]
    assert store.worker_info("nobody") is None
    d = store.drain_worker("w1")
    assert (d.existed, d.removed_blocks) == (True, 4)
    assert store.drain_worker("w1").existed is False
    assert store.worker_info("w1") is None
    assert store.lookup(CHAIN[:4]).reason == "no_candidate"
    assert store.heartbeat(Heartbeat("w1", 1)).status == "unknown_worker"
    assert register(store, "w1").new_incarnation


def test_counts(store):
    register(store, "w1")
    register(store, "w2")
    stored(store, "w1", 1, CHAIN[:4])
    stored(store, "w2", 1, CHAIN[:2])
    assert store.counts() == (2, 2, 6)


def test_long_and_odd_hashes(store):
    hashes = [b"\x00", b"\x00\x00", b"{tag}", b"\xff" * 32, b"}{", bytes(range(32))]
    register(store, "w1")
    stored(store, "w1", 1, hashes)
    assert store.lookup(hashes).matched == len(hashes)
    # b"\x00" and b"\x00\x00" are different blocks.
    assert store.lookup([b"\x00\x00\x00"]).reason == "no_candidate"
    assert store.who_has(hashes) == [["w1"]] * len(hashes)


def test_many_blocks_and_workers(store):
    chain = [h(i, 32) for i in range(2000)]
    for w in range(8):
        register(store, f"w{w}")
        store.apply_events(Events(f"w{w}", 1, 1, [BlockEvent("stored", chain[: 250 * (w + 1)])]))
    r = store.lookup(chain[:1500], want_all_holders=True)
    assert r.best.worker_id in ("w5", "w6", "w7") and r.matched == 1500
    assert [x.matched for x in r.holders] == [1500, 1500, 1500, 1250, 1000, 750, 500, 250]
    assert store.counts()[2] == sum(250 * (w + 1) for w in range(8))


def test_a_first_block_most_of_the_fleet_holds(store):
    """40 holders of the first block, two layouts, the requester among them: only the eligible are
    ranked, the longest prefix wins, load breaks the tie, and every eligible holder is reported."""
    other = fp(dtype="fp8")
    held = {}
    for w in range(40):
        wid = f"w{w:02d}"
        register(store, wid, fingerprint=other if w % 3 == 0 else FP)
        held[wid] = 1 + (w * 7) % 20  # prefix lengths 1..20, several workers each
        stored(store, wid, 1, CHAIN[:held[wid]])
    ours = {wid: n for wid, n in held.items() if int(wid[1:]) % 3 != 0 and wid != "w01"}
    top = max(ours.values())
    best = sorted(wid for wid, n in ours.items() if n == top)
    store.heartbeat(Heartbeat(best[0], 1, load=3))  # the lowest load wins among the longest
    r = store.lookup(CHAIN, requester="w01", want_all_holders=True)
    assert (r.reason, r.matched) == ("ok", top)
    assert r.best.worker_id in best[1:] or len(best) == 1
    assert [(x.worker_id, x.matched) for x in r.holders] == sorted(ours.items(), key=lambda x: (-x[1], x[0]))
    theirs = store.lookup(CHAIN, compat_key=other.compat_key())
    assert theirs.matched == max(n for wid, n in held.items() if int(wid[1:]) % 3 == 0)
    anyone = store.lookup(CHAIN)
    assert anyone.matched == max(held.values())


def test_best_holder_search_agrees_with_the_full_walk_over_holes(store):
    """The best-holder lookup (binary search on the prefix length) against the walk every holder gets
    when all are asked for: same length, and the best is among the longest, with pools full of holes."""
    rng = random.Random(5)
    for w in range(40):  # more than 32 holders of the first block: the search, not the walk of each
        register(store, f"w{w}", fingerprint=FP if w % 4 else fp(dtype="fp8"))
        keep = [x for i, x in enumerate(CHAIN) if i < rng.randint(0, 20) or rng.random() < 0.3]
        if keep:
            stored(store, f"w{w}", 1, keep)
    for trial in range(40):
        n = rng.randint(1, len(CHAIN))
        kw = rng.choice([{}, {"requester": f"w{rng.randrange(40)}"}, {"compat_key": FP.compat_key()}])
        fast = store.lookup(CHAIN[:n], tie_breaker=trial, **kw)
        full = store.lookup(CHAIN[:n], tie_breaker=trial, want_all_holders=True, **kw)
        assert (fast.reason, fast.matched) == (full.reason, full.matched), (trial, n, kw)
        if fast.reason == "ok":
            tied = {x.worker_id for x in full.holders if x.matched == full.matched}
            assert fast.best.worker_id in tied
            if len(tied) <= 16:
                assert fast.best == full.best  # same tie set, same load order, same tie breaker


def test_a_tie_among_more_holders_than_the_tie_limit(store):
    for w in range(40):  # more than 32 holders of the first block, 20 of the longest prefix
        register(store, f"w{w:02d}")
        stored(store, f"w{w:02d}", 1, CHAIN[: 20 if w % 2 else 12])
    asked = CHAIN + [h(900), h(901)]  # a request's own last blocks: nobody holds them
    picks = {store.lookup(asked, tie_breaker=t).best.worker_id for t in range(40)}
    # One node and the memory store break the tie among 16; a Cluster still walks every holder.
    assert all(int(w[1:]) % 2 for w in picks) and 1 < len(picks) <= (20 if store.name == "redis-cluster" else 16)
    assert store.lookup(asked).matched == 20
    everyone = store.lookup(asked, want_all_holders=True)
    assert [x.matched for x in everyone.holders] == [20] * 20 + [12] * 20


def _scan_all(store, wid: str, count: int, between=None):
    """Every chunk of ``scan_worker``; ``between(i)`` runs after chunk i (to change the set mid-scan)."""
    got, records, cursor, i = [], [], b"", 0
    while True:
        record, hashes, cursor = store.scan_worker(wid, cursor, count)
        records.append(record)
        got.extend(hashes)
        if not cursor:
            return got, records
        if between is not None:
            between(i)
        i += 1


def test_scan_worker_returns_every_hash_in_chunks(store):
    register(store, "w1")
    hashes = [h(i) for i in range(1, 1001)]
    stored(store, "w1", 1, hashes)
    got, records = _scan_all(store, "w1", 100)
    assert set(got) == set(hashes)
    assert len(records) > 1  # it really came in chunks
    assert all(r is not None and (r.worker_id, r.epoch, r.last_seq) == ("w1", 1, 1) for r in records)


def test_scan_worker_keeps_what_stayed_while_the_set_changes(store):
    register(store, "w1")
    stay = [h(i) for i in range(1, 601)]
    go = [h(i) for i in range(10_001, 10_301)]
    stored(store, "w1", 1, stay + go)
    seq = iter(range(2, 100))

    def churn(i: int) -> None:
        stored(store, "w1", next(seq), go[i * 30:(i + 1) * 30], kind="removed")
        stored(store, "w1", next(seq), [h(20_000 + i * 50 + k) for k in range(50)])

    got, _ = _scan_all(store, "w1", 100, churn)
    assert set(stay) <= set(got)


def test_scan_worker_of_an_unknown_or_dead_worker_is_empty(make_store):
    store = make_store(lease_ttl_ms=300)
    assert store.scan_worker("nobody", b"", 10) == (None, [], b"")
    register(store, "w1")
    stored(store, "w1", 1, CHAIN[:3])
    assert store.scan_worker("w1", b"", 10)[1]
    time.sleep(0.45)
    assert store.scan_worker("w1", b"", 10) == (None, [], b"")
