"""HostPool: bytes in the right place, eviction and pins, events, threads, layout extents."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import random
import threading
import time

import numpy as np
import pytest
import torch

from remote_g2.adapters.host_pool import HostPool
from remote_g2.memory.secondary_pool import SecondaryPool
from remote_g2.errors import PoolIndexError
from remote_g2.protocol.messages import BlockLayout
from remote_g2.memory.pool_index import MAX_BLOCKS


def make_layout(num_blocks: int = 8, *, layers: int = 2, kv: int = 2, heads: int = 4, tokens: int = 4,
                dim: int = 8, dtype_bytes: int = 2, order: str = "HND", pad: int = 0) -> BlockLayout:
    slab = heads * tokens * dim * dtype_bytes
    return BlockLayout(num_blocks=num_blocks, block_bytes=layers * kv * slab + pad, num_layers=layers, kv=kv,
                       num_kv_heads=heads, tokens_per_block=tokens, head_dim=dim, dtype_bytes=dtype_bytes,
                       order=order)


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def pattern(block_hash: bytes, size: int) -> bytes:
    """Bytes that only ``block_hash`` produces, ``size`` long."""
    digest = hashlib.sha256(block_hash).digest()
    return (digest * (size // len(digest) + 1))[:size]


def raw(pool: HostPool, block_id: int) -> bytes:
    """A block's bytes read through the registered region's address, as NIXL would."""
    size = pool.layout.block_bytes
    return ctypes.string_at(pool.regions()[0].base + block_id * size, size)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[bytes]]] = []

    def __call__(self, kind, hashes) -> None:
        self.events.append((kind, list(hashes)))


@pytest.fixture
def pool() -> HostPool:
    return HostPool(make_layout(4))


@pytest.fixture
def events(pool) -> Recorder:
    rec = Recorder()
    pool.add_listener(rec)
    return rec


def fill(pool: HostPool, hashes: list[bytes]) -> list[int]:
    return pool.store(hashes, [pattern(x, pool.layout.block_bytes) for x in hashes])


def state(pool: HostPool) -> tuple:
    """Everything observable about the mapping and pins."""
    n = pool.layout.num_blocks
    return (sorted(pool.block_hashes()), {x: pool.lookup(x) for x in pool.block_hashes()},
            [pool.pin_count(b) for b in range(n)], pool.stats())


# -- construction and memory ---------------------------------------------------


def test_buffer_and_region():
    layout = make_layout(5, pad=16)
    pool = HostPool(layout)
    assert isinstance(pool, SecondaryPool)
    assert pool.layout is layout
    assert pool.tensor.dtype == torch.uint8 and pool.tensor.shape == (5 * layout.block_bytes,)
    [region] = pool.regions()
    assert region.base == pool.tensor.data_ptr() and region.nbytes == 5 * layout.block_bytes
    assert region.mem_type == "DRAM"
    view = pool.block_view(3)
    assert view.data_ptr() == region.base + 3 * layout.block_bytes and view.numel() == layout.block_bytes
    with pytest.raises(IndexError):
        pool.block_view(5)
    with pytest.raises(IndexError):
        pool.block_view(-1)
    with pytest.raises(TypeError):
        pool.block_view(1.0)


def test_block_too_small_for_its_slabs():
    layout = make_layout(4)
    small = BlockLayout(**{**{f: getattr(layout, f) for f in layout.__dataclass_fields__},
                           "block_bytes": layout.block_bytes - 1})
    with pytest.raises(ValueError, match="block_bytes"):
        HostPool(small)


def test_pool_size_checked_before_allocating():
    # MAX_BLOCKS + 1 blocks of 1 MiB would be a petabyte: the index must refuse first.
    layout = make_layout(MAX_BLOCKS + 1, layers=1, kv=1, heads=1, tokens=1, dim=1, dtype_bytes=1, pad=1 << 20)
    with pytest.raises(ValueError, match="num_blocks"):
        HostPool(layout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_pin_memory_without_cuda_falls_back(caplog):
    with caplog.at_level(logging.WARNING, logger="remote_g2"):
        pool = HostPool(make_layout(2), pin_memory=True)
    assert not pool.tensor.is_pinned()
    assert "CUDA is not available" in caplog.text
    assert not HostPool(make_layout(2)).tensor.is_pinned()


def _vma_flags(addr: int, nbytes: int) -> list[dict[str, str]]:
    """The /proc/self/smaps entries of every mapping overlapping [addr, addr + nbytes)."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = {} if lo < addr + nbytes and hi > addr else None
                if cur is not None:
                    out.append(cur)
            elif cur is not None and ":" in line:
                key, _, value = line.partition(":")
                cur[key] = value.strip()
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the pool is page-locked torch memory")
def test_pool_memory_is_advised_huge_pages_unless_asked_not_to():
    from remote_g2.memory.host_memory import HUGE_PAGE_BYTES, thp_mode

    layout = make_layout(3, pad=(5 << 20) + 123)  # ~15 MiB, not a whole number of huge pages
    pool = HostPool(layout)
    [region] = pool.regions()
    assert region.base % HUGE_PAGE_BYTES == 0 and region.nbytes == 3 * layout.block_bytes
    pool.tensor[-1] = 7  # the last byte is writable, the buffer is as long as asked
    assert pool.tensor[-1].item() == 7 and pool.tensor[0].item() == 0
    small = HostPool(layout, huge_pages=False)
    if thp_mode() in ("always", "madvise"):
        assert all(v.get("THPeligible") == "1" for v in _vma_flags(region.base, region.nbytes))
    if thp_mode() == "madvise":  # only the advised pool may get huge pages
        [small_region] = small.regions()
        assert any(v.get("THPeligible") == "0" for v in _vma_flags(small_region.base, small_region.nbytes))
    ids = pool.store([b"k" * 32], [np.full(layout.block_bytes, 3, dtype=np.uint8)])
    assert bytes(pool.block_view(ids[0])[:4].numpy()) == b"\x03" * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the pool is page-locked torch memory")
