"""vLLM KV-event ingestion, with frames encoded the way vLLM encodes them (msgspec structs).

The structs below restate vLLM's ``vllm/distributed/kv_events.py`` wire types in
both packings vLLM has shipped: tagged *arrays* (``array_like=True`` on the
event classes) and tagged *maps* (newer releases). The batch itself is always
``array_like``. vLLM is not imported: it is a multi-GB optional dependency.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from remote_g2.errors import ProtocolError
from remote_g2.messages import BlockEvent, LayoutFingerprint, RegisterWorker
from remote_g2.registry import MemoryStore
from remote_g2.registry.vllm_events import (
    Subscription,
    VllmEventSubscriber,
    decode_kv_event_batch,
    parse_subscriptions,
)
from remote_g2.errors import ConfigError

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


# -- map-tagged events (newer vLLM: KVCacheEvent without array_like) --


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
    event_version: int = 1
    group_idx: int | None = None


class NewRemoved(NewEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class NewCleared(NewEvent, tag="AllBlocksCleared"):
    pass


ENC = msgspec.msgpack.Encoder()
H = [bytes([i]) * 32 for i in range(1, 9)]


def old_stored(hashes, medium="CPU", parent=None):
    return OldStored(hashes, parent, list(range(16 * len(hashes))), 16, None, medium)


def new_stored(hashes, medium="CPU", parent=None):
    return NewStored(hashes, parent, list(range(16 * len(hashes))), 16, None, medium, None, group_idx=0)


def test_decodes_array_tagged_events():
    payload = ENC.encode(OldBatch(time.time(), [old_stored(H[:3], parent=H[7]), old_stored(H[3:4], medium="GPU"),
                                                OldRemoved([H[1]], "CPU"), OldCleared()]))
    assert decode_kv_event_batch(payload) == [
        BlockEvent("stored", H[:3], H[7]), BlockEvent("removed", [H[1]]), BlockEvent("cleared")]
    assert decode_kv_event_batch(payload, all_media=True)[1] == BlockEvent("stored", H[3:4])


def test_decodes_map_tagged_events_and_int_hashes():
    payload = ENC.encode(NewBatch(1.0, [new_stored([1, 2**64 - 1, -1]), NewRemoved([2], "CPU"), NewCleared()],
                                  data_parallel_rank=0))
    stored, removed, cleared = decode_kv_event_batch(payload)
    assert stored.hashes == [(1).to_bytes(8, "big"), b"\xff" * 8, b"\xff" * 8]
    assert removed == BlockEvent("removed", [(2).to_bytes(8, "big")])
    assert cleared.kind == "cleared"


@pytest.mark.parametrize("payload", [
    b"\xc1",
    msgspec.msgpack.encode({"ts": 1}),
    msgspec.msgpack.encode([1.0, [["Bogus", []]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [b""], None, [], 16, None, "CPU"]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [b"x" * 33], None, [], 16, None, "CPU"]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", "notalist", None, [], 16, None, "CPU"]]]),
    msgspec.msgpack.encode([1.0, [["BlockRemoved", [1.5], "CPU"]]]),
    msgspec.msgpack.encode([1.0, [{"no_type": 1}]]),
    msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], 7]]]),
])
def test_malformed_batches_are_protocol_errors(payload):
    with pytest.raises(ProtocolError):
        decode_kv_event_batch(payload)


def test_parse_subscriptions():
    assert parse_subscriptions("tcp://127.0.0.1:5557=w1, ipc:///tmp/x=w2") == [
        Subscription("tcp://127.0.0.1:5557", "w1"), Subscription("ipc:///tmp/x", "w2")]
    for bad in ("", "tcp://h:1", "h:1=w", "tcp://h:1="):
        with pytest.raises(ConfigError):
            parse_subscriptions(bad)


FP = LayoutFingerprint(model_id="m", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=2, num_kv_heads=4, head_dim=32, tp_size=1)


class VllmLikePublisher:
    """Sends (topic, 8-byte big-endian seq, payload) like vLLM's ZmqEventPublisher."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def send(self, events: list[Any] | None = None, raw: bytes | None = None) -> None:
        payload = raw if raw is not None else ENC.encode(NewBatch(time.time(), events or [], data_parallel_rank=0))
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.sock.close()


def wait_for(pred, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_subscriber_tracks_a_vllm_worker_end_to_end():
    store = MemoryStore(lease_ttl_ms=60_000)
    pub = VllmLikePublisher()
    sub = VllmEventSubscriber(store, [Subscription(pub.endpoint, "vllm-0")]).start()
    try:
        # PUB/SUB drops messages until the subscription is up: handshake with ignored (GPU) batches.
        wait_for(lambda: (pub.send([new_stored(H[7:8], medium="GPU")]), sub._feeds[0].last_vllm_seq)[1] is not None,
                 "subscription")
        # Blocks stored before the worker registers are kept in the mirror...
        pub.send([new_stored(H[:4])])
        wait_for(lambda: sub.mirror("vllm-0") == set(H[:4]), "mirror")
        assert store.lookup(H[:4]).reason == "no_candidate"
        # ...and sent as a resync once it does.
        store.register_worker(RegisterWorker("vllm-0", "tcp://127.0.0.1:9300", FP, 1))
        wait_for(lambda: store.lookup(H[:4]).matched == 4, "resync after registration")
        pub.send([NewRemoved([H[3]], "CPU"), new_stored(H[4:6], medium="GPU")])
        wait_for(lambda: store.lookup(H[:4]).matched == 3, "removal")
        # Malformed frames are counted and skipped; the stream goes on.
        pub.send(raw=b"\xc1garbage")
        pub.sock.send_multipart([b"", b"short", b""])
        pub.send([new_stored(H[3:5])])
        wait_for(lambda: store.lookup(H[:6]).matched == 5, "events after garbage")
        assert sub.malformed == 2
        # A new epoch wipes the registry's copy; the subscriber resyncs from its mirror.
        store.register_worker(RegisterWorker("vllm-0", "tcp://127.0.0.1:9300", FP, 2))
        pub.send([NewCleared(), new_stored(H[:2])])
        wait_for(lambda: store.lookup(H[:6]).matched == 2, "resync after new epoch")
        assert store.worker_info("vllm-0").blocks == 2
        assert sub.gaps == 0
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
        with RegistryClient(endpoint) as c:
            c.register_worker("vllm-0", "tcp://127.0.0.1:9300", FP, 1)
        wait_for(lambda: (pub.send([new_stored(H[7:8], medium="GPU")]), sub._feeds[0].last_vllm_seq)[1] is not None,
                 "subscription")
        pub.send([new_stored(H[:4])])  # the first batch after registration arrives as a resync
        wait_for(lambda: mirror.lookup(H[:4]).matched == 4, "the resync on the mirror")
        pub.send([NewRemoved([H[3]], "CPU")])  # then as events
        wait_for(lambda: mirror.lookup(H[:4]).matched == 3, "the removal on the mirror")
        assert mirror.stats().resyncs == {}
    finally:
        mirror.close()
        sub.close()
        pub.close()
        server.close()
