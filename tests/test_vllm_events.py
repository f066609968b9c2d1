"""vLLM KV-event ingestion, with frames encoded the way vLLM encodes them (msgspec structs), over real ZMQ sockets.

The structs below restate vLLM's ``vllm/distributed/kv_events.py`` wire types in
both packings vLLM has shipped: tagged *arrays* (``array_like=True`` on the
event classes) and tagged *maps* (newer releases, 0.32 included). The batch
itself is always ``array_like``. vLLM is not imported: it is a multi-GB
optional dependency (``tests/test_vllm_events_stock.py`` runs a real one).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from remote_g2.errors import ConfigError, ProtocolError
from remote_g2.protocol.messages import BlockEvent, Heartbeat, LayoutFingerprint, RegisterWorker
from remote_g2.registry import MemoryStore
from remote_g2.registry.metrics import RegistryMetrics
from remote_g2.registry.stores.contract import RegistryStore
from remote_g2.registry.scoring.vllm_events import (
    EVENTS_ONLY_LAYOUT,
    DecodedBatch,
    FeedState,
    Subscription,
    VllmEventSubscriber,
    decode_kv_event_batch,
    events_only_endpoint,
    parse_subscriptions,
)

# -- array-like events (as in vLLM releases with array_like=True on KVCacheEvent) --


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


# -- map-tagged events (vLLM 0.32: KVCacheEvent without array_like) --


class NewBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class NewEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class NewStored(NewEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class NewRemoved(NewEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class NewCleared(NewEvent, tag="AllBlocksCleared"):
    pass


ENC = msgspec.msgpack.Encoder()
H = [bytes([i]) * 32 for i in range(1, 9)]  # vLLM's sha256 block hashes are 32 bytes
LEASE_MS = 600  # short, so liveness tests take about a second


def old_stored(hashes, medium="CPU", parent=None):
    return OldStored(hashes, parent, list(range(16 * len(hashes))), 16, None, medium)


def new_stored(hashes, medium="CPU", parent=None):
    return NewStored(hashes, parent, list(range(16 * len(hashes))), 16, None, medium, None, group_idx=0,
                     kv_cache_spec_kind="full_attention")


# -- decoding -------------------------------------------------------------------------------------


def test_decodes_array_tagged_events():
    payload = ENC.encode(OldBatch(time.time(), [old_stored(H[:3], parent=H[7]), old_stored(H[3:4], medium="GPU"),
                                                OldRemoved([H[1]], "CPU"), OldCleared()]))
    assert decode_kv_event_batch(payload) == DecodedBatch(
        [BlockEvent("stored", H[:3], H[7]), BlockEvent("removed", [H[1]]), BlockEvent("cleared")],
        other_media=frozenset({"GPU"}))
    assert decode_kv_event_batch(payload, all_media=True).events[1] == BlockEvent("stored", H[3:4])


def test_decodes_map_tagged_events_keeping_hash_bytes_as_sent():
    odd = [b"\x01" * 16, b"\x02"]  # other hash algorithms' lengths pass through untouched
    payload = ENC.encode(NewBatch(1.0, [new_stored(H[:2] + odd, parent=H[5]), NewRemoved([H[0]], "CPU"),
                                        NewCleared()], data_parallel_rank=0))
    assert decode_kv_event_batch(payload).events == [
        BlockEvent("stored", H[:2] + odd, H[5]), BlockEvent("removed", [H[0]]), BlockEvent("cleared")]


def test_int_hashes_are_skipped_and_counted_not_converted():
    """vLLM's default int form (low 64 bits) can never equal the full hash the connector looks up."""
    payload = ENC.encode(NewBatch(1.0, [new_stored([1, 2**64 - 1]), new_stored(H[:1], parent=-1),
                                        NewRemoved([2], "CPU"), new_stored([3], medium="GPU"), new_stored(H[1:2])]))
    assert decode_kv_event_batch(payload) == DecodedBatch([BlockEvent("stored", H[1:2])], int_hash_events=3,
                                                          other_media=frozenset({"GPU"}))
    assert decode_kv_event_batch(payload, all_media=True).int_hash_events == 4


@pytest.mark.parametrize("payload", [
    b"\xc1",
    msgspec.msgpack.encode({"ts": 1}),
    msgspec.msgpack.encode([1.0, "events"]),
])
def test_malformed_batches_are_protocol_errors(payload):
    with pytest.raises(ProtocolError):
        decode_kv_event_batch(payload)


