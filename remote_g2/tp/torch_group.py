"""A ``torch.distributed`` process group as a TP group's communicator, for engines whose ranks are not MPI ranks.

The source service and the target client use their TP group's communicator
once, at start-up, for one allgather (:mod:`remote_g2.tp.group`); anything
with ``Get_rank()``, ``Get_size()`` and ``allgather(obj)`` serves. MPI is the
default (the reference engine and TensorRT-LLM launch with ``mpiexec``).
vLLM's workers are processes of its own, joined by ``torch.distributed``: its
TP group carries a CPU (gloo) group, and :class:`TorchGroupComm` wraps such a
group. Use a CPU group: a collective on a GPU (NCCL) group would move the
start-up records through device memory.

The records go through ``torch.distributed.all_gather_object``, which
pickles them: they travel between the worker's own processes over the
group's private transport, never over a socket a remote client can reach.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TorchGroupComm"]


class TorchGroupComm:
    """``group``: a ``torch.distributed`` process group (None: the default group). Collective, like MPI's."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            from remote_g2.errors import ConfigError

            raise ConfigError("torch.distributed is not initialized: init_process_group first (or pass an MPI comm)")
        self._dist = dist
        self._group = group

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's spelling: the TP-group interface)
        return int(self._dist.get_rank(self._group))

    def Get_size(self) -> int:  # noqa: N802
        return int(self._dist.get_world_size(self._group))

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (collective: every rank of the group calls it)."""
        out: list[Any] = [None] * self.Get_size()
        self._dist.all_gather_object(out, obj, group=self._group)
        return out
