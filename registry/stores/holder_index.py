"""The registry's holder index: block hash → set of holder ids, in C++.

A :class:`HolderIndex` is what a ``dict[bytes, set[int]]`` of block hash →
incarnations holding it would be, laid out for the registry's prefix lookup
and for a registry mirror that holds a whole fleet's hashes: one 16-byte
slot per hash (a 64-bit fingerprint of the hash and up to two holder ids),
so checking a chain of 128 hashes against a few candidates costs about one
cache miss per hash, and ten million hashes fit in a few hundred MB.

Contracts shared by every method:

- **Hashes** are ``bytes`` of 1..32 bytes. Anything else raises
  ``TypeError`` (not bytes) or ``ValueError`` (bad length). The table keeps a
  keyed 64-bit fingerprint of each hash (all its bytes and its length, under
  a random key per index), not the hash: two different hashes are confused
  with probability about 2**-62, and nobody can pick two that are. Callers
  treat an answer as a hint for that reason: the source pins by the full hash
  on resolve, so a confusion costs a miss, never a wrong block.
- **Holder ids** are ints in ``1 .. MAX_HOLDER`` (``2**32 - 1``); anything
  with ``__index__`` is accepted. A non-int raises ``TypeError``, an int out
  of that range ``ValueError`` (never ``OverflowError``, however large).
- A sequence argument may also be any iterable (it is read once, up front);
  ``None`` or a non-iterable raises ``TypeError``.
- Arguments are validated in order (the holder, then each hash, then each
  candidate), all of them before anything changes; the first bad one decides
  the exception, and **an error changes nothing**.
- **Threads**: no lock of its own. Every call holds the GIL from start to end
  and runs no Python code while it reads or changes the table, so calls are
  atomic with respect to each other; a caller that needs several calls to be
  one step (the registry) holds its own lock around them.
- **Memory**: 16 bytes a slot, at a load between 0.4 and 0.8 (the table
  doubles beyond 0.8), so 20..40 bytes per hash; a hash with more than two
  holders keeps them all in a separate array (4 bytes a holder, plus ~40).
  :attr:`nbytes` says what the index holds. The table never shrinks when
  hashes are removed; :meth:`clear` frees it.

The compiled core is the private ``remote_g2._holder_index``. The property
tests in ``tests/test_holder_index.py`` compare it step by step with a
``dict[bytes, set[int]]`` model.
"""

from __future__ import annotations

from collections.abc import Sequence

from remote_g2 import _holder_index

__all__ = ["HolderIndex", "MAX_HASH_LEN", "MAX_HOLDER"]

MAX_HASH_LEN: int = _holder_index.MAX_HASH_LEN
"""Longest block hash accepted, in bytes (32)."""

MAX_HOLDER: int = _holder_index.MAX_HOLDER
"""Largest holder id accepted (``2**32 - 1``); the smallest is 1."""


class HolderIndex:
    """Block hash → set of holder ids (small positive ints), in C++.

    Starts empty. A hash is present while at least one holder holds it.
    """

    __slots__ = ("_index",)

    def __init__(self) -> None:
        self._index = _holder_index.HolderIndex()

    def __repr__(self) -> str:
        return f"HolderIndex(hashes={len(self)}, entries={self.entries})"

    # -- changing ----------------------------------------------------------

    def add(self, holder: int, hashes: Sequence[bytes]) -> int:
        """Add ``holder`` to the holder set of each hash in ``hashes``.

        Returns how many (hash, holder) pairs were new: a pair already
        present, or repeated within the call, counts once.
        """
        return self._index.add(holder, hashes)

    def remove(self, holder: int, hashes: Sequence[bytes]) -> int:
        """Remove ``holder`` from the holder set of each hash in ``hashes``.

        Returns how many of those pairs existed (a repeat within the call
        counts once). A hash left with no holder is no longer present.
        """
        return self._index.remove(holder, hashes)

    def drop_holder(self, holder: int) -> int:
        """Remove ``holder`` from every hash; returns how many pairs it had.

        One pass over the whole table (milliseconds per million hashes): for
        a caller that keeps no list of a holder's hashes (a registry mirror).
        """
        return self._index.drop_holder(holder)

    def clear(self) -> None:
        """Remove every hash and free the table."""
        self._index.clear()

    # -- reading -----------------------------------------------------------

    def holders(self, block_hash: bytes) -> list[int]:
        """The holders of ``block_hash``, sorted ascending; ``[]`` when absent."""
        return self._index.holders(block_hash)

    def walk(self, hashes: Sequence[bytes], candidates: Sequence[int]) -> list[int]:
        """How far each candidate holds the chain ``hashes``.

        ``result[j]`` is ``1 +`` the number of consecutive hashes, starting at
        ``hashes[1]``, that ``candidates[j]`` holds: ``hashes[0]`` is not
        probed but taken as held by every candidate (the caller chose them
        from ``holders(hashes[0])``). So ``result[j]`` is in
        ``1 .. len(hashes)``, one entry per candidate in the given order (a
        repeated candidate gets the same length twice). The walk stops probing
        at the first hash that no remaining candidate holds.

        Every hash is validated, ``hashes[0]`` and those after the stop
        included. ``ValueError`` if ``hashes`` is empty (checked before the
        candidates); ``[]`` when ``candidates`` is empty.
        """
        return self._index.walk(hashes, candidates)

    def __len__(self) -> int:
        """Number of distinct hashes present."""
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes the index holds now (its table and overflow arrays)."""
        return self._index.nbytes

    @property
    def entries(self) -> int:
        """Total (hash, holder) pairs: the sum of every holder set's size."""
        return self._index.entries
