"""Which prompt blocks are worth a G2 copy: those this instance has seen in enough requests.

vLLM's own CPU offloading can store a block only once it has been seen more
than once (its ``store_threshold``), trading the first sharing of a prefix
for copies never made of blocks nobody asks for again. The connector's
``save_threshold`` setting is that threshold; 1 (the default, chosen by the
numbers in docs/benchmarks.md) saves every full prompt block.

Counting is by block hash, in the scheduler, once per request (when vLLM
first asks about it). A block hash names its whole prefix, so a request
holding block ``k`` holds blocks ``0..k-1`` too: counts never grow along a
prompt, and the blocks seen often enough are always a leading run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["SeenBlocks"]


class SeenBlocks:
    """Per block hash, how many requests held it; the ``capacity`` most recently seen hashes are kept."""

    def __init__(self, threshold: int, capacity: int = 1 << 20) -> None:
        if threshold < 1 or capacity < 1:
            raise ValueError(f"threshold {threshold} and capacity {capacity} must be >= 1")
        self.threshold = threshold
        self._capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def count(self, hashes: Sequence[bytes]) -> int:
        """Count one more request holding ``hashes`` (a prompt's block hashes, in order); how many leading
        ones have now been seen in ``threshold`` requests (all of them at threshold 1, with nothing kept)."""
        if self.threshold == 1:
            return len(hashes)
        for h in hashes:  # most recently seen last: the capacity drops the longest-unseen first
            self._counts[h] = self._counts.pop(h, 0) + 1
        eligible = 0
        for h in hashes:
            if self._counts[h] < self.threshold:
                break
            eligible += 1
        while len(self._counts) > self._capacity:
            self._counts.popitem(last=False)
        return eligible

    def __len__(self) -> int:
        return len(self._counts)
