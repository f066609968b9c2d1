"""What the TP ranks of one vLLM instance must decide alike, decided once for all of them.

With ``tensor_parallel_size = N`` every vLLM worker process runs its own
connector over its own slice of the KV (its heads), with its own G2 pool and
landing slots. A remote load is one load for the whole instance, though: the
leader's target client (rank 0) resolves it and hands each rank its share,
*into the landing slots rank 0 chose*, and vLLM reports a request received
only when every rank has reported it. So the ranks' bookkeeping must never
diverge:

* **which blocks are copied from the instance's own G2** rather than read:
  each rank's pool evicts on its own (remote readers pin different blocks on
  different ranks), so a block counts as held only if *every* rank holds it
  (:meth:`TpSync.held_everywhere`, one allgather in a step that has loads);
* **when a fetch has ended, and how**: rank 0's target client alone knows
  (it hears every rank's share, or times a silent one out), so its outcome is
  everyone's (:meth:`TpSync.leader_outcome`, one allgather in a step while
  fetches are in flight). A rank copies landed bytes into vLLM's blocks only
  then; a rank still writing a failed share writes into landing slots that
  sit out their quarantine, never into vLLM's blocks;
* **the clock** the landing slots' quarantines run on: rank 0's, carried by
  each of those allgathers (:meth:`TpSync.now`), so a quarantined slot comes
  back on the same step everywhere.

Every rank calls the same collectives in the same steps: vLLM hands every
worker the same connector metadata and calls ``start_load_kv`` /
``get_finished`` on each of them once per step, and the decision whether a
step has loads or fetches in flight is itself made from this shared state.
The exchanges run over the ranks' local links (:mod:`.tp_links`) when every
rank is on one host, else over vLLM's CPU (gloo) TP group through
:class:`~remote_g2.tp.torch_group.TorchGroupComm`, an order of magnitude slower
(``bench/rpc/bench_tp_exchange.py``); at TP 1 nothing is exchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TpSync", "FetchOutcome"]


@dataclass(frozen=True)
class FetchOutcome:
    """Fetches that ended since the last call, as the leader's target client reported them."""

    done: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    invalid: set[int] = field(default_factory=set)  # destination (landing) blocks that did not load
    expired: bool = False  # rank 0 gave up waiting for a synchronous load (every rank gives it up)

    def to_wire(self) -> dict[str, Any]:
        return {"done": sorted(self.done), "failed": sorted(self.failed), "invalid": sorted(self.invalid),
                "expired": self.expired}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FetchOutcome:
        return cls(set(d["done"]), set(d["failed"]), {int(b) for b in d["invalid"]}, bool(d["expired"]))


class TpSync:
    """One vLLM instance's ranks agreeing; ``comm`` (``Get_rank``/``Get_size``/``allgather``) is None at TP 1.

    ``links`` (:class:`.tp_links.StepLinks`, built over ``comm``): carry the exchanges instead of ``comm``."""

    def __init__(self, comm: Any = None, links: Any = None) -> None:
        self._comm = comm
        self._links = links
        self.rank = 0 if comm is None else int(comm.Get_rank())
        self.size = 1 if comm is None else int(comm.Get_size())
        self._now = time.monotonic()

    def now(self) -> float:
        """The landing slots' clock: the local one at TP 1, else rank 0's as of the last exchange."""
        return time.monotonic() if self._comm is None else self._now

    def held_everywhere(self, held_here: Sequence[bool]) -> list[bool]:
        """``held_here[i]``: this rank's G2 holds block i. Returns, on every rank, whether every rank does."""
        if self._comm is None:
            return list(held_here)
        bits = bytes(bool(x) for x in held_here)
        if self._links is not None:
            self._now, both = self._links.gather_and(bits)
            return [bool(b) for b in both]
        gathered = self._exchange(bits)
        if len({len(g) for g in gathered}) != 1:
            raise RuntimeError(f"TP ranks asked about different block counts: {[len(g) for g in gathered]}")
        return [all(g[i] for g in gathered) for i in range(len(held_here))]

    def leader_outcome(self, mine: FetchOutcome | None) -> FetchOutcome:
        """Rank 0 passes its target client's outcome (the others None); every rank gets rank 0's."""
        if self._comm is None:
            assert mine is not None
            return mine
        if self._links is not None:
            self._now, wire = self._links.broadcast(mine.to_wire() if self.rank == 0 and mine is not None else None)
            return FetchOutcome.from_wire(wire)
        gathered = self._exchange(mine.to_wire() if self.rank == 0 and mine is not None else None)
        return FetchOutcome.from_wire(gathered[0])

    def close(self) -> None:
        if self._links is not None:
            self._links.close()

    def _exchange(self, obj: Any) -> list[Any]:
        """Allgather ``(rank 0's clock, obj)``; keep rank 0's clock."""
        gathered = self._comm.allgather((time.monotonic(), obj))
        self._now = float(gathered[0][0])
        return [g[1] for g in gathered]
