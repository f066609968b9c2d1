"""Multi-thread stress of the C++ PoolIndex (about 5 s in all).

Inserters, pinners, evictors, removers and a checker hammer a small pool
(256 blocks, 64 hashes) so that every call contends with the others. Some
calls are long (1024+ items) so that they hold the index's mutex with the GIL
released, and the short calls of other threads really wait on that mutex.

How the pin checks stay sound while everything races: each thread records a
pin in the shared ``Held`` book (under ``Held.lock``) only *after* the index
returned it, and erases it *before* unpinning. So whoever holds ``Held.lock``
knows that every recorded pin is real at that moment. Evictors, removers and
inserters make their call while holding ``Held.lock`` and check the result
against the book: a recorded block must never come back from ``evict``, be
removed, or be overwritten. The book may miss pins that were just taken,
which only makes the check partial, never wrong.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

from remote_g2.errors import BlockPinnedError
from remote_g2.memory.pool_index import PoolIndex

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
HASHES = [i.to_bytes(8, "big") for i in range(64)]
HASH_SET = set(HASHES)
DURATION_S = 4.0


class Held:
    """The book of recorded pins: block → count, and the hash each pinned
    block holds (which cannot change while it is pinned)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: Counter[int] = Counter()
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    def record(self, ids: list[int], hashes: list[bytes]) -> None:
        with self.lock:
            for b, x in zip(ids, hashes):
                if self.count[b] == 0:
                    self.hash_of[b] = x
                    self.block_of[x] = b
                assert self.hash_of[b] == x, "a pinned block holds two hashes"
                self.count[b] += 1

    def erase(self, ids: list[int]) -> None:
        with self.lock:
            for b in ids:
                self.count[b] -= 1
                assert self.count[b] >= 0
                if self.count[b] == 0:
                    del self.count[b]
                    del self.block_of[self.hash_of.pop(b)]


class Worker(threading.Thread):
    """Runs `step` until stopped; keeps the first exception for the test."""

    def __init__(self, name, step, stop: threading.Event, seed: int) -> None:
        super().__init__(name=name, daemon=True)
        self.step, self.stop, self.rng = step, stop, random.Random(seed)
        self.error: BaseException | None = None
        self.tally: Counter[str] = Counter()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.step(self)
        except BaseException as e:  # reported by the test thread
            self.error = e