def test_a_machine_with_thp_off_is_told_once(monkeypatch, caplog):
    # Stand-in: the test cannot switch the kernel's THP mode, so it makes the pool read "never".
    import remote_g2.adapters.host_pool as host_pool

    monkeypatch.setattr(host_pool, "thp_mode", lambda: "never")
    monkeypatch.setattr(host_pool, "_thp_checked", False)
    with caplog.at_level(logging.WARNING, logger="remote_g2"):
        HostPool(make_layout(2))
        HostPool(make_layout(2))
        HostPool(make_layout(2), huge_pages=False)
    said = [r for r in caplog.records if "transparent huge pages are off" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pinned_memory_with_cuda():
    assert HostPool(make_layout(2)).tensor.is_pinned()
    assert not HostPool(make_layout(2), pin_memory=False).tensor.is_pinned()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the pool is page-locked, resident already")
def test_prefault_faults_the_pool_in_landing_blocks_first(monkeypatch):
    import remote_g2.adapters.host_pool as host_pool
    from test_host_memory import resident

    layout = make_layout(6, pad=(4 << 20) - 1024)  # ~4 MiB blocks
    pool = HostPool(layout, reserved_blocks=2)
    [region] = pool.regions()
    calls: list[tuple[int, int]] = []
    real = host_pool.populate

    def spy(addr: int, nbytes: int, **kw):  # the order it asks for; the real call does the work
        calls.append((addr, nbytes))
        return real(addr, nbytes, **kw)

    monkeypatch.setattr(host_pool, "populate", spy)
    assert pool.prefault(background=False) is None
    size = layout.block_bytes
    assert calls == [(region.base + 4 * size, 2 * size), (region.base, 4 * size)]  # landing, then block 0 up
    if pool.prefaulted_bytes == 0:
        pytest.skip("this kernel does not offer MADV_POPULATE_WRITE (Linux < 5.14)")
    assert pool.prefaulted_bytes == region.nbytes
    assert resident(region.base, region.nbytes) * 4096 >= region.nbytes - 4096


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the pool is page-locked, resident already")
def test_prefault_in_the_background_beside_stores_changes_no_byte():
    layout = make_layout(64, pad=(1 << 20))
    pool = HostPool(layout, reserved_blocks=4)
    thread = pool.prefault()
    assert thread is not None and thread.name == "remote-g2-pool-prefault"
    size = layout.block_bytes
    stored = {}
    for i in range(40):  # stores racing the prefault, block 0 up as the free list hands them out
        [b] = pool.store([h(i)], [pattern(h(i), size)])
        stored[b] = pattern(h(i), size)
    thread.join(60)
    assert not thread.is_alive() and not pool.prefaulting
    for b, data in stored.items():
        assert raw(pool, b) == data


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the pool is page-locked, resident already")
def test_stop_prefault_ends_it_early():
    pool = HostPool(make_layout(64, pad=(1 << 20)))
    pool.stop_prefault()
    pool.prefault(background=False)
    assert pool.prefaulted_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_prefault_of_page_locked_memory_does_nothing():
    pool = HostPool(make_layout(2))
    assert pool.prefault() is None and pool.prefaulted_bytes == 0 and not pool.prefaulting


# -- store: bytes ----------------------------------------------------------------


def test_bytes_round_trip_every_data_kind(pool):
    size = pool.layout.block_bytes
    payloads = [pattern(h(i), size) for i in range(4)]
    data = [
        payloads[0],                                              # bytes
        bytearray(payloads[1]),                                   # bytearray
        np.frombuffer(payloads[2], dtype=np.uint16),              # numpy, 2-byte items
        torch.frombuffer(bytearray(payloads[3]), dtype=torch.float16),  # tensor, 2-byte items
    ]
    ids = pool.store([h(i) for i in range(4)], data)
    assert sorted(ids) == [0, 1, 2, 3]
    for i, b in enumerate(ids):
        assert bytes(pool.block_view(b).numpy()) == payloads[i]
        assert raw(pool, b) == payloads[i]
        assert pool.lookup(h(i)) == b


def test_non_contiguous_tensor_is_copied_in_logical_order(pool):
    size = pool.layout.block_bytes
    t = torch.arange(size, dtype=torch.uint8).reshape(2, size // 2).t()  # a transposed view
    [b] = pool.store([h(1)], [t])
    assert raw(pool, b) == bytes(t.contiguous().reshape(-1).numpy())


def test_cached_hash_keeps_its_block_and_bytes(pool, events):
    [b] = fill(pool, [h(1)])
    assert pool.store([h(1)], [b"\xff" * pool.layout.block_bytes]) == [b]
    assert raw(pool, b) == pattern(h(1), pool.layout.block_bytes)
    assert pool.store([h(1), h(2), h(1)]) == [b, pool.lookup(h(2)), b]
    assert events.events == [("stored", [h(1)]), ("stored", [h(2)])]


@pytest.mark.parametrize("data, match", [
    ([b"x"], "data\\[0\\] is 1 bytes"),
    ([b"x" * 10_000, b"y"], "2 data items for 1 hashes"),
])
def test_bad_data_changes_nothing(pool, events, data, match):
    fill(pool, [h(9)])
    before = state(pool)
    with pytest.raises(ValueError, match=match):
        pool.store([h(1)], data)
    assert state(pool) == before
    assert events.events == [("stored", [h(9)])]


@pytest.mark.parametrize("bad, exc", [("str", TypeError), (b"", ValueError), (b"x" * 33, ValueError)])
def test_bad_hash_changes_nothing(pool, events, bad, exc):
    before = state(pool)
    with pytest.raises(exc):
        pool.store([h(1), bad])
    assert state(pool) == before and events.events == []


# -- eviction and pins --------------------------------------------------------------


def test_eviction_is_lru_tail_first_and_reported(pool, events):
    fill(pool, [h(0), h(1), h(2), h(3)])       # one call: h(3) is the least recently used
    fill(pool, [h(4)])
    assert pool.lookup(h(3)) is None
    assert events.events[-2:] == [("removed", [h(3)]), ("stored", [h(4)])]
    fill(pool, [h(0)])                           # a hit refreshes h(0)
    fill(pool, [h(5), h(6)])                     # evicts h(2), h(1) (LRU first)
    assert events.events[-2:] == [("removed", [h(2), h(1)]), ("stored", [h(5), h(6)])]
    assert sorted(pool.block_hashes()) == [h(0), h(4), h(5), h(6)]
    for x in pool.block_hashes():
        assert raw(pool, pool.lookup(x)) == pattern(x, pool.layout.block_bytes)


def test_pinned_block_is_never_evicted_or_overwritten(pool, events):
    fill(pool, [h(0), h(1), h(2), h(3)])
    held = pool.find_and_pin([h(3), h(2)])       # the two least recently used
    assert len(held) == 2
    for i in range(10, 30):
        fill(pool, [h(i)])
    assert [pool.lookup(h(3)), pool.lookup(h(2))] == held
    for x, b in zip([h(3), h(2)], held):
        assert raw(pool, b) == pattern(x, pool.layout.block_bytes)
        assert pool.pin_count(b) == 1
    removed = [x for kind, xs in events.events if kind == "removed" for x in xs]
    assert h(3) not in removed and h(2) not in removed
    # The mirror built from events is exactly the pool.
    assert mirror_of(events.events) == set(pool.block_hashes())
    pool.unpin_blocks_by_id(held)                # the last unpin makes them most recently used
    fill(pool, [h(40), h(41)])
    assert [pool.lookup(h(3)), pool.lookup(h(2))] == held
    fill(pool, [h(42), h(43)])
    assert pool.lookup(h(3)) is None and pool.lookup(h(2)) is None


def mirror_of(evts) -> set[bytes]:
    mirror: set[bytes] = set()
    for kind, xs in evts:
        if kind == "stored":
            mirror |= set(xs)
        elif kind == "removed":
            mirror -= set(xs)
        else:
            mirror.clear()
    return mirror


def test_full_pinned_pool_raises_and_stays_consistent(pool, events):
    fill(pool, [h(0), h(1), h(2), h(3)])
    held = pool.find_and_pin([h(0), h(1), h(2), h(3)])
    before, seen = state(pool), list(events.events)
    with pytest.raises(PoolIndexError, match="pool is full"):
        fill(pool, [h(0), h(7)])
    assert state(pool) == before and events.events == seen
    pool.unpin_blocks_by_id(held[:1])               # one block evictable again
    assert fill(pool, [h(7)]) == held[:1]
    assert raw(pool, held[0]) == pattern(h(7), pool.layout.block_bytes)


def test_partial_store_keeps_the_hashes_before_the_failure(pool, events):
    fill(pool, [h(0), h(1), h(2), h(3)])
    held = pool.find_and_pin([h(0), h(1)])
    with pytest.raises(PoolIndexError, match="stored the first 3 of 4"):
        fill(pool, [h(1), h(10), h(11), h(12)])
    assert sorted(pool.block_hashes()) == [h(0), h(1), h(10), h(11)]
    assert events.events[-2:] == [("removed", [h(3), h(2)]), ("stored", [h(10), h(11)])]
    assert [pool.pin_count(b) for b in held] == [1, 1]          # the call's own pins are gone
    assert pool.stats()["total_pins"] == 2
    for x in (h(10), h(11)):
        assert raw(pool, pool.lookup(x)) == pattern(x, pool.layout.block_bytes)


def test_a_cached_hash_of_the_call_is_not_evicted_by_the_same_call(pool, events):
    fill(pool, [h(0), h(1), h(2), h(3)])        # h(3) is the least recently used
    ids = fill(pool, [h(3), h(10)])
    assert ids[0] != ids[1] and [pool.lookup(h(3)), pool.lookup(h(10))] == ids
    assert events.events[-2:] == [("removed", [h(2)]), ("stored", [h(10)])]
    assert raw(pool, ids[0]) == pattern(h(3), pool.layout.block_bytes)


def test_a_call_never_evicts_its_own_hashes(pool, events):
    with pytest.raises(PoolIndexError, match="stored the first 4 of 6"):
        fill(pool, [h(i) for i in range(6)])
    assert sorted(pool.block_hashes()) == [h(i) for i in range(4)]   # the chain's head is kept
    assert mirror_of(events.events) == set(pool.block_hashes())


def test_remove_skips_pinned_and_missing(pool, events):
    fill(pool, [h(0), h(1), h(2)])
    held = pool.find_and_pin([h(1)])
    assert pool.remove([h(0), h(1), h(9), h(0)]) == 1
    assert sorted(pool.block_hashes()) == [h(1), h(2)]
    assert events.events[-1] == ("removed", [h(0)])
    assert pool.remove([h(9)]) == 0 and events.events[-1] == ("removed", [h(0)])  # nothing to report
    pool.unpin_blocks_by_id(held)
    assert pool.remove([h(1)]) == 1
    # Freed blocks are reused.
    assert len(fill(pool, [h(5), h(6), h(7)])) == 3 and len(pool) == 4


def test_clear_reports_cleared_only_when_everything_went(pool, events):
    fill(pool, [h(0), h(1), h(2)])
    held = pool.find_and_pin([h(1)])
    assert pool.clear() == 2
    assert events.events[-1][0] == "removed" and sorted(events.events[-1][1]) == [h(0), h(2)]
    assert pool.block_hashes() == [h(1)]
    pool.unpin_blocks_by_id(held)
    assert pool.clear() == 1 and events.events[-1] == ("cleared", [h(1)])
    n = len(events.events)
    assert pool.clear() == 0 and len(events.events) == n    # an empty pool reports nothing
    assert len(fill(pool, [h(i) for i in range(4)])) == 4


# -- listeners ---------------------------------------------------------------------


def test_listener_sees_bytes_already_written(pool):
    seen = []

    def check(kind, hashes):
        if kind == "stored":
            for x in hashes:
                seen.append(raw(pool, pool.lookup(x)) == pattern(x, pool.layout.block_bytes))

    pool.add_listener(check)
    fill(pool, [h(i) for i in range(4)])
    fill(pool, [h(9)])
    assert seen == [True] * 5


def test_listener_may_call_back_into_the_pool(pool, events):
    def reenter(kind, hashes):
        if kind == "stored" and h(0) in hashes:
            pool.block_hashes()
            fill(pool, [h(100)])                    # a nested change, delivered after this call

    pool.add_listener(reenter)
    fill(pool, [h(0)])
    assert events.events == [("stored", [h(0)]), ("stored", [h(100)])]


def test_events_keep_their_order_across_threads(pool):
    """A store's "stored" is being delivered (slowly) when another thread removes
    the hash: the "removed" must still reach listeners after the "stored"."""
    delivering, gate = threading.Event(), threading.Event()

    def slow(kind, hashes):
        if kind == "stored":
            delivering.set()
            assert gate.wait(10)

    pool.add_listener(slow)
    events = Recorder()                             # called after the slow one
    pool.add_listener(events)
    writer = threading.Thread(target=fill, args=(pool, [h(1)]))
    writer.start()
    assert delivering.wait(10)
    assert pool.remove([h(1)]) == 1                 # returns at once; the writer's thread delivers
    gate.set()
    writer.join(10)
    assert events.events == [("stored", [h(1)]), ("removed", [h(1)])]
    assert mirror_of(events.events) == set(pool.block_hashes()) == set()


def test_failing_listener_does_not_stop_others(pool, events, caplog):
    def broken(kind, hashes):
        raise RuntimeError("boom")

    pool.add_listener(broken)
    late = Recorder()
    pool.add_listener(late)
    with caplog.at_level(logging.ERROR, logger="remote_g2"):
        assert len(fill(pool, [h(1)])) == 1
    assert "boom" in caplog.text
    assert late.events == [("stored", [h(1)])] and events.events == [("stored", [h(1)])]


# -- threads -----------------------------------------------------------------------


@pytest.mark.slow
def test_concurrent_store_pin_unpin_keeps_the_contract():
    """Writers store per-hash patterns into a small pool while readers pin
    prefixes and check, for as long as they hold the pins, that every pinned
    block still holds its hash's bytes. A mirror fed by the listener must
    equal the pool at the end (events are delivered in order)."""
    layout = make_layout(16, layers=1, kv=2, heads=2, tokens=4, dim=8, dtype_bytes=2)
    pool = HostPool(layout)
    size = layout.block_bytes
    universe = [h(i) for i in range(48)]
    payload = {x: pattern(x, size) for x in universe}
    mirror = Recorder()
    pool.add_listener(mirror)
    stop = threading.Event()
    failures: list[str] = []
    counts = {"stores": 0, "full": 0, "pinned": 0, "removes": 0}
    count_lock = threading.Lock()

    def bump(key: str, n: int = 1) -> None:
        with count_lock:
            counts[key] += n

    def guarded(fn):
        def run(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    fn(rng)
            except Exception as e:  # surface in the main thread
                failures.append(f"{fn.__name__}: {e!r}")
                stop.set()
        return run

    @guarded
    def writer(rng):
        chain = rng.sample(universe, rng.randint(1, 6))
        try:
            ids = pool.store(chain, [payload[x] for x in chain])
            assert len(ids) == len(chain)
            bump("stores")
        except PoolIndexError:
            bump("full")

    @guarded
    def reader(rng):
        ids = pool.find_and_pin(rng.sample(universe, rng.randint(1, 8)))
        if not ids:
            return
        bump("pinned", len(ids))
        snap = [raw(pool, b) for b in ids]
        for b, data in zip(ids, snap):
            owner = [x for x in universe if payload[x] == data]
            assert len(owner) == 1, f"pinned block {b} holds bytes of no hash"
            assert pool.pin_count(b) >= 1
        time.sleep(rng.random() * 0.002)              # hold the pins while writers run
        for b, data in zip(ids, snap):
            assert raw(pool, b) == data, f"pinned block {b} changed"
        pool.unpin_blocks_by_id(ids[::-1])

    @guarded
    def remover(rng):
        bump("removes", pool.remove(rng.sample(universe, 3)))
        time.sleep(0.001)

    threads = ([threading.Thread(target=writer, args=(i,)) for i in range(3)]
               + [threading.Thread(target=reader, args=(10 + i,)) for i in range(4)]
               + [threading.Thread(target=remover, args=(20,))])
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not failures, failures
    assert counts["stores"] > 100 and counts["pinned"] > 100, counts

    cached = pool.block_hashes()
    assert pool.stats()["total_pins"] == 0
    assert len(cached) == len(set(cached)) == len(pool)
    assert mirror_of(mirror.events) == set(cached)
    for x in cached:
        assert raw(pool, pool.lookup(x)) == payload[x]
    # Every block is either cached or free: the pool can be filled completely again.
    assert pool.clear() == len(cached)
    assert sorted(pool.store([h(1000 + i) for i in range(16)])) == list(range(16))


# -- layout extents against the bytes ------------------------------------------------------


@pytest.mark.parametrize("pad", [0, 24])
def test_head_extents_match_a_numpy_slice_of_the_block(pad):
    layers, kv, heads, tokens, dim = 3, 2, 4, 4, 8
    layout = make_layout(3, layers=layers, kv=kv, heads=heads, tokens=tokens, dim=dim, dtype_bytes=2, pad=pad)
    pool = HostPool(layout)
    used = layers * kv * layout.slab_bytes
    block = torch.arange(used // 2, dtype=torch.int16).to(torch.float16)   # every element distinct
    filler = torch.full((pad,), 0xEE, dtype=torch.uint8)
    data = torch.cat([block.view(torch.uint8), filler])
    pool.store([h(0), h(1)], [data, data])              # block 1 is the one we check
    b = pool.lookup(h(1))
    arr = block.numpy().reshape(layers, kv, heads, tokens, dim)            # HND
    base = pool.regions()[0].base
    for lo in range(heads):
        for hi in range(lo + 1, heads + 1):
            extents = layout.head_extents(b, lo, hi)
            if (lo, hi) == (0, heads):
                assert extents == [(b * layout.block_bytes, used)]
                assert ctypes.string_at(base + extents[0][0], used) == arr.tobytes()
                continue
            assert len(extents) == layers * kv
            for s, (off, n) in enumerate(extents):
                expect = arr[s // kv, s % kv, lo:hi].tobytes()
                assert n == len(expect)
                assert ctypes.string_at(base + off, n) == expect
            got = b"".join(ctypes.string_at(base + off, n) for off, n in extents)
            assert got == np.ascontiguousarray(arr[:, :, lo:hi]).tobytes()


def test_head_slice_needs_hnd():
    layout = make_layout(2, order="NHD")
    assert layout.head_extents(1, 0, layout.num_kv_heads) == [(layout.block_bytes,
                                                              layout.num_layers * layout.kv * layout.slab_bytes)]
    with pytest.raises(ValueError, match="HND"):
        layout.head_extents(1, 0, 1)
    with pytest.raises(ValueError):
        layout.head_extents(1, 2, 2)