@pytest.mark.parametrize("bad", [
    ["Bogus", []],
    ["BlockStored", [b""], None, [], 16, None, "CPU"],
    ["BlockStored", [b"x" * 33], None, [], 16, None, "CPU"],
    ["BlockStored", [1, b"x" * 33], None, [], 16, None, "CPU"],
    ["BlockStored", "notalist", None, [], 16, None, "CPU"],
    ["BlockRemoved", [1.5], "CPU"],
    {"no_type": 1},
    ["BlockRemoved", [1], 7],
    {"type": "BlockStored", "block_hashes": [b"y" * 32], "parent_block_hash": None, "token_ids": [],
     "block_size": 16, "lora_id": None, "medium": "CPU", "group_idx": "zero"},
])
@pytest.mark.parametrize("engine", [False, True])
def test_a_malformed_event_is_refused_alone_and_the_rest_of_its_batch_kept(bad, engine):
    """Before, one such event made the whole batch a ProtocolError: every good event in it was lost."""
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [H[0]], None, [], 16, None, "CPU"], bad,
                                            ["BlockRemoved", [H[1]], "CPU"]]])
    batch = decode_kv_event_batch(payload, engine=engine)
    assert batch.events == [BlockEvent("stored", [H[0]]), BlockEvent("removed", [H[1]])]
    assert batch.refused == 1 and batch.refusal
    assert len(batch.engine) == (2 if engine else 0)


def test_parse_subscriptions():
    assert parse_subscriptions("tcp://127.0.0.1:5557=w1, ipc:///tmp/x=w2") == [
        Subscription("tcp://127.0.0.1:5557", "w1"), Subscription("ipc:///tmp/x", "w2")]
    assert parse_subscriptions("@tcp://127.0.0.1:5557=vllm-0=Qwen/Qwen3-0.6B,>tcp://10.0.0.2:5557=vllm-1") == [
        Subscription("tcp://127.0.0.1:5557", "vllm-0", bind=True, model="Qwen/Qwen3-0.6B"),
        Subscription("tcp://10.0.0.2:5557", "vllm-1")]
    assert parse_subscriptions("@tcp://*:0=w")[0] == Subscription("tcp://*:0", "w", bind=True)
    for bad in ("", "tcp://h:1", "h:1=w", "tcp://h:1=", "@udp://h:1=w", "tcp://h=w", "tcp://h:99999=w",
                "tcp://*:5557=w", ">tcp://h:0=w", "ipc://=w", "tcp://h:1=w x", "tcp://h:1=w=",
                "tcp://h:1=w,tcp://h:2=w", "tcp://h:1=w,@tcp://h:1=v", "tcp://h:1=" + "w" * 129):
        with pytest.raises(ConfigError, match="expected"):
            parse_subscriptions(bad)


# -- the subscriber over real sockets ------------------------------------------------------------------

FP = LayoutFingerprint(model_id="m", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=2, num_kv_heads=4, head_dim=32, tp_size=1)


