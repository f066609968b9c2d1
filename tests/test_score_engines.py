"""Scores from the engines' own tiers (KV events): stock vLLM fleets, 64-bit int hashes, a learned hash space.

Real parts: vLLM-format event batches over real ZMQ sockets into the real
subscriber, the embedded store, the scorer, HTTP. The events' hashes are what
vLLM sends: its block hash (``remote_g2.identity.vllm_hashing``, held to real vLLM's in
the vLLM suite) or, by default, its low 64 bits as an int
(``vllm.v1.core.kv_cache_utils.maybe_convert_block_hash``, restated in ``_as_int``).
"""

from __future__ import annotations

import json
import random
import urllib.request

import msgspec
import pytest
from test_vllm_events import NewBatch, NewCleared, NewRemoved, NewStored, VllmLikePublisher, blocks_of, wait_for

from remote_g2.errors import CannotScore
from remote_g2.protocol.messages import BlockEvent, Events, LayoutFingerprint, RegisterWorker
from remote_g2.registry import MemoryStore
from remote_g2.registry.scoring.engine_caches import EngineCaches, tier_of
from remote_g2.registry.metrics import RegistryMetrics
from remote_g2.registry.scoring.http_server import ScoreHttpServer
from remote_g2.registry.scoring.scorer import Scorer, ScoreRequest
from remote_g2.registry.scoring.vllm_event_decode import EngineEvent, decode_kv_event_batch
from remote_g2.registry.scoring.vllm_events import FeedState, Subscription, VllmEventSubscriber
from remote_g2.identity.vllm_hashing import DEFAULT_SEED, VllmBlockHasher, scheme_name

BS = 16


