"""The reference model's tensor-parallel communicator: rank, size and an allgather, nothing more.

:class:`TpComm` wraps an mpi4py communicator scoped to one TP group (never
assume MPI world: attention-DP worlds hold several groups; build it from a
:class:`remote_g2.tp.group.TpGroup` with :meth:`TpComm.from_group`). A group
of one needs no MPI at all: ``TpComm()`` is rank 0 of 1 and its allgather is
a no-op that adds the leading rank axis.

Only allgather is offered, on purpose. The model never lets MPI add numbers
(an allreduce's summation order is MPICH's choice and may change with the
group size or the message size); it gathers every rank's partial result and
adds them itself in rank order (see ``model.py`` for why that sum is exact).

MPICH ranks blocked in an MPI call spin at 100 % CPU. Every collective here
is issued by all ranks of the group at the same point of the same forward, so
a rank waits only for the slowest sibling's share of that forward; nothing in
this module waits for work that has not started.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["TpComm"]

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


class TpComm:
    """Rank ``rank`` of a TP group of ``size`` ranks over ``comm`` (None: a group of one, no MPI)."""

    def __init__(self, comm: Any = None) -> None:
        self.comm = comm
        if comm is None:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = int(comm.Get_rank()), int(comm.Get_size())

    @classmethod
    def from_group(cls, group: Any) -> TpComm:
        """The communicator of a :class:`remote_g2.tp.group.TpGroup` (``rank``/``size``/``comm``)."""
        comm = cls(group.comm)
        if (comm.rank, comm.size) != (group.rank, group.size):
            raise ValueError(f"TpGroup says rank {group.rank} of {group.size}, its communicator says "
                             f"{comm.rank} of {comm.size}")
        return comm

    @classmethod
    def world(cls) -> TpComm:
        """MPI world as one TP group (tests and single-group launches under ``mpiexec``)."""
        from mpi4py import MPI

        return cls(MPI.COMM_WORLD)

    def allgather(self, x: ArrayT) -> ArrayT:
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``, same type and dtype.

        Collective: every rank of the group calls it with the same shape and
        dtype. The bytes are moved unchanged (no arithmetic), so the result is
        bit-identical on every rank. For ``size == 1`` no copy is made.
        """
        if isinstance(x, torch.Tensor):
            if self.size == 1:
                return x.unsqueeze(0)
            if x.device.type != "cpu":
                raise ValueError(f"allgather takes CPU tensors, got one on {x.device}")
            return torch.from_numpy(self._allgather_numpy(x.detach().contiguous().numpy()))
        if self.size == 1:
            return x[np.newaxis]
        return self._allgather_numpy(np.ascontiguousarray(x))

    def _allgather_numpy(self, send: np.ndarray) -> np.ndarray:
        recv = np.empty((self.size, *send.shape), dtype=send.dtype)
        self.comm.Allgather(send, recv)
        return recv

    def __repr__(self) -> str:
        return f"TpComm(rank={self.rank}, size={self.size})"