class VllmLikePublisher:
    """Sends (topic, 8-byte big-endian seq, payload) like vLLM's ZmqEventPublisher (seq from 0).

    It binds (vLLM with a wildcard or ipc endpoint) unless given ``connect_to`` (vLLM with any other tcp
    endpoint).
    """

    def __init__(self, connect_to: str | None = None, seq: int = 0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.linger = 0
        if connect_to is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self.sock.connect(connect_to)
            self.endpoint = connect_to
        self.seq = seq

    def send(self, events: list[Any] | None = None, raw: bytes | None = None) -> None:
        payload = raw if raw is not None else ENC.encode(NewBatch(time.time(), events or [], data_parallel_rank=0))
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def handshake(self, sub: VllmEventSubscriber, worker_id: str = "vllm-0") -> None:
        """PUB drops messages until the subscription is through: send ignored (GPU) batches until one arrives."""
        feed = sub._feed(worker_id)
        seen = feed.last_vllm_seq
        wait_for(lambda: (self.send([new_stored(H[7:8], medium="GPU")]), feed.last_vllm_seq)[1] != seen,
                 "the subscription")

    def close(self) -> None:
        self.sock.close(0)


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def blocks_of(store: RegistryStore, worker_id: str) -> set[bytes] | None:
    """The hashes the registry holds for a live ``worker_id`` (None: not live)."""
    rec, hashes, cursor = store.scan_worker(worker_id, b"", 10_000)
    assert cursor == b""
    return None if rec is None else set(hashes)


def test_a_stock_vllm_registers_itself_with_its_blocks_under_the_exact_hashes_sent():
    store = MemoryStore(lease_ttl_ms=60_000)
    pub = VllmLikePublisher()
    sub = VllmEventSubscriber(store, [Subscription(pub.endpoint, "vllm-0", model="tiny-llama")]).start()
    try:
        # Listed as soon as its stream is up, before any block.
        wait_for(lambda: store.worker_info("vllm-0") is not None, "self-registration")
        rec = store.worker_info("vllm-0")
        assert rec.live and rec.endpoint == events_only_endpoint("vllm-0") == "events-only://vllm-0"
        assert rec.kind == "events-only" and rec.fingerprint.kv_layout == EVENTS_ONLY_LAYOUT
        assert rec.fingerprint.model_id == "tiny-llama"
        pub.handshake(sub)
        pub.send([new_stored(H[:4], parent=None)])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:4]), "the blocks")
        # Whoever asks for those exact bytes finds them; a target (always with its compat key) never picks it.
        assert store.who_has(H[:4]) == [["vllm-0"]] * 4
        assert store.lookup(H[:4]).best.worker_id == "vllm-0"
        assert store.lookup(H[:4], compat_key=FP.compat_key()).reason == "incompatible_layout"
        store.register_worker(RegisterWorker("target", "tcp://127.0.0.1:9301", FP, time.time_ns()))
        assert store.lookup(H[:4], requester="target").best is None
        pub.send([NewRemoved([H[3]], "CPU"), new_stored(H[4:6], medium="GPU")])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:3]), "the removal")
        pub.send([NewCleared(), new_stored(H[5:6])])
        wait_for(lambda: blocks_of(store, "vllm-0") == {H[5]}, "the clear")
        assert sub.state("vllm-0") is FeedState.OWN and sub.gaps == 0
    finally:
        sub.close()
        pub.close()


def test_bind_mode_the_publisher_connects_to_the_subscriber(caplog: pytest.LogCaptureFixture):
    store = MemoryStore(lease_ttl_ms=60_000)
    (spec,) = parse_subscriptions("@tcp://127.0.0.1:0=vllm-0")
    sub = VllmEventSubscriber(store, [spec]).start()
    pub = VllmLikePublisher(connect_to=sub.endpoint("vllm-0"))  # vLLM with a non-wildcard tcp endpoint
    try:
        assert sub.endpoint("vllm-0") != "tcp://127.0.0.1:0"
        with caplog.at_level(logging.INFO, logger="remote_g2.registry.vllm"):
            pub.handshake(sub)  # GPU batches: ignored without all_media, with one hint
            pub.handshake(sub)
        assert sum("--vllm-all-media" in r.getMessage() for r in caplog.records) == 1
        pub.send([new_stored(H[:3])])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:3]), "the blocks")
    finally:
        pub.close()
        sub.close()


def test_a_taken_bind_endpoint_is_a_config_error():
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="cannot bind"):
            VllmEventSubscriber(MemoryStore(), [Subscription(f"tcp://127.0.0.1:{port}", "w", bind=True)]).start()
    finally:
        taken.close(0)


def test_int_hashes_are_skipped_counted_and_warned_about_once(caplog: pytest.LogCaptureFixture):
    store = MemoryStore(lease_ttl_ms=60_000)
    metrics = RegistryMetrics()
    pub = VllmLikePublisher()
    sub = VllmEventSubscriber(store, [Subscription(pub.endpoint, "vllm-0")], metrics=metrics).start()
    try:
        pub.handshake(sub)
        with caplog.at_level(logging.WARNING, logger="remote_g2.registry.vllm"):
            pub.send([new_stored([1, 2, 3]), NewRemoved([1], "CPU")])
            pub.send([new_stored([4])])
            pub.send([new_stored(H[:2])])  # a bytes batch after them still goes in
            wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:2]), "the bytes blocks")
        assert sub.int_hash_events == 3
        assert metrics.registry.get_sample_value("remote_g2_registry_errors_total", {"kind": "vllm_int_hashes"}) == 3
        warnings = [r.getMessage() for r in caplog.records if "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0" in r.getMessage()]
        assert len(warnings) == 1 and "collide" in warnings[0], warnings
    finally:
        sub.close()
        pub.close()