def _as_int(h: bytes) -> int:
    """vLLM's int form of a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    return int.from_bytes(h, byteorder="big") & ((1 << 64) - 1)


def _stored(tokens: list[int], hashes: list[bytes], *, ints: bool, medium: str = "GPU", parent=None, lora=None):
    sent = [_as_int(h) if ints else h for h in hashes]
    return NewStored(sent, parent, tokens, BS, lora, medium, None, group_idx=0, kv_cache_spec_kind="full_attention")


@pytest.fixture
def prompt():
    rng = random.Random(11)
    return [rng.randrange(30_000) for _ in range(40 * BS + 5)]


def test_int_hashes_decode_as_their_low_eight_bytes():
    h = VllmBlockHasher("sha256", DEFAULT_SEED, BS).hashes(list(range(BS)))[0]
    batch = decode_kv_event_batch(_encode([_stored(list(range(BS)), [h], ints=True)]), all_media=True, engine=True)
    assert batch.events == [] and batch.int_hash_events == 1  # never into the store
    assert batch.engine == [EngineEvent("stored", "GPU", [h[-8:]], None, list(range(BS)), BS, None, group=0)]
    assert decode_kv_event_batch(_encode([_stored(list(range(BS)), [h], ints=True)])).engine == []  # not asked


def _encode(events):
    return msgspec.msgpack.encode(NewBatch(1.0, events, data_parallel_rank=0))


@pytest.mark.parametrize("ints", [True, False])
@pytest.mark.parametrize("algo, seed", [("sha256", DEFAULT_SEED), ("sha256_cbor", "1234")])
def test_the_hash_space_is_learned_from_a_chains_first_block(prompt, ints, algo, seed):
    hasher = VllmBlockHasher(algo, seed, BS)
    hashes = hasher.hashes(prompt)
    caches = EngineCaches(["1234"])
    salted = hasher.hashes(prompt, cache_salt="s")  # its first block teaches nothing: the salt is not known here
    caches.apply("w", [_event(prompt[:BS * 3], salted[:3], ints)])
    assert caches.hasher("w")[0] is None and "not yet" in caches.hasher("w")[1]
    caches.apply("w", [_event(prompt[:BS * 8], hashes[:8], ints),
                       _event(prompt[BS * 8:BS * 12], hashes[8:12], ints, parent=hashes[7])])
    learned, _ = caches.hasher("w")
    assert learned is not None and learned.scheme == scheme_name(algo, seed) and learned.block_size == BS
    assert caches.matched("w", hashes) == {"g1": 12}
    caches.apply("w", [EngineEvent("removed", "GPU", [hashes[5][-8:] if ints else hashes[5]])])
    assert caches.matched("w", hashes) == {"g1": 5}
    caches.apply("w", [EngineEvent("cleared")])
    assert caches.matched("w", hashes) == {}


def _event(tokens, hashes, ints, parent=None, medium="GPU"):
    short = (lambda h: h[-8:]) if ints else (lambda h: h)
    return EngineEvent("stored", medium, [short(h) for h in hashes], None if parent is None else short(parent),
                       tokens, BS, None)


def test_an_unknown_seed_is_never_guessed(prompt):
    hashes = VllmBlockHasher("sha256", "secret", BS).hashes(prompt)
    caches = EngineCaches()
    for _ in range(300):
        caches.apply("w", [_event(prompt[:BS * 2], hashes[:2], True)])
    hasher, why = caches.hasher("w")
    assert hasher is None and "--score-hash-seed" in why


def test_tiers_and_the_cap():
    assert [tier_of(m) for m in ("GPU", "CPU", "cpu_pinned", "DISK", None)] == ["g1", "g2", "g2", "disk", "g1"]
    caches = EngineCaches(max_blocks=3)
    hs = [bytes([i]) * 32 for i in range(5)]
    caches.apply("w", [EngineEvent("stored", "GPU", hs[:2]), EngineEvent("stored", "CPU", hs[2:5])])
    assert caches.stats("w") == {"g1": 2, "g2": 1, "dropped": 2}
    assert caches.matched("w", hs) == {"g1": 2, "g2": 0}


FP = LayoutFingerprint(model_id="tiny#w-1", dtype="float32", tokens_per_block=BS, kv_layout="HND", num_layers=2,
                       num_kv_heads=2, head_dim=64, tp_size=1, hash_scheme=scheme_name("sha256", DEFAULT_SEED))


def test_a_stock_vllm_with_int_hashes_is_scored_from_its_events_and_a_sharing_one_by_tier(prompt):
    """Two engines of one model: `stock` (no connector, vLLM's default int hashes, G1 only) and `sharing`
    (remote-g2's source registered it, G2 in the store; its own KV events add its G1)."""
    store = MemoryStore(lease_ttl_ms=60_000)
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, BS).hashes(prompt)
    store.register_worker(RegisterWorker("sharing", "tcp://10.0.0.2:7000", FP, 1))
    stock_pub, sharing_pub = VllmLikePublisher(), VllmLikePublisher()
    caches = EngineCaches()
    sub = VllmEventSubscriber(store, [Subscription(stock_pub.endpoint, "stock", model="tiny"),
                                      Subscription(sharing_pub.endpoint, "sharing")], engines=caches).start()
    api = ScoreHttpServer(Scorer(store, engines=caches), "127.0.0.1:0")
    api.start()
    try:
        wait_for(lambda: store.worker_info("stock") is not None, "the stock engine's record")
        stock_pub.handshake(sub, "stock")
        sharing_pub.handshake(sub, "sharing")
        stock_pub.send([_stored(prompt[:BS * 25], hashes[:25], ints=True)])
        sharing_pub.send([_stored(prompt[:BS * 10], hashes[:10], ints=False)])
        wait_for(lambda: caches.matched("stock", hashes).get("g1") == 25
                 and caches.matched("sharing", hashes).get("g1") == 10, "the engines' events")
        wait_for(lambda: sub.state("sharing") is FeedState.FOLLOWING, "the subscriber to follow the source's record")
        seq = store.worker_info("sharing").last_seq + 1  # what its source publishes into G2
        assert store.apply_events(Events("sharing", 1, seq, [BlockEvent("stored", hashes[:30])])).status == "ok"

        body = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
        with urllib.request.urlopen(urllib.request.Request(api.url + "/v1/score", data=body), timeout=10) as r:
            doc = json.loads(r.read())
        by = {w["worker_id"]: w for w in doc["workers"]}
        assert by["sharing"]["tier"] == {"g1": 10, "g2": 30} and by["sharing"]["readable"] is True
        assert by["sharing"]["matched_tokens"] == 30 * BS and by["sharing"]["fetch_ms"] is not None
        assert by["stock"]["tier"] == {"g1": 25} and by["stock"]["readable"] is False
        assert by["stock"]["matched_tokens"] == 25 * BS and by["stock"]["fetch_ms"] is None
        assert doc["best"] == "sharing" and doc["unscored"] == []
        with urllib.request.urlopen(urllib.request.Request(api.url + "/query", data=json.dumps(
                {"model_name": "tiny", "token_ids": prompt}).encode()), timeout=10) as r:
            q = json.loads(r.read())
        assert q["instances"]["stock"] == {"longest_matched": 400, "gpu": 400, "cpu": 400, "disk": 400,
                                           "dp": {"0": 400}}
        assert q["instances"]["sharing"]["gpu"] == 160 and q["instances"]["sharing"]["cpu"] == 480
        assert q["scores"] == {"sharing": {"0": 160}, "stock": {"0": 400}}

        # a removal, then a restart of the stock vLLM (its sequence starts over): its cache is empty
        stock_pub.send([NewRemoved([_as_int(hashes[3])], "GPU")])
        wait_for(lambda: caches.matched("stock", hashes).get("g1") == 3, "the removal")
        stock_pub.seq = 0
        stock_pub.send([NewCleared()])
        wait_for(lambda: caches.matched("stock", hashes) == {}, "the restart")
    finally:
        api.close()
        sub.close()
        stock_pub.close()
        sharing_pub.close()


def test_engines_whose_hash_space_is_unknown_are_listed_as_unscored(prompt):
    store = MemoryStore(lease_ttl_ms=60_000)
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, BS).hashes(prompt)
    store.register_worker(RegisterWorker("sharing", "tcp://10.0.0.2:7000", FP, 1))
    store.apply_events(Events("sharing", 1, 1, [BlockEvent("stored", hashes[:4])]))
    events_only = LayoutFingerprint(model_id="tiny", dtype="unknown", tokens_per_block=1, kv_layout="events-only",
                                    num_layers=1, num_kv_heads=1, head_dim=1, tp_size=1)
    store.register_worker(RegisterWorker("quiet", "events-only://quiet", events_only, 1, kind="events-only"))
    reply = Scorer(store, engines=EngineCaches()).score(ScoreRequest("tiny", prompt))
    assert [w.worker_id for w in reply.workers] == ["sharing"]
    assert reply.unscored == [{"worker_id": "quiet", "reason": "scheme_not_learned",
                               "message": "this server follows no KV events of it"}]
    store.drain_worker("sharing")
    with pytest.raises(CannotScore) as e:
        Scorer(store, engines=EngineCaches()).score(ScoreRequest("tiny", prompt))
    assert e.value.reason == "unknown_scheme" and "quiet" in e.value.message