def test_concurrent_callers_keep_every_invariant():
    index = PoolIndex(NUM_BLOCKS)
    held = Held()
    stop = threading.Event()
    leases: dict[str, list[tuple[list[int], list[bytes], bool]]] = {}

    def inserter(w: Worker) -> None:
        if w.rng.random() < 0.2:  # a small batch through insert_packed
            pairs = [(w.rng.choice(HASHES), w.rng.randrange(NUM_BLOCKS)) for _ in range(3)]
        else:
            pairs = [(w.rng.choice(HASHES), w.rng.randrange(NUM_BLOCKS))]
        with held.lock:
            must_fail = any(held.count[b] or held.block_of.get(x, b) != b for x, b in pairs)
            try:
                if len(pairs) == 1:
                    index.insert(*pairs[0])
                else:
                    index.insert_packed(b"".join(x for x, _ in pairs),
                                        np.array([b for _, b in pairs]), 8)
                ok = True
            except BlockPinnedError:
                ok = False
        assert not (must_fail and ok), f"insert over a pinned block succeeded: {pairs}"
        w.tally["inserts"] += len(pairs) if ok else 0
        w.tally["inserts_refused"] += not ok

    def bulk_inserter(w: Worker) -> None:
        # 1024+ pairs: runs with the GIL released. Picks blocks and hashes the
        # book does not hold, so it may succeed; a refusal is allowed (pins not
        # yet recorded) but must change nothing, which the final totals check.
        with held.lock:
            blocks = [b for b in range(NUM_BLOCKS) if b not in held.count]
            hashes = [x for x in HASHES if x not in held.block_of]
            if blocks and hashes:
                pairs = [(w.rng.choice(hashes), w.rng.choice(blocks)) for _ in range(1100)]
                try:
                    index.insert_packed(b"".join(x for x, _ in pairs),
                                        np.array([b for _, b in pairs], dtype=np.int64), 8)
                    w.tally["inserts"] += len(pairs)
                except BlockPinnedError:
                    pass
        time.sleep(0.002)

    def release(w: Worker, lease) -> None:
        ids, hashes, packed = lease
        for x, b in zip(hashes, ids):  # still frozen while we hold the pin
            assert index.lookup(x) == b, "a pinned block changed its hash"
        held.erase(ids)
        if packed:
            index.unpin_packed(np.array(ids, dtype=np.int32))
        else:
            index.unpin_blocks_by_id(ids)

    def pinner(w: Worker) -> None:
        mine = leases.setdefault(w.name, [])
        if len(mine) >= 4 or (mine and w.rng.random() < 0.5):
            release(w, mine.pop(w.rng.randrange(len(mine))))
            return
        start = w.rng.randrange(len(HASHES))
        prefix = HASHES[start:start + w.rng.randint(1, 8)]
        if w.rng.random() < 0.05:
            # Long enough (>= 1024 hashes) that the call releases the GIL
            # while it holds the index's mutex: the others then contend on it.
            prefix = (prefix * (1100 // len(prefix) + 1))[:1100]
        packed = w.rng.random() < 0.5
        if packed:
            ids = index.find_and_pin_packed(b"".join(prefix), 8).tolist()
        else:
            ids = index.find_and_pin(prefix)
        assert len(ids) <= len(prefix)
        # The blocks returned are the ones holding those hashes, and stay so.
        for x, b in zip(prefix, ids):
            assert index.lookup(x) == b, "find_and_pin returned a block not holding the hash"
            assert index.pin_count(b) >= 1
        held.record(ids, prefix[:len(ids)])
        mine.append((ids, prefix[:len(ids)], packed))
        w.tally["hits"] += len(ids)
        w.tally["misses"] += len(ids) < len(prefix)

    def id_pinner(w: Worker) -> None:
        x = w.rng.choice(HASHES)
        b = index.lookup(x)
        if b is None:
            return
        try:
            index.pin_blocks_by_id([b])
        except ValueError:  # freed between lookup and pin: allowed
            return
        if index.lookup(x) == b:  # pinned while still holding x: now frozen
            held.record([b], [x])
            time.sleep(0)
            assert index.lookup(x) == b
            held.erase([b])
        index.unpin_blocks_by_id([b])

    def evictor(w: Worker) -> None:
        with held.lock:
            out = index.evict(w.rng.randint(1, 4))
            for x, b in out:
                assert b not in held.count, f"evicted pinned block {b}"
                assert x not in held.block_of
        assert all(x in HASH_SET and 0 <= b < NUM_BLOCKS for x, b in out)
        w.tally["evictions"] += len(out)
        time.sleep(0.0005)  # leave the pool some blocks to pin

    def remover(w: Worker) -> None:
        x = w.rng.choice(HASHES)
        with held.lock:
            was_held = x in held.block_of
            removed = index.remove(x)
        assert not (was_held and removed), "removed a pinned block"
        w.tally["removals"] += removed
        time.sleep(0.0005)

    def checker(w: Worker) -> None:
        with held.lock:
            for b, c in held.count.items():
                assert index.pin_count(b) >= c, "a recorded pin is missing"
        s = index.stats()
        assert 0 <= s["pinned_blocks"] <= s["cached"] <= NUM_BLOCKS
        assert s["total_pins"] >= s["pinned_blocks"]
        assert all(index.pin_count(b) >= 0 for b in range(NUM_BLOCKS))
        w.tally["checks"] += 1
        time.sleep(0.001)

    roles = ([("inserter", inserter)] * 2 + [("pinner", pinner)] * 3 + [("bulk", bulk_inserter)]
             + [("id_pinner", id_pinner), ("evictor", evictor), ("remover", remover),
                ("checker", checker)])
    workers = [Worker(f"{role}-{i}", step, stop, seed=i) for i, (role, step) in enumerate(roles)]
    for w in workers:
        w.start()
    time.sleep(DURATION_S)
    stop.set()
    for w in workers:
        w.join(timeout=10)
        assert not w.is_alive(), f"{w.name} hung"
    errors = [(w.name, w.error) for w in workers if w.error is not None]
    assert not errors, errors

    # Drop every lease still held; the book must end empty.
    for w in workers:
        for lease in leases.get(w.name, []):
            release(w, lease)
    assert not held.count and not held.block_of

    tally = sum((w.tally for w in workers), Counter())
    # Every role made real progress, and threads really overlapped.
    assert min(tally["inserts"], tally["hits"], tally["evictions"], tally["checks"]) > 0
    assert tally["removals"] > 0 and tally["misses"] > 0
    assert tally["inserts_refused"] > 0  # inserts really ran into pinned blocks

    s = index.stats()
    assert s["total_pins"] == 0 and s["pinned_blocks"] == 0
    assert all(index.pin_count(b) == 0 for b in range(NUM_BLOCKS))
    for key in ("hits", "misses", "inserts", "evictions", "removals"):
        assert s[key] == tally[key], key
    cached = {x: index.lookup(x) for x in HASHES if index.lookup(x) is not None}
    assert len(set(cached.values())) == len(cached) == s["cached"] == len(index)
    # With no pins left, every cached block is evictable, each exactly once.
    assert sorted(index.evict(NUM_BLOCKS)) == sorted(cached.items())
    assert len(index) == 0


def test_work_runs_with_the_gil_released():
    """A pure-Python thread makes progress *during* a long index call.

    The switch interval is raised so the interpreter never preempts the
    calling thread: the spinner can then only run inside the call if the call
    released the GIL. (It sleeps between increments so the caller gets the GIL
    back promptly.)
    """
    n = 1 << 20
    index = PoolIndex(n)
    packed = np.arange(n, dtype=">u8").tobytes()
    index.insert_packed(packed, np.arange(n, dtype=np.int32), 8)
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1
            time.sleep(0.0001)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    spinner = threading.Thread(target=spin, daemon=True)
    overlapped = 0
    try:
        spinner.start()
        for _ in range(5):
            before = counter[0]
            ids = index.find_and_pin_packed(packed, 8)
            index.unpin_packed(ids)
            overlapped += counter[0] > before
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(old_interval)
    assert len(ids) == n and index.stats()["total_pins"] == 0
    assert overlapped >= 1, "no Python thread ran during any index call: the GIL was held"