def test_malformed_frames_are_counted_and_skipped():
    store = MemoryStore(lease_ttl_ms=60_000)
    metrics = RegistryMetrics()
    pub = VllmLikePublisher()
    sub = VllmEventSubscriber(store, [Subscription(pub.endpoint, "vllm-0")], metrics=metrics).start()
    try:
        pub.handshake(sub)
        pub.send(raw=b"\xc1garbage")
        pub.sock.send_multipart([b"", b"short", b""])
        pub.send(raw=msgspec.msgpack.encode([1.0, [["BlockStored", [b"x" * 40], None, [], 16, None, "CPU"],
                                                   ["BlockStored", [H[2]], None, [], 16, None, "CPU"]]]))
        pub.send([new_stored(H[:2])])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:3]), "events after garbage, and beside a bad one")
        assert sub.malformed == 2 and sub.refused == 1
        assert metrics.registry.get_sample_value("remote_g2_registry_errors_total", {"kind": "vllm_malformed"}) == 2
        assert metrics.registry.get_sample_value("remote_g2_registry_kv_events_refused_total") == 1
    finally:
        sub.close()
        pub.close()


def test_a_stock_worker_stays_while_its_stream_is_up_leaves_when_it_goes_and_comes_back(make_store):
    store = make_store(lease_ttl_ms=LEASE_MS, sweep_grace_ms=0)
    applied: list[object] = []
    sub = VllmEventSubscriber(store, [Subscription("tcp://127.0.0.1:0", "vllm-0", bind=True)],
                              on_applied=applied.append).start()
    endpoint = sub.endpoint("vllm-0")
    pub = VllmLikePublisher(connect_to=endpoint)
    try:
        pub.handshake(sub)
        pub.send([new_stored(H[:4])])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:4]), "the blocks")
        first = store.worker_info("vllm-0")
        time.sleep(3 * LEASE_MS / 1000)  # an idle stream: vLLM publishes nothing, the record stays
        assert blocks_of(store, "vllm-0") == set(H[:4])
        assert any(isinstance(r, Heartbeat) for r in applied)

        pub.close()  # vLLM exits: gone within about a lease
        t0 = time.monotonic()
        wait_for(lambda: store.worker_info("vllm-0") is None, "the worker to leave", timeout=4 * LEASE_MS / 1000)
        assert time.monotonic() - t0 < 2.5 * LEASE_MS / 1000
        assert store.lookup(H[:4]).reason == "no_candidate"
        # Its lease lapses (no heartbeat goes out without a session) or the subscriber drains the record a
        # lease after the stream fell, whichever comes first: both are right, so the test asks only "gone".

        pub = VllmLikePublisher(connect_to=endpoint, seq=pub.seq)  # the same publisher back (its seq goes on)
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:4]), "re-registration with its blocks")
        assert store.worker_info("vllm-0").epoch > first.epoch

        pub.close()
        pub = VllmLikePublisher(connect_to=endpoint)  # a restarted vLLM: seq from 0, its cache empty
        pub.handshake(sub)
        wait_for(lambda: blocks_of(store, "vllm-0") == set(), "the restart to clear its blocks")
        pub.send([new_stored(H[4:6])])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[4:6]), "the restarted vLLM's blocks")
        assert sub.restarts == 1
    finally:
        pub.close()
        sub.close()