def test_block_hashes_score_an_engine_known_from_its_events(prompt):
    """Asked by block hashes, an events-only engine is matched on those hashes, learned hash space or not."""
    store = MemoryStore(lease_ttl_ms=60_000)
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, BS).hashes(prompt)
    events_only = LayoutFingerprint(model_id="tiny", dtype="unknown", tokens_per_block=1, kv_layout="events-only",
                                    num_layers=1, num_kv_heads=1, head_dim=1, tp_size=1)
    store.register_worker(RegisterWorker("stock", "events-only://stock", events_only, 1, kind="events-only"))
    caches = EngineCaches()
    caches.apply("stock", [_event(prompt[:BS * 9], hashes[:9], True)])  # a chain's start: its hash space learned
    assert caches.hasher("stock")[0] is not None
    reply = Scorer(store, engines=caches).score(ScoreRequest("tiny", block_hashes=hashes))
    (w,) = reply.workers
    assert (w.worker_id, w.tier, w.matched_tokens, w.readable) == ("stock", {"g1": 9}, 9 * BS, False)


def test_an_event_with_blocks_over_4096_tokens_costs_nothing_else_in_its_batch(prompt):
    """vLLM 0.32 accepts any block size; the chain here hashes up to 4,096 tokens a block. Before, a chain-starting
    event of 8,192-token blocks raised in EngineCaches.apply: the rest of its batch was dropped, and the batch's G2
    events went neither into the subscriber's mirror nor into the store."""
    store = MemoryStore(lease_ttl_ms=60_000)
    metrics = RegistryMetrics()
    pub = VllmLikePublisher()
    caches = EngineCaches()
    sub = VllmEventSubscriber(store, [Subscription(pub.endpoint, "vllm-0", model="tiny")], metrics=metrics,
                              engines=caches).start()
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, BS).hashes(prompt)
    g2 = [bytes([i]) * 32 for i in range(40, 43)]
    try:
        wait_for(lambda: sub.state("vllm-0") is FeedState.OWN, "the events-only record")
        pub.handshake(sub)
        huge = NewStored([b"\x09" * 32], None, list(range(8192)), 8192, None, "GPU", None, group_idx=0)
        pub.send([huge, _stored(prompt[:BS * 4], hashes[:4], ints=False), NewStored(g2, None, [], BS, None, "CPU",
                                                                                     None, group_idx=0)])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(g2), "the batch's G2 events in the store")
        assert set(g2) <= sub.mirror("vllm-0")
        assert caches.matched("vllm-0", hashes)["g1"] == 4  # the good event beside it
        assert sub.refused == 0  # nothing malformed: its blocks are only too large to hash here
        only_huge = EngineCaches()
        assert only_huge.apply("w", decode_kv_event_batch(_encode([huge]), engine=True).engine) == 0
        assert only_huge.unscorable("w") == ("block_too_large", "its blocks of 8192 tokens are over the 4096 hashed "
                                                                "here")
    finally:
        sub.close()
        pub.close()


