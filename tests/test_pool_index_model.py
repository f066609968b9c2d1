"""Property tests: the C++ PoolIndex against the pure-Python reference model.

Every step runs the same call on both and requires the same result or the
same exception type; after a raising call both must be exactly as before.
After every step the whole observable state (stats, pin counts, every
lookup) must agree. LRU order is not directly observable, so any divergence
there shows up as a different ``evict`` result later.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pool_index_reference import ReferencePoolIndex
from remote_g2.memory.pool_index import PoolIndex

# Valid hashes chosen to collide if anything compared less than the full key:
# zero padding, shared prefixes, 8 vs 9 bytes, 31 vs 32 bytes.
VALID = [
    b"\x00", b"\x00\x00", b"a", b"a\x00", b"\x01" * 8, b"\x01" * 8 + b"\x00",
    b"\xff" * 32, b"\xff" * 31 + b"\xfe", b"\x00" * 9, b"x" * 16, b"\x01", b"\x02" * 8,
]
INVALID = [b"", b"z" * 33, "str", bytearray(b"ab"), 3]
MAX_BLOCKS = 6

# one_of picks a branch uniformly: three valid branches make ~3/4 of hashes valid.
mostly_valid_hashes = st.one_of(st.sampled_from(VALID), st.sampled_from(VALID),
                                st.sampled_from(VALID), st.sampled_from(INVALID))
ids = st.one_of(st.integers(-1, MAX_BLOCKS), st.integers(0, MAX_BLOCKS - 1),
                st.sampled_from([2**40, 1.5, "0", None]))
same_length_groups = st.sampled_from(
    [[b"\x00", b"a", b"\x01"], [b"\x01" * 8, b"\x02" * 8], [b"\xff" * 32, b"\xff" * 31 + b"\xfe"]]
)


def observe(index) -> tuple:
    return (
        index.stats(),
        len(index),
        [index.pin_count(b) for b in range(index.num_blocks)],
        [index.lookup(x) for x in VALID],
    )


def normalise(result):
    if isinstance(result, np.ndarray):
        assert result.dtype == np.int32 and result.ndim == 1
        return ("ndarray", result.tolist())
    return result


class PoolIndexMachine(RuleBasedStateMachine):
    @initialize(n=st.integers(1, MAX_BLOCKS))
    def create(self, n):
        self.cpp = PoolIndex(n)
        self.ref = ReferencePoolIndex(n)

    def both(self, method: str, *args):
        """Call `method` on both; same outcome, and no change when it raised."""
        before = observe(self.ref)
        outcomes = []
        for index in (self.cpp, self.ref):
            try:
                outcomes.append(("ok", normalise(getattr(index, method)(*args))))
            except Exception as e:  # compared by type below
                outcomes.append(("raised", type(e)))
        assert outcomes[0] == outcomes[1], (method, args, outcomes)
        if outcomes[0][0] == "raised":
            assert observe(self.ref) == before, (method, args)
            assert observe(self.cpp) == before, (method, args)
        return outcomes[1]

    def pinned_ids(self) -> list[int]:
        return [b for b in range(self.ref.num_blocks) if self.ref.pin_count(b)]

    @rule(block_hash=mostly_valid_hashes, block_id=ids)
    def insert(self, block_hash, block_id):
        self.both("insert", block_hash, block_id)

    @rule(group=same_length_groups, data=st.data())
    def insert_packed(self, group, data):
        keys = data.draw(st.lists(st.sampled_from(group), max_size=4))
        blocks = data.draw(st.lists(st.integers(0, self.ref.num_blocks - 1),
                                    min_size=len(keys), max_size=len(keys)))
        dtype = data.draw(st.sampled_from([np.int32, np.int64]))
        self.both("insert_packed", b"".join(keys), np.array(blocks, dtype), len(group[0]))

    @rule(keys=st.lists(mostly_valid_hashes, max_size=6))
    def find_and_pin(self, keys):
        self.both("find_and_pin", keys)

    @rule(group=same_length_groups, data=st.data())
    def find_and_pin_packed(self, group, data):
        keys = data.draw(st.lists(st.sampled_from(group), max_size=5))
        self.both("find_and_pin_packed", b"".join(keys), len(group[0]))

    @rule(blocks=st.lists(ids, max_size=4))
    def pin_blocks_by_id(self, blocks):
        self.both("pin_blocks_by_id", blocks)

    @rule(blocks=st.lists(ids, max_size=4))
    def unpin_blocks_by_id(self, blocks):
        self.both("unpin_blocks_by_id", blocks)

    @precondition(lambda self: any(self.ref.pin_count(b) for b in range(self.ref.num_blocks)))
    @rule(data=st.data())
    def unpin_held(self, data):
        # Random ids rarely hit pinned blocks; this rule releases real pins,
        # sometimes with one repeat too many (an error that must roll back).
        pinned = self.pinned_ids()
        blocks = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=4))
        packed = data.draw(st.booleans())
        if packed:
            self.both("unpin_packed", np.array(blocks, np.int64))
        else:
            self.both("unpin_blocks_by_id", blocks)

    @rule(blocks=st.lists(st.integers(-1, MAX_BLOCKS), max_size=4),
          dtype=st.sampled_from([np.int32, np.int64, np.float64]))
    def pin_packed(self, blocks, dtype):
        self.both("pin_packed", np.array(blocks, dtype))

    @rule(n=st.one_of(st.integers(-1, MAX_BLOCKS + 1), st.just(1.0)))
    def evict(self, n):
        self.both("evict", n)

    @rule(block_hash=mostly_valid_hashes)
    def remove(self, block_hash):
        self.both("remove", block_hash)

    @rule(block_hash=mostly_valid_hashes)
    def lookup(self, block_hash):
        self.both("lookup", block_hash)

    @rule(block_id=ids)
    def pin_count(self, block_id):
        self.both("pin_count", block_id)

    @invariant()
    def same_observable_state(self):
        if hasattr(self, "cpp"):
            assert observe(self.cpp) == observe(self.ref)
            s = self.cpp.stats()
            pins = [self.cpp.pin_count(b) for b in range(self.cpp.num_blocks)]
            assert s["total_pins"] == sum(pins) and min(pins) >= 0
            assert s["pinned_blocks"] == sum(1 for p in pins if p)
            assert s["cached"] == len(self.cpp) == sum(1 for x in VALID if self.cpp.lookup(x) is not None)


PoolIndexMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolIndexModel = PoolIndexMachine.TestCase


def test_random_churn_matches_reference():
    """Long seeded churn on a bigger pool: long probe runs in the C++ table,
    many deletions in the middle of them, and thousands of LRU moves."""
    rng = random.Random(12345)
    n, universe = 300, 700
    keys = [rng.randbytes(rng.choice([1, 2, 8, 8, 8, 9, 32])) for _ in range(universe)]
    keys = list(dict.fromkeys(keys))
    cpp, ref = PoolIndex(n), ReferencePoolIndex(n)
    held: list[list[int]] = []
    for step in range(20_000):
        op = rng.random()
        if op < 0.45:
            key, block = rng.choice(keys), rng.randrange(n)
            outcomes = []
            for index in (cpp, ref):
                try:
                    index.insert(key, block)
                    outcomes.append("ok")
                except ValueError as e:
                    outcomes.append(type(e).__name__)
            assert outcomes[0] == outcomes[1], step
        elif op < 0.6:
            start = rng.randrange(len(keys))
            prefix = keys[start:start + rng.randrange(1, 6)]
            got = cpp.find_and_pin(prefix)
            assert got == ref.find_and_pin(prefix), step
            held.append(got)
        elif op < 0.75 and held:
            ids_ = held.pop(rng.randrange(len(held)))
            cpp.unpin_blocks_by_id(ids_)
            ref.unpin_blocks_by_id(ids_)
        elif op < 0.85:
            k = rng.randrange(4)
            assert cpp.evict(k) == ref.evict(k), step
        else:
            key = rng.choice(keys)
            assert cpp.remove(key) == ref.remove(key), step
        if step % 500 == 0:
            assert cpp.stats() == ref.stats()
            assert [cpp.lookup(x) for x in keys] == [ref.lookup(x) for x in keys]
    for ids_ in held:
        cpp.unpin_blocks_by_id(ids_)
        ref.unpin_blocks_by_id(ids_)
    assert cpp.stats() == ref.stats()
    assert cpp.stats()["total_pins"] == 0
    assert cpp.evict(n) == ref.evict(n)
    assert len(cpp) == 0
