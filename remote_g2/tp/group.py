"""A rank's TP group: its rank, the group size, and the communicator scoped to the group.

Both the source service and the target client run in every TP rank of a
worker and use MPI only at start-up, over the TP group's communicator (never
MPI world: attention-DP worlds hold several TP groups). Without a
communicator the group is MPI world split by TP group (color
``world_rank // tp_size``); a caller that knows its TP group passes its
communicator instead. ``tp_size == 1`` with no communicator needs no MPI at
all.

The source service uses MPI exactly once, at start-up: :func:`exchange`
allgathers each rank's :class:`RankRecord` (or the error that kept it from
building one) over the TP group's communicator. MPICH spins a whole core
while a rank waits in a collective, so nothing here ever waits in MPI after
start-up; the ranks talk over ZMQ from then on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from remote_g2.errors import ConfigError, SourceError
from remote_g2.protocol.messages import BlockLayout

__all__ = ["TpGroup", "resolve_tp_group", "RankRecord", "exchange"]


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
    staging_base: int = 0  # the rank's staging region (source/staging.py); 0 bytes: it never gathers
    staging_bytes: int = 0

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
