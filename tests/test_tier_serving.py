"""The vLLM tier's holder side without vLLM: ChunkServer's validated leases over real ZMQ and a real NIXL agent.

A validated lease needs no engine step (adapters/vllm_tier/serving.py), so it runs here without vLLM: the
rows a holder stored, their generations, the release that says whether the bytes stood, who may release, and
the bound on open leases; then the chunk table readers find rows in with one-sided READs (chunk_table.py):
its slots, who is granted it, and a lookup and validation over a real NIXL agent.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("nixl", reason="needs NIXL (make venv installs it)")

from remote_g2.adapters.vllm_tier.chunk_table import (SLOT_BYTES, WAYS, ChunkTable, bucket_of, digest_of,  # noqa: E402
                                                      find_in_buckets, slot_dtype)
from remote_g2.adapters.vllm_tier.serving import ChunkServer  # noqa: E402
from remote_g2.protocol.messages import ChunkTable as ChunkTableAsk, Release, Resolve  # noqa: E402
from remote_g2.rpc.client import RpcClient  # noqa: E402

ROW = 4096
HASHES = [bytes([i + 1]) * 32 for i in range(4)]  # (none all zeros: bytes(32) is held by nobody)


@pytest.fixture
def server():
    region = np.zeros((8, ROW), np.uint8)
    s = ChunkServer("holder", region.ctypes.data, ROW, 8, bind="tcp://127.0.0.1:0", validated=True, max_leases=3)
    s.held(HASHES, [5, 1, 2, 7])
    try:
        yield s
    finally:
        s.close()


def test_an_ask_is_answered_with_the_rows_of_the_longest_held_prefix(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as c:
        reply = c.call(Resolve(HASHES[:2] + [bytes(32)] + HASHES[3:], 5000, "r"))
        assert (reply.reason, reply.matched, list(reply.ranks[0].block_ids)) == ("ok", 2, [5, 1])
        assert c.call(Release(reply.lease_id)).released
        assert not c.call(Release(reply.lease_id)).released  # (ended: unknown now)
        assert c.call(Resolve([bytes(32)], 5000, "r")).reason == "miss"
    assert server.open_leases() == 0


def test_an_eviction_while_a_lease_is_open_makes_its_release_false(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as c:
        before = c.call(Resolve(HASHES, 5000, "r"))
        other = c.call(Resolve(HASHES[2:], 5000, "r"))
        server.let_go([HASHES[1]])  # the primary evicted one chunk of the first lease only
        assert not c.call(Release(before.lease_id)).released
        assert c.call(Release(other.lease_id)).released
        assert c.call(Resolve(HASHES, 5000, "r")).matched == 1  # the prefix now ends before it
        server.held([HASHES[1]], [1])  # stored again (vLLM may reuse the same row): a new lease is good again
        again = c.call(Resolve(HASHES, 5000, "r"))
        assert again.matched == 4 and c.call(Release(again.lease_id)).released
        reset = c.call(Resolve(HASHES, 5000, "r"))
        server.let_go_all()
        assert not c.call(Release(reset.lease_id)).released
        assert c.call(Resolve(HASHES, 5000, "r")).reason == "miss"


def test_only_the_connection_that_took_a_lease_releases_it(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as mine, RpcClient(server.endpoint) as theirs:
        lease = mine.call(Resolve(HASHES, 5000, "r")).lease_id
        assert not theirs.call(Release(lease)).released
        assert mine.call(Release(lease)).released


def test_open_leases_are_bounded_and_lapse(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as c:
        leases = [c.call(Resolve(HASHES, 300, "r")) for _ in range(3)]
        assert all(r.reason == "ok" for r in leases)
        assert c.call(Resolve(HASHES, 300, "r")).reason == "miss"  # max_leases=3: a reader never releasing
        time.sleep(0.4)  # past their TTL: swept, with no step
        assert server.open_leases() == 0 and server.lapsed == 3
        assert not c.call(Release(leases[0].lease_id)).released
        assert c.call(Resolve(HASHES, 300, "r")).reason == "ok"


# -- the chunk table: one-sided lookups (adapters/vllm_tier/chunk_table.py) ---------------------------------------


def _bucket_of(table: ChunkTable, h: bytes) -> np.ndarray:
    d = digest_of(h)
    b = bucket_of(d, table.buckets)
    return table.slots[b * WAYS:(b + 1) * WAYS].copy()


def test_the_chunk_table_finds_held_chunks_and_moves_a_slot_version_on_every_change() -> None:
    table = ChunkTable(8)
    assert table.buckets * WAYS >= 16 and table.base % 4096 == 0
    table.put(HASHES[0], 5)
    (hit,) = find_in_buckets(_bucket_of(table, HASHES[0])[None], [digest_of(HASHES[0])])
    assert hit is not None and hit[1:] == (2, 5)  # (way, version 2: one write, row 5)
    table.put(HASHES[0], 5)  # stored again in the same row: readers in flight stay good
    assert find_in_buckets(_bucket_of(table, HASHES[0])[None], [digest_of(HASHES[0])]) == [hit]
    table.put(HASHES[0], 6)  # in another row now: the slot's version moves
    assert find_in_buckets(_bucket_of(table, HASHES[0])[None], [digest_of(HASHES[0])])[0][1:] == (4, 6)
    table.drop(HASHES[0])
    assert find_in_buckets(_bucket_of(table, HASHES[0])[None], [digest_of(HASHES[0])]) == [None]
    # a slot read mid-write (odd version) is absent to a reader
    table.put(HASHES[1], 1)
    torn = _bucket_of(table, HASHES[1])
    (way, _, _), = find_in_buckets(torn[None], [digest_of(HASHES[1])])
    torn["version"][way] += 1
    assert find_in_buckets(torn[None], [digest_of(HASHES[1])]) == [None]
    table.clear()
    assert len(table) == 0 and find_in_buckets(_bucket_of(table, HASHES[1])[None], [digest_of(HASHES[1])]) == [None]


def test_a_full_bucket_leaves_a_chunk_out_of_the_table_and_odd_hashes_get_a_digest() -> None:
    table = ChunkTable(0)  # two buckets of WAYS slots
    hashes = [bytes([2 * i + 2]) * 32 for i in range(WAYS + 2)]  # (all in bucket 0: the first byte is even)
    assert [table.put(h, i) for i, h in enumerate(hashes)] == [True] * WAYS + [False, False]
    assert table.overflowed == 2 and len(table) == WAYS
    assert digest_of(b"short") != digest_of(b"short!") and len(digest_of(b"short")) == 32
    assert digest_of(bytes(32)) != bytes(32)  # (all zeros marks a free slot)


def test_the_chunk_table_is_granted_only_to_a_connection_past_a_release(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as c, RpcClient(server.endpoint) as other:
        before = c.call(ChunkTableAsk("r"))
        assert (before.granted, before.reason) == (False, "no lease released yet")
        lease = c.call(Resolve(HASHES, 5000, "r"))
        assert c.call(Release(lease.lease_id)).released
        after = c.call(ChunkTableAsk("r"))
        assert after.granted and after.agent_name == lease.metadata[0].agent_name
        assert (after.base, after.buckets, after.ways, after.slot_bytes) == \
            (server.table.base, server.table.buckets, WAYS, SLOT_BYTES)
        assert not other.call(ChunkTableAsk("r")).granted  # another connection has not released one


def test_a_reader_whose_reads_need_the_holders_progress_gets_no_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # READs emulated over TCP: each needs the holder's progress (a lease)
    region = np.zeros((8, ROW), np.uint8)
    s = ChunkServer("holder-tcp", region.ctypes.data, ROW, 8, bind="tcp://127.0.0.1:0", validated=True)
    try:
        s.held(HASHES, [5, 1, 2, 7])
        with RpcClient(s.endpoint) as c:
            assert c.call(Release(c.call(Resolve(HASHES, 5000, "r")).lease_id)).released
            reply = c.call(ChunkTableAsk("r"))
            assert (reply.granted, reply.reason) == (False, "reads need the holder's progress")
    finally:
        s.close()


def test_a_reader_finds_and_validates_rows_with_one_sided_nixl_reads() -> None:
    """Over a real NIXL agent: READ a chunk's bucket, find its row, READ the row, READ the slot again; an eviction
    in between moves the slot's version (the reader drops what it read)."""
    from remote_g2.adapters.nixl_transfer import NixlTransfer
    from remote_g2.memory.secondary_pool import MemoryRegion

    src = np.random.default_rng(3).integers(0, 256, (8, ROW), dtype=np.uint8)
    s = ChunkServer("holder-1s", src.ctypes.data, ROW, 8, bind="tcp://127.0.0.1:0", validated=True)
    dst = np.zeros(ROW + 4096, np.uint8)
    reader = NixlTransfer("tier-table-reader")
    try:
        reader.register_local([MemoryRegion(dst.ctypes.data, dst.nbytes)])
        s.held(HASHES, [5, 1, 2, 7])
        with RpcClient(s.endpoint) as c:
            lease = c.call(Resolve(HASHES, 5000, "r"))
            agent = lease.metadata[0].agent_name
            reader.add_peer(agent, lease.metadata[0].agent_metadata)
            c.call(Release(lease.lease_id))
            table = c.call(ChunkTableAsk("r"))
        assert table.granted

        def read(local: int, remote: int, n: int) -> None:
            h = reader.start_read(agent, np.asarray([local], np.uint64), np.asarray([remote], np.uint64),
                                  np.asarray([n], np.uint64), not_after=time.monotonic() + 10)
            deadline = time.monotonic() + 10
            while reader.poll(h) == "pending" and time.monotonic() < deadline:
                time.sleep(0.001)
            assert reader.poll(h) == "done", reader.failure(h)
            reader.release(h)

        d = digest_of(HASHES[3])
        first = bucket_of(d, table.buckets) * table.ways
        scratch = dst.ctypes.data + ROW
        read(scratch, table.base + first * SLOT_BYTES, table.ways * SLOT_BYTES)
        bucket = dst[ROW:ROW + table.ways * SLOT_BYTES].view(slot_dtype)
        (hit,) = find_in_buckets(bucket[None], [d])
        assert hit is not None and hit[2] == 7
        read(dst.ctypes.data, lease.metadata[0].pool_base + hit[2] * ROW, ROW)
        assert np.array_equal(dst[:ROW], src[7])
        slot_at = table.base + (first + hit[0]) * SLOT_BYTES
        read(scratch, slot_at, SLOT_BYTES)
        assert int(dst[ROW:ROW + SLOT_BYTES].view(slot_dtype)[0]["version"]) == hit[1]  # unchanged: the bytes stand
        s.let_go([HASHES[3]])
        read(scratch, slot_at, SLOT_BYTES)
        assert int(dst[ROW:ROW + SLOT_BYTES].view(slot_dtype)[0]["version"]) != hit[1]  # evicted: they do not
    finally:
        reader.close()
        s.close()
