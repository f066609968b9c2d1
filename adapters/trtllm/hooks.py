"""Starting remote-g2 from TensorRT-LLM's executor: one call per TP rank, after the KV cache manager exists.

::

    from remote_g2.adapters.trtllm import start_remote_g2
    hooks = start_remote_g2(kv_cache_manager, worker_id="node7-engine0", executor=self)  # in PyExecutor.__init__
    ...
    hooks.pool.notify("stored", u64_hashes)   # from the executor's KV-cache events for the secondary pool
    hooks.shutdown()                          # in PyExecutor.shutdown

Not run against TensorRT-LLM (no GPU here); see :mod:`.pool`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remote_g2.messages import BlockLayout

from .pool import TrtllmSecondaryPool, tp_from_executor

__all__ = ["RemoteG2Hooks", "start_remote_g2"]


@dataclass
class RemoteG2Hooks:
    """What :func:`start_remote_g2` started on this rank (each hook None when disabled)."""

    pool: TrtllmSecondaryPool
    source: Any
    target: Any
    tp_rank: int
    tp_size: int

    def shutdown(self) -> None:
        for hook in (self.target, self.source):
            if hook is not None:
                hook.shutdown()
        self.target = self.source = None


def start_remote_g2(kv_cache_manager: Any, *, worker_id: str, executor: Any = None, comm: Any = None,
                    layout: BlockLayout | None = None, source_config: Any = None,
                    target_config: Any = None) -> RemoteG2Hooks:
    """Wrap the manager's secondary pool and start the source service and target client when enabled.

    ``tp_rank``/``tp_size`` come from ``executor.mapping`` (or ``.dist``),
    else MPI world. Each hook follows its config or, when None, the
    ``REMOTE_G2_SOURCE*`` / ``REMOTE_G2_TARGET*`` environment. Collective over
    the TP group (every rank calls it).
    """
    from remote_g2.source import maybe_start_source_service
    from remote_g2.target import maybe_start_target_client

    pool = TrtllmSecondaryPool(kv_cache_manager, layout=layout)
    tp_rank, tp_size = tp_from_executor(executor)
    source = maybe_start_source_service(pool, worker_id=worker_id, tp_rank=tp_rank, tp_size=tp_size,
                                        config=source_config, comm=comm)
    try:
        target = maybe_start_target_client(pool, worker_id=worker_id, tp_rank=tp_rank, tp_size=tp_size,
                                           config=target_config, comm=comm)
    except BaseException:
        if source is not None:
            source.shutdown()
        raise
    return RemoteG2Hooks(pool, source, target, tp_rank, tp_size)
