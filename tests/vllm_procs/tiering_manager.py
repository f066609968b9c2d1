"""vLLM's real ``TieringOffloadingManager`` without an engine, as tier_proc.py and p2p_proc.py build it.

One KV-cache group of two layers, 16-token blocks, one block a chunk (a row of the primary region is
``block_bytes``), the CPU primary tier over vLLM's shared ``/dev/shm`` region, and ``tier`` as its one
secondary tier. :func:`chunk_bytes` is the bytes the drivers write into a chunk's row (and check on arrival).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import numpy as np
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


def build_manager(block_bytes: int, cpu_bytes: int, tier: dict[str, Any], engine_id: str | None,
                  prefix: str) -> tuple[Any, Any, np.ndarray]:
    """``(spec, manager, rows)``: ``rows`` is the primary region as (rows, row bytes) of uint8, vLLM's memory
    (drop every view of it before ``manager.shutdown()``: vLLM cannot unmap a region still exported)."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_bytes, "blocks_per_chunk": 1, "secondary_tiers": [tier]},
        engine_id=engine_id or f"{prefix}-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig("tiny", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True))
    spec = TieringOffloadingSpec(config)
    manager = spec.get_manager()
    return spec, manager, np.asarray(manager.primary_tier.get_kv_memoryview())


def chunk_bytes(seed: int, key: bytes, n: int) -> bytes:
    """``n`` bytes determined by ``seed`` and the chunk's ``key`` (a SHA-256 chain)."""
    out = bytearray()
    block = hashlib.sha256(seed.to_bytes(8, "big") + key).digest()
    while len(out) < n:
        out += block
        block = hashlib.sha256(block).digest()
    return bytes(out[:n])
