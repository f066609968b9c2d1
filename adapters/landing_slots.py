"""Landing slots: the reserved G2 blocks remote READs land in, handed out and taken back by an engine.

An engine reserves blocks of its G2 pool (``HostPool(reserved_blocks=N)``)
as the destination of target loads, then copies what arrived into its own KV
cache. :class:`LandingSlots` is the bookkeeping both the reference engine
and the vLLM connector need:

* slots of a load that **finished** are free again as soon as the engine
  has copied them out;
* slots of a load that **failed** sit out ``quarantine_s`` first: the target
  client gave up on the load, but a READ it had already posted may still be
  landing, and must not overwrite a later load's bytes.

The quarantine runs on ``clock`` (``time.monotonic`` unless given): an
engine whose ranks must hand out the same slots on the same step gives them
one shared clock (the vLLM connector at TP > 1: rank 0's).

Not thread-safe: one engine loop owns it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence

__all__ = ["LandingSlots", "valid_prefix"]


def valid_prefix(slots: Sequence[int], invalid: Collection[int]) -> int:
    """How many leading ``slots`` of a finished load hold valid blocks (the first invalid one ends it)."""
    n = 0
    while n < len(slots) and slots[n] not in invalid:
        n += 1
    return n


class LandingSlots:
    """Free landing slots (lowest id handed out first) and quarantined ones, released by a monotonic clock."""

    def __init__(self, slot_ids: Iterable[int], *, quarantine_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._free: list[int] = sorted(slot_ids, reverse=True)
        self._quarantine: deque[tuple[float, list[int]]] = deque()
        self.quarantine_s = quarantine_s
        self._clock = clock

    def available(self) -> int:
        """Slots :meth:`take` can hand out now (quarantines that ended are released first)."""
        now = self._clock()
        while self._quarantine and self._quarantine[0][0] <= now:
            self._free.extend(self._quarantine.popleft()[1])
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free slots; ``ValueError`` (taking none) when fewer are available."""
        if n > self.available():
            raise ValueError(f"{n} landing slots asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, slots: Sequence[int]) -> None:
        """Slots of a finished load whose blocks were copied out: free at once."""
        self._free.extend(slots)

    def quarantine(self, slots: Sequence[int]) -> None:
        """Slots of a failed load: free only after ``quarantine_s``."""
        self._quarantine.append((self._clock() + self.quarantine_s, list(slots)))