def test_an_event_that_cannot_be_applied_is_refused_alone_and_counted():
    caches = EngineCaches()
    good = [bytes([i]) * 32 for i in range(3)]
    odd = EngineEvent("stored", "GPU", None)  # type: ignore[arg-type]  # what no decoder makes: a bug's shape
    assert caches.apply("w", [EngineEvent("stored", "GPU", good[:2]), odd, EngineEvent("stored", "GPU", good[2:])]) == 1
    assert caches.matched("w", good) == {"g1": 3}


def test_an_engine_with_several_kv_cache_groups_is_unscored_not_zero(prompt):
    """vLLM with several KV-cache groups publishes each group's blocks (their own sizes, some hashed finer than the
    block): no one chain's match says what it would reuse. Before, it was scored, and matched nothing: a silent 0."""
    store = MemoryStore(lease_ttl_ms=60_000)
    events_only = LayoutFingerprint(model_id="tiny", dtype="unknown", tokens_per_block=1, kv_layout="events-only",
                                    num_layers=1, num_kv_heads=1, head_dim=1, tp_size=1)
    store.register_worker(RegisterWorker("hybrid", "events-only://hybrid", events_only, 1, kind="events-only"))
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, BS).hashes(prompt)
    fine = VllmBlockHasher("sha256", DEFAULT_SEED, BS // 2).hashes(prompt)
    caches = EngineCaches()
    batch = decode_kv_event_batch(_encode([
        _stored(prompt[:BS * 4], hashes[:4], ints=False),  # group 0: blocks of 16, hashed per block
        NewStored(fine[1:8:2], None, prompt[:BS * 4], 2 * BS, None, "GPU", None, group_idx=1)]), engine=True)
    assert [ev.group for ev in batch.engine] == [0, 1]
    caches.apply("hybrid", batch.engine)
    for req in (ScoreRequest("tiny", prompt), ScoreRequest("tiny", block_hashes=hashes)):
        with pytest.raises(CannotScore) as e:
            Scorer(store, engines=caches).score(req)
        assert e.value.reason == "unknown_scheme" and "KV-cache groups" in e.value.message
    store.register_worker(RegisterWorker("sharing", "tcp://10.0.0.2:7000", FP, 1))
    reply = Scorer(store, engines=caches).score(ScoreRequest("tiny", prompt))
    assert [w.worker_id for w in reply.workers] == ["sharing"]
    assert [(u["worker_id"], u["reason"]) for u in reply.unscored] == [("hybrid", "kv_cache_groups")]


def test_a_sharing_worker_whose_events_name_several_groups_is_scored_by_its_g2_alone(prompt):
    store = MemoryStore(lease_ttl_ms=60_000)
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, BS).hashes(prompt)
    store.register_worker(RegisterWorker("sharing", "tcp://10.0.0.2:7000", FP, 1))
    store.apply_events(Events("sharing", 1, 1, [BlockEvent("stored", hashes[:6])]))
    caches = EngineCaches()
    caches.apply("sharing", [EngineEvent("stored", "GPU", hashes[:9], None, None, BS, None, group=0),
                             EngineEvent("stored", "GPU", [b"\x05" * 32], None, None, 2 * BS, None, group=1)])
    (w,) = Scorer(store, engines=caches).score(ScoreRequest("tiny", prompt)).workers
    assert (w.tier, w.matched_blocks) == ({"g2": 6}, 6)  # its G1 is not one chain: not guessed from
