"""A rank's TP group: its rank, the group size, and the communicator scoped to the group.

Both the source service and the target client run in every TP rank of a
worker and use MPI only at start-up, over the TP group's communicator (never
MPI world: attention-DP worlds hold several TP groups). Without a
communicator the group is MPI world split by TP group (color
``world_rank // tp_size``); a caller that knows its TP group passes its
communicator instead. ``tp_size == 1`` with no communicator needs no MPI at
all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remote_g2.errors import ConfigError

__all__ = ["TpGroup", "resolve_tp_group"]


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
