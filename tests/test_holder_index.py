"""Tests of remote_g2.registry.stores.holder_index.HolderIndex: unit tests of each method and
error, then property tests against ``DictHolderIndex``, a plain
``dict[bytes, set[int]]`` with the same contracts.

The semantic unit tests run against both, so the model is checked on its own
too and the two cannot drift apart silently.
"""

from __future__ import annotations

import operator
import random
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from remote_g2.registry.stores.holder_index import MAX_HASH_LEN, MAX_HOLDER, HolderIndex


def _checked_hash(h: object) -> bytes:
    if not isinstance(h, bytes):
        raise TypeError(f"block hash must be bytes, not {type(h).__name__}")
    if not 0 < len(h) <= MAX_HASH_LEN:
        raise ValueError(f"block hash must be 1..32 bytes, got {len(h)}")
    return h


def _checked_holder(x: object) -> int:
    i = operator.index(x)
    if not 1 <= i <= MAX_HOLDER:
        raise ValueError(f"holder id {i} out of range 1..{MAX_HOLDER}")
    return i


class DictHolderIndex:
    """The model: what HolderIndex does, written the obvious way."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[int]] = {}

    def add(self, holder, hashes) -> int:
        holder = _checked_holder(holder)
        hashes = [_checked_hash(h) for h in hashes]
        new = 0
        for h in hashes:
            held = self._holders.setdefault(h, set())
            new += holder not in held
            held.add(holder)
        return new

    def remove(self, holder, hashes) -> int:
        holder = _checked_holder(holder)
        hashes = [_checked_hash(h) for h in hashes]
        gone = 0
        for h in hashes:
            held = self._holders.get(h)
            if held is not None and holder in held:
                held.discard(holder)
                gone += 1
                if not held:
                    del self._holders[h]
        return gone

    def holders(self, block_hash) -> list[int]:
        return sorted(self._holders.get(_checked_hash(block_hash), ()))

    def walk(self, hashes, candidates) -> list[int]:
        hashes = [_checked_hash(h) for h in hashes]
        if not hashes:
            raise ValueError("walk: hashes must not be empty")
        candidates = [_checked_holder(c) for c in candidates]
        out = []
        for c in candidates:
            i = 1
            while i < len(hashes) and c in self._holders.get(hashes[i], ()):
                i += 1
            out.append(i)
        return out

    def drop_holder(self, holder) -> int:
        holder = _checked_holder(holder)
        return self.remove(holder, [x for x, held in self._holders.items() if holder in held])

    def clear(self) -> None:
        self._holders.clear()

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def entries(self) -> int:
        return sum(map(len, self._holders.values()))


@pytest.fixture(params=[HolderIndex, DictHolderIndex], ids=["cpp", "model"])
def make(request):
    return request.param


def h(i: int, n: int = 8) -> bytes:
    """An n-byte big-endian hash of i (8 bytes: the TensorRT-LLM/Dynamo form)."""
    return i.to_bytes(n, "big")


# Valid hashes chosen to collide if anything compared less than the full key:
# zero padding, shared prefixes, 8 vs 9 bytes, 31 vs 32 bytes.
TRICKY = [
    b"\x00", b"\x00\x00", b"a", b"a\x00", b"\x01" * 8, b"\x01" * 8 + b"\x00",
    b"\xff" * 32, b"\xff" * 31, b"\xff" * 31 + b"\xfe", b"\x00" * 9, b"\x00" * 8,
    b"x" * 16, b"\x01", b"\x02" * 8,
]
BAD_HASHES = [(b"", ValueError), (b"z" * 33, ValueError), ("str", TypeError),
              (bytearray(b"ab"), TypeError), (3, TypeError), (None, TypeError)]
BAD_HOLDERS = [(0, ValueError), (-1, ValueError), (MAX_HOLDER + 1, ValueError),
               (2**70, ValueError), (-(2**70), ValueError), (1.0, TypeError),
               ("1", TypeError), (None, TypeError)]


def snapshot(index, hashes) -> tuple:
    return len(index), index.entries, {x: index.holders(x) for x in hashes}


# -- add / remove / holders ----------------------------------------------------


def test_new_index_is_empty(make):
    index = make()
    assert len(index) == 0 and index.entries == 0
    assert index.holders(h(1)) == []
    assert index.remove(1, [h(1)]) == 0


def test_add_counts_new_pairs_once(make):
    index = make()
    assert index.add(7, [h(1), h(2), h(1)]) == 2
    assert index.add(7, [h(2), h(3)]) == 1
    assert index.add(8, [h(2)]) == 1
    assert len(index) == 3 and index.entries == 4
    assert index.holders(h(2)) == [7, 8]
    assert index.holders(h(4)) == []


def test_remove_counts_existing_pairs_and_drops_empty_hashes(make):
    index = make()
    index.add(1, [h(1), h(2)])
    index.add(2, [h(2)])
    assert index.remove(1, [h(1), h(2), h(1), h(9)]) == 2
    assert index.holders(h(1)) == [] and index.holders(h(2)) == [2]
    assert len(index) == 1 and index.entries == 1
    assert index.remove(3, [h(2)]) == 0
    assert index.remove(2, [h(2)]) == 1
    assert len(index) == 0 and index.entries == 0


def test_many_holders_per_hash_are_sorted_and_removable(make):
    # Beyond three holders the rest live in an overflow array; removing an
    # inline holder refills its place from there.
    index = make()
    ids = [9, 3, 12, 1, 7, 5, 2**32 - 1, 4]
    for x in ids:
        assert index.add(x, [h(1)]) == 1
    assert index.holders(h(1)) == sorted(ids)
    assert index.entries == len(ids) and len(index) == 1
    for k, x in enumerate(ids):  # the first three added were inline
        assert index.remove(x, [h(1)]) == 1
        assert index.holders(h(1)) == sorted(ids[k + 1:])
        assert index.walk([h(0), h(1)], ids) == [1 if y in ids[:k + 1] else 2 for y in ids]
    assert len(index) == 0
    for x in ids:  # and again, after the overflow array was freed
        index.add(x, [h(1)])
    assert index.holders(h(1)) == sorted(ids)


def test_hashes_compare_in_full_including_length(make):
    index = make()
    for i, x in enumerate(TRICKY):
        index.add(i + 1, [x])
    assert len(index) == len(TRICKY) and index.entries == len(TRICKY)
    for i, x in enumerate(TRICKY):
        assert index.holders(x) == [i + 1], x
    index.remove(1, [TRICKY[0]])
    assert index.holders(TRICKY[1]) == [2]


def _fmix64(x: int) -> int:
    m = (1 << 64) - 1
    x ^= x >> 33
    x = x * 0xFF51AFD7ED558CCD & m
    x ^= x >> 33
    x = x * 0xC4CEB9FE1A85EC53 & m
    return x ^ x >> 33


def _words(key: bytes) -> list[int]:
    return [int.from_bytes(key.ljust(32, b"\0")[i:i + 8], "little") for i in range(0, 32, 8)]


def _from_words(words: list[int], n: int) -> bytes:
    return b"".join(w.to_bytes(8, "little") for w in words)[:n]


@pytest.mark.skipif(sys.byteorder != "little", reason="the keys are built for a little-endian make_key")
def test_keys_with_the_same_table_hash_stay_distinct(make):
    # White-box: cpp_ext/block_key.h hashes words 1..3 into word 0's hash
    # with xors, so a key whose later words cancel the change to the earlier
    # ones gets the very same unkeyed tag. The index's keyed fingerprint
    # chains the words instead, so such keys still land apart.
    a32 = bytes(range(1, 33))
    w = _words(a32)
    b32 = _from_words([w[0], w[1], w[2] ^ _fmix64(w[3]) ^ _fmix64(w[3] ^ 1), w[3] ^ 1], 32)
    a16 = bytes(range(40, 56))
    w = _words(a16)
    k = 0x9E3779B97F4A7C15 * 16 % (1 << 64)
    w0 = w[0] ^ 0xFF
    b16 = _from_words([w0, w[1] ^ _fmix64(w[0] ^ k) ^ _fmix64(w0 ^ k), 0, 0], 16)
    index = make()
    for x, key in enumerate([a32, b32, a16, b16], start=1):
        index.add(x, [key])
    assert [index.holders(key) for key in (a32, b32, a16, b16)] == [[1], [2], [3], [4]]
    assert index.remove(1, [b32, a16]) == 0
    assert index.remove(1, [a32]) == 1 and index.holders(b32) == [2]
    assert index.walk([a16, b16, b32], [4, 2]) == [2, 1]


def test_accepts_tuples_iterables_and_integer_likes(make):
    index = make()
    assert index.add(np.int64(5), (h(1), h(2))) == 2
    assert index.add(True, (x for x in [h(1)])) == 1  # True is the int 1
    assert index.holders(h(1)) == [1, 5]
    assert index.walk(iter([h(1), h(2)]), (np.uint32(5), 1)) == [2, 1]
    assert index.remove(np.int32(5), [h(1)]) == 1


def test_clear(make):
    index = make()
    index.add(1, [h(i) for i in range(100)])
    index.clear()
    assert len(index) == 0 and index.entries == 0 and index.holders(h(3)) == []
    assert index.add(1, [h(3)]) == 1


def test_repr():
    index = HolderIndex()
    index.add(1, [h(1), h(2)])
    index.add(2, [h(1)])
    assert repr(index) == "HolderIndex(hashes=2, entries=3)"


# -- errors ----------------------------------------------------------------------


def prepared(make):
    index = make()
    index.add(1, [h(1), h(2)])
    index.add(2, [h(2)])
    for x in range(3, 8):
        index.add(x, [h(3)])
    return index


CHECKED = [h(i) for i in range(6)]


# A bad hash comes last, after hashes that would change the index.
BAD_ARGUMENTS = ([(3, [h(1), h(3), h(4), bad], exc) for bad, exc in BAD_HASHES]
                 + [(bad, [h(1), h(3)], exc) for bad, exc in BAD_HOLDERS])


@pytest.mark.parametrize("holder,hashes,exc", BAD_ARGUMENTS)
@pytest.mark.parametrize("method", ["add", "remove"])
def test_bad_argument_raises_and_changes_nothing(make, method, holder, hashes, exc):
    index = prepared(make)
    before = snapshot(index, CHECKED)
    with pytest.raises(exc):
        getattr(index, method)(holder, hashes)
    assert snapshot(index, CHECKED) == before


@pytest.mark.parametrize("bad,exc", BAD_HASHES)
def test_holders_bad_hash(make, bad, exc):
    with pytest.raises(exc):
        prepared(make).holders(bad)


@pytest.mark.parametrize("method", ["add", "remove"])
@pytest.mark.parametrize("seq", [None, 5, 1.5])
def test_non_sequence_is_type_error(make, method, seq):
    index = prepared(make)
    with pytest.raises(TypeError):
        getattr(index, method)(1, seq)
    with pytest.raises(TypeError):
        index.walk(seq, [1])
    with pytest.raises(TypeError):
        index.walk([h(1)], seq)


def test_holder_is_checked_before_hashes(make):
    with pytest.raises(ValueError):
        make().add(0, ["not bytes"])
    with pytest.raises(TypeError):
        make().add("1", [b""])


def test_extreme_holder_ids(make):
    index = make()
    assert index.add(MAX_HOLDER, [h(1)]) == 1
    assert index.add(1, [h(1)]) == 1
    assert index.holders(h(1)) == [1, MAX_HOLDER]
    assert index.walk([h(0), h(1)], [MAX_HOLDER, 2]) == [2, 1]


# -- walk --------------------------------------------------------------------------


def test_walk_lengths_per_candidate_in_order(make):
    index = make()
    chain = [h(i) for i in range(10)]
    index.add(1, chain)            # all of it
    index.add(2, chain[:4])        # a prefix
    index.add(3, chain[1:2] + chain[3:])  # a gap at 2
    assert index.walk(chain, [1, 2, 3, 4]) == [10, 4, 2, 1]
    assert index.walk(chain, [4, 3, 2, 1, 2]) == [1, 2, 4, 10, 4]
    assert index.walk(chain[:1], [1, 2, 4]) == [1, 1, 1]
    assert index.walk(chain, []) == []


def test_walk_takes_the_first_hash_as_held(make):
    index = make()
    index.add(1, [h(2), h(3)])
    assert index.walk([h(99), h(2), h(3)], [1]) == [3]
    assert index.walk([h(99), h(98), h(3)], [1]) == [1]


def test_walk_stops_at_a_hash_no_candidate_holds(make):
    index = make()
    index.add(1, [h(0), h(1), h(3)])
    index.add(2, [h(0), h(1), h(3)])
    assert index.walk([h(0), h(1), h(2), h(3)], [1, 2]) == [2, 2]


def test_walk_errors(make):
    index = prepared(make)
    with pytest.raises(ValueError):
        index.walk([], [1])
    with pytest.raises(ValueError):  # hashes are checked before candidates
        index.walk([], ["x"])
    with pytest.raises(ValueError):  # every hash, even after the stop
        index.walk([h(1), h(9), b""], [1])
    with pytest.raises(TypeError):
        index.walk(["x", h(1)], [])
    for bad, exc in BAD_HOLDERS:
        with pytest.raises(exc):
            index.walk([h(1), h(2)], [1, bad])


# -- sizes and churn -----------------------------------------------------------------


def test_growth_through_many_resizes_and_back():
    index, model = HolderIndex(), DictHolderIndex()
    keys = [h(i, 8 + i % 3) for i in range(60_000)]  # 8, 9 and 10 bytes
    for holder in (1, 2, 3, 4, 5):  # five holders: past the inline three
        part = keys[holder * 5000:]
        assert index.add(holder, part) == model.add(holder, part)
    assert len(index) == len(model) and index.entries == model.entries
    # Remove every other hash entirely, then one holder everywhere: long
    # runs of backward shifts in a table grown through ~13 doublings.
    for holder in (1, 2, 3, 4, 5):
        assert index.remove(holder, keys[::2]) == model.remove(holder, keys[::2])
    assert index.remove(3, keys) == model.remove(3, keys)
    assert len(index) == len(model) and index.entries == model.entries
    assert all(index.holders(x) == model.holders(x) for x in keys)
    chain = keys[25_001:25_129:2]  # odd hashes: still held
    assert index.walk(chain, [1, 2, 3, 4, 5, 6]) == model.walk(chain, [1, 2, 3, 4, 5, 6])


def test_drop_holder_removes_it_everywhere(make):
    index = make()
    keys = [h(i) for i in range(3000)]
    for holder in (1, 2, 3, 4):  # up to four holders a hash: inline and overflow slots
        index.add(holder, keys[holder * 500:])
    before = {x: index.holders(x) for x in keys}
    assert index.drop_holder(3) == 3000 - 1500
    assert index.drop_holder(3) == 0 and index.drop_holder(99) == 0
    assert all(index.holders(x) == [y for y in before[x] if y != 3] for x in keys)
    assert index.drop_holder(1) == 2500 and index.drop_holder(2) == 2000
    assert len(index) == 1000 and index.entries == 1000  # only holder 4's hashes are left
    assert index.walk(keys[2000:2010], [4, 3]) == [10, 1]
    with pytest.raises(ValueError):
        index.drop_holder(0)


def test_drop_holder_through_wrapped_probe_runs():
    """Many small tables: a run that wraps from the last slot to the first
    is shifted back across the end while one pass removes a holder."""
    rng = random.Random(7)
    for _ in range(200):
        index, model = HolderIndex(), DictHolderIndex()
        keys = [rng.randbytes(8) for _ in range(rng.randint(5, 12))]  # 16 slots: dense, runs wrap
        for holder in (1, 2, 3):
            part = rng.sample(keys, rng.randint(1, len(keys)))
            index.add(holder, part)
            model.add(holder, part)
        gone = rng.randint(1, 3)
        assert index.drop_holder(gone) == model.drop_holder(gone)
        assert len(index) == len(model) and index.entries == model.entries
        assert [index.holders(x) for x in keys] == [model.holders(x) for x in keys]


def test_nbytes_stays_within_forty_bytes_a_hash():
    index = HolderIndex()
    keys = [h(i, 32) for i in range(200_000)]
    for i in range(0, len(keys), 1000):  # two holders a hash: the common case
        index.add(1 + i % 7, keys[i:i + 1000])
        index.add(9, keys[i:i + 1000])
    assert len(index) == 200_000
    assert 16 * len(index) < index.nbytes <= 40 * len(index)


def test_random_churn_matches_model():
    """Seeded add/remove churn over a few hundred keys: the table's size hovers
    around its growth points, and deletions land in the middle of probe runs."""
    rng = random.Random(2024)
    keys = list(dict.fromkeys(rng.randbytes(rng.choice([1, 2, 8, 8, 9, 31, 32])) for _ in range(400)))
    index, model = HolderIndex(), DictHolderIndex()
    for step in range(6000):
        holder = rng.randint(1, 6)
        batch = rng.sample(keys, rng.randint(0, 12))
        if rng.random() < 0.55:
            assert index.add(holder, batch) == model.add(holder, batch), step
        else:
            assert index.remove(holder, batch) == model.remove(holder, batch), step
        if step % 200 == 0:
            assert len(index) == len(model) and index.entries == model.entries, step
            assert [index.holders(x) for x in keys] == [model.holders(x) for x in keys], step
            chain = rng.sample(keys, 20)
            assert index.walk(chain, [1, 3, 6]) == model.walk(chain, [1, 3, 6]), step
            # any order, repeats: walk merges them against a hash's sorted holders
            cands = rng.choices(range(1, 8), k=rng.randint(1, 9))
            assert index.walk(chain, cands) == model.walk(chain, cands), (step, cands)
        if step % 50 == 0:  # a chain most holders share from its start, as a popular prompt's prefix
            chain = rng.sample(keys, 10)
            for holder in rng.sample(range(1, 7), rng.randint(3, 6)):
                cut = rng.randint(1, 10)
                assert index.add(holder, chain[:cut]) == model.add(holder, chain[:cut])
            cands = rng.sample(range(1, 8), 7)
            assert index.walk(chain, cands) == model.walk(chain, cands), (step, cands)


def test_reentrant_calls_from_argument_conversion(make):
    # Python code that runs while arguments are read (an __index__, a
    # generator of hashes) may call the index again and change the list
    # being read; the outer call sees what it read, and nothing breaks.
    index = make()
    candidates: list = []

    class Sneaky:
        def __index__(self) -> int:
            index.add(2, [h(1), h(2)])
            candidates.clear()
            return 1

    index.add(1, [h(1), h(2)])
    candidates.extend([Sneaky(), 2, 3])
    assert index.walk([h(0), h(1), h(2)], candidates) == [3]
    assert index.holders(h(2)) == [1, 2]

    def hashes():
        yield h(5)
        assert index.add(3, [h(6), h(5)]) == 2
        yield h(6)

    assert index.add(4, hashes()) == 2
    assert index.holders(h(6)) == [3, 4]


# -- property test against the model -------------------------------------------------

KEYS = TRICKY + [h(i, n) for i in range(6) for n in (1, 8, 9, 32)]
some_hashes = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.sampled_from(KEYS),
                    st.sampled_from([bad for bad, _ in BAD_HASHES]))
some_holders = st.one_of(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6),
                     st.sampled_from([MAX_HOLDER] + [bad for bad, _ in BAD_HOLDERS]))


class HolderIndexMachine(RuleBasedStateMachine):
    """Every step runs the same call on both; same result or same exception
    type, and after a raising call both are exactly as before."""

    def __init__(self) -> None:
        super().__init__()
        self.cpp, self.model = HolderIndex(), DictHolderIndex()

    def both(self, method: str, *args):
        before = snapshot(self.model, KEYS)
        outcomes = []
        for index in (self.cpp, self.model):
            try:
                outcomes.append(("ok", getattr(index, method)(*args)))
            except Exception as e:  # compared by type below
                outcomes.append(("raised", type(e)))
        assert outcomes[0] == outcomes[1], (method, args, outcomes)
        if outcomes[0][0] == "raised":
            assert snapshot(self.model, KEYS) == before
            assert snapshot(self.cpp, KEYS) == before

    @rule(holder=some_holders, hashes=st.lists(some_hashes, max_size=8))
    def add(self, holder, hashes):
        self.both("add", holder, hashes)

    @rule(holder=some_holders, hashes=st.lists(some_hashes, max_size=8))
    def remove(self, holder, hashes):
        self.both("remove", holder, hashes)

    @rule(holder=some_holders)
    def drop_holder(self, holder):
        self.both("drop_holder", holder)

    @rule(block_hash=some_hashes)
    def holders(self, block_hash):
        self.both("holders", block_hash)

    @rule(hashes=st.lists(some_hashes, max_size=10), candidates=st.lists(some_holders, max_size=4))
    def walk(self, hashes, candidates):
        self.both("walk", hashes, candidates)

    @rule(data=st.data())
    def walk_held_chain(self, data):
        # Chains built from hashes that are present, so walks go deep.
        present = [x for x in KEYS if self.model.holders(x)]
        if present:
            chain = data.draw(st.lists(st.sampled_from(present), min_size=1, max_size=10))
            self.both("walk", chain, data.draw(st.lists(st.integers(1, 6), max_size=4)))

    @rule(holder=st.integers(1, 6), count=st.integers(1, 60), start=st.integers(0, 200))
    def add_range(self, holder, count, start):
        # Ranges of fresh 8-byte hashes grow the table through several sizes.
        self.both("add", holder, [h(i) for i in range(start, start + count)])

    @rule(holder=st.integers(1, 6), count=st.integers(1, 60), start=st.integers(0, 200))
    def remove_range(self, holder, count, start):
        self.both("remove", holder, [h(i) for i in range(start, start + count)])

    @rule(roll=st.integers(0, 9))
    def clear(self, roll):
        if roll == 0:  # rarely, or the table would seldom grow
            self.both("clear")

    @invariant()
    def same_state(self):
        assert snapshot(self.cpp, KEYS) == snapshot(self.model, KEYS)

    def teardown(self):
        ranged = [h(i) for i in range(260)]
        assert [self.cpp.holders(x) for x in ranged] == [self.model.holders(x) for x in ranged]


HolderIndexMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHolderIndexModel = HolderIndexMachine.TestCase