def _zmtp_pub_that_goes_silent(endpoint: str) -> socket.socket:
    """A publisher whose host vanished: it completes the ZMTP 3.1 handshake (NULL) and then never answers."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    ready = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB"
    s.sendall(greeting + bytes([0x04, len(ready)]) + ready)
    return s


def test_zmtp_heartbeats_notice_a_publisher_that_vanished():
    store = MemoryStore(lease_ttl_ms=LEASE_MS)
    sub = VllmEventSubscriber(store, [Subscription("tcp://127.0.0.1:0", "vllm-0", bind=True)]).start()
    silent = _zmtp_pub_that_goes_silent(sub.endpoint("vllm-0"))
    try:
        wait_for(lambda: store.worker_info("vllm-0") is not None, "registration")
        # The TCP connection stays open; only the missing PONGs tell.
        wait_for(lambda: store.worker_info("vllm-0") is None, "the silent publisher to be dropped", timeout=5)
        assert not sub.stream_up("vllm-0")
    finally:
        silent.close()
        sub.close()


def test_a_worker_registered_by_its_own_source_is_followed_not_re_registered():
    store = MemoryStore(lease_ttl_ms=LEASE_MS)
    epoch = time.time_ns()
    store.register_worker(RegisterWorker("vllm-0", "tcp://127.0.0.1:9300", FP, epoch))
    pub = VllmLikePublisher()
    sub = VllmEventSubscriber(store, [Subscription(pub.endpoint, "vllm-0")]).start()

    def source_heartbeats() -> bool:  # the worker's source keeps its own lease
        assert store.heartbeat(Heartbeat("vllm-0", epoch)).status == "ok"
        return True

    try:
        pub.handshake(sub)
        pub.send([new_stored(H[:3])])
        wait_for(lambda: source_heartbeats() and blocks_of(store, "vllm-0") == set(H[:3]), "the blocks")
        assert sub.state("vllm-0") is FeedState.FOLLOWING
        pub.close()
        deadline = time.monotonic() + 3 * LEASE_MS / 1000  # its stream gone: the subscriber leaves the record be
        while time.monotonic() < deadline:
            source_heartbeats()
            time.sleep(0.05)
        rec = store.worker_info("vllm-0")
        assert (rec.endpoint, rec.epoch, rec.fingerprint, rec.blocks) == ("tcp://127.0.0.1:9300", epoch, FP, 3)
    finally:
        sub.close()
        pub.close()


def test_a_stock_record_gives_way_to_the_workers_own_registration():
    store = MemoryStore(lease_ttl_ms=60_000)
    pub = VllmLikePublisher()
    sub = VllmEventSubscriber(store, [Subscription(pub.endpoint, "vllm-0")]).start()
    try:
        pub.handshake(sub)
        pub.send([new_stored(H[:3])])
        wait_for(lambda: blocks_of(store, "vllm-0") == set(H[:3]), "the events-only record")
        store.register_worker(RegisterWorker("vllm-0", "tcp://127.0.0.1:9300", FP, time.time_ns()))
        pub.send([new_stored(H[3:4])])  # refused for the old epoch: the subscriber resyncs into the new record
        wait_for(lambda: store.lookup(H[:4], compat_key=FP.compat_key()).matched == 4, "the resync into it")
        assert store.worker_info("vllm-0").endpoint == "tcp://127.0.0.1:9300"
        assert sub.state("vllm-0") is FeedState.FOLLOWING
    finally:
        sub.close()
        pub.close()


def test_vllm_events_reach_registry_mirrors_through_the_change_feed():
    """The server publishes what its vLLM subscriber applied, as it does for RPC writes."""
    from remote_g2.registry import RegistryClient, RegistryMirror, RegistryServer

    server = RegistryServer(MemoryStore(lease_ttl_ms=60_000), bind="tcp://127.0.0.1:0",
                            feed_bind="tcp://127.0.0.1:0")
    endpoint = server.start()
    pub = VllmLikePublisher()
    sub = VllmEventSubscriber(server.store, [Subscription(pub.endpoint, "vllm-0")], on_applied=server.publish).start()
    mirror = RegistryMirror(endpoint).start()
    try:
        assert mirror.wait_ready(10), mirror.last_error
        pub.handshake(sub)
        pub.send([new_stored(H[:4])])
        wait_for(lambda: mirror.lookup(H[:4]).matched == 4, "the events-only worker on the mirror")
        with RegistryClient(endpoint) as c:
            assert c.worker_info("vllm-0").endpoint == "events-only://vllm-0"
            c.register_worker("vllm-0", "tcp://127.0.0.1:9300", FP, time.time_ns())  # its own source takes over
        pub.send([NewRemoved([H[3]], "CPU")])  # refused for the old record: resynced into the new one
        wait_for(lambda: mirror.lookup(H[:4], compat_key=FP.compat_key()).matched == 3, "the resync on the mirror")
        pub.send([new_stored(H[3:4])])  # then as events
        wait_for(lambda: mirror.lookup(H[:4]).matched == 4, "the event on the mirror")
        assert mirror.stats().resyncs == {}
    finally:
        mirror.close()
        sub.close()
        pub.close()
        server.close()
