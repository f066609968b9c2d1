"""The TP group a source rank belongs to, and the one start-up exchange over it.

MPI is used exactly once, at start-up: :func:`exchange` allgathers each
rank's :class:`RankRecord` (or the error that kept it from building one) over
the TP group's communicator. MPICH spins a whole core while a rank waits in a
collective, so nothing here ever waits in MPI after start-up; the ranks talk
over ZMQ from then on.

How a rank finds its group (:func:`~remote_g2.tp_group.resolve_tp_group`) is
shared with the target client and lives in the core package.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from remote_g2.errors import SourceError
from remote_g2.messages import BlockLayout
from remote_g2.tp_group import TpGroup, resolve_tp_group

__all__ = ["TpGroup", "RankRecord", "resolve_tp_group", "exchange"]  # TpGroup: re-exported from the core

log = logging.getLogger("remote_g2.source")


@dataclass(frozen=True)
class RankRecord:
    """What every rank tells the others at start-up (rank 0 keeps them all)."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    pool_base: int
    pool_bytes: int
    layout: BlockLayout
    sibling_endpoint: str | None  # the rank's IPC endpoint (None for rank 0)
    epoch: int = 0  # rank 0's: the worker's epoch (the others send 0 and adopt it)
    peer_endpoint: str | None = None  # where a rank > 0 answers peer_resolve (None: it does not)

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layout"] = dataclasses.asdict(self.layout)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankRecord:
        return cls(**{**d, "layout": BlockLayout(**d["layout"])})


def exchange(group: TpGroup, record: RankRecord | None, error: str | None = None) -> list[RankRecord]:
    """Allgather every rank's record; every rank raises :class:`SourceError` if any rank failed.

    A rank that could not build its record passes ``error`` instead, so the
    others do not wait for it forever and every rank fails the same way.
    """
    mine: dict[str, Any] = {"error": error} if record is None else {"record": record.to_wire()}
    if group.comm is None:
        gathered = [mine]
    else:
        gathered = group.comm.allgather(mine)
    failed = [(i, g["error"]) for i, g in enumerate(gathered) if "error" in g]
    if failed:
        raise SourceError("source start-up failed on TP rank(s): "
                          + "; ".join(f"rank {i}: {msg}" for i, msg in failed))
    records = [RankRecord.from_wire(g["record"]) for g in gathered]
    for i, rec in enumerate(records):
        if rec.rank != i:
            raise SourceError(f"start-up exchange: slot {i} holds rank {rec.rank}'s record")
    return records
