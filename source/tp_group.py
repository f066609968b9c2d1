"""The TP group a source rank belongs to, and the one start-up exchange over it.

MPI is used exactly once, at start-up: :func:`exchange` allgathers each
rank's :class:`RankRecord` (or the error that kept it from building one) over
the TP group's communicator. MPICH spins a whole core while a rank waits in a
collective, so nothing here ever waits in MPI after start-up; the ranks talk
over ZMQ from then on.

Without a communicator the group is MPI world split by TP group (color
``world_rank // tp_size``), so attention-DP worlds, where MPI world holds
several TP groups, work. A caller that knows its TP group passes its
communicator instead. ``tp_size == 1`` with no communicator needs no MPI at
all.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from remote_g2.errors import ConfigError, SourceError
from remote_g2.messages import BlockLayout

__all__ = ["TpGroup", "RankRecord", "resolve_tp_group", "exchange"]

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

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layout"] = dataclasses.asdict(self.layout)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankRecord:
        return cls(**{**d, "layout": BlockLayout(**d["layout"])})


@dataclass(frozen=True)
class TpGroup:
    """This rank's place in its TP group; ``comm`` is None for a group of one without MPI."""

    rank: int
    size: int
    comm: Any = None


def resolve_tp_group(tp_rank: int | None, tp_size: int | None, comm: Any = None) -> TpGroup:
    """Fill in ``tp_rank`` / ``tp_size`` / ``comm`` from MPI where the caller gave none.

    Creating the default communicator is collective over MPI world: every
    world rank must call this (each engine rank starts its source service).
    """
    if comm is not None:
        rank, size = comm.Get_rank(), comm.Get_size()
        if (tp_rank is not None and tp_rank != rank) or (tp_size is not None and tp_size != size):
            raise ConfigError(f"tp_rank/tp_size {tp_rank}/{tp_size} do not match the communicator's "
                              f"rank/size {rank}/{size}")
        return TpGroup(rank, size, comm)
    if tp_size == 1 and tp_rank in (None, 0):
        return TpGroup(0, 1, None)
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ConfigError(f"tp_size={tp_size} needs mpi4py to find the TP group ({e})") from e
    world = MPI.COMM_WORLD
    world_rank, world_size = world.Get_rank(), world.Get_size()
    size = world_size if tp_size is None else tp_size
    if size < 1 or world_size % size:
        raise ConfigError(f"MPI world of {world_size} ranks cannot be split into TP groups of {size}")
    group_comm = world if size == world_size else world.Split(color=world_rank // size, key=world_rank)
    rank = group_comm.Get_rank()
    if tp_rank is not None and tp_rank != rank:
        raise ConfigError(f"tp_rank {tp_rank} is not this process' rank {rank} in its TP group "
                          f"(world rank {world_rank}, groups of {size})")
    return TpGroup(rank, size, group_comm)


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
