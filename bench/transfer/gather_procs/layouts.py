"""The layouts and bytes the gather benchmark's source and target agree on (``bench/transfer/bench_gather.py``)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint

__all__ = ["layout_for", "fingerprint_for", "hash_of", "block_stream", "layout_dict"]


def layout_for(spec: dict, tp: int, num_blocks: int) -> BlockLayout:
    """One rank's HND layout of ``spec`` (``layers``, ``kv_heads`` in all, ``head_dim``, ``tokens``,
    ``dtype_bytes``) at TP ``tp``: ``kv_heads / tp`` heads per rank, no padding."""
    heads = spec["kv_heads"] // tp
    if heads < 1 or heads * tp != spec["kv_heads"]:
        raise ValueError(f"{spec['kv_heads']} kv heads do not split over TP {tp}")
    slab = heads * spec["tokens"] * spec["head_dim"] * spec["dtype_bytes"]
    return BlockLayout(num_blocks=num_blocks, block_bytes=spec["layers"] * 2 * slab, num_layers=spec["layers"], kv=2,
                       num_kv_heads=heads, tokens_per_block=spec["tokens"], head_dim=spec["head_dim"],
                       dtype_bytes=spec["dtype_bytes"], order="HND")


def fingerprint_for(spec: dict, tp: int) -> LayoutFingerprint:
    return LayoutFingerprint(model_id=spec["name"], dtype="bf16" if spec["dtype_bytes"] == 2 else "fp32",
                             tokens_per_block=spec["tokens"], kv_layout="HND", num_layers=spec["layers"],
                             num_kv_heads=spec["kv_heads"], head_dim=spec["head_dim"], tp_size=tp)


def hash_of(tag: int, i: int) -> bytes:
    """The ``i``-th block hash of configuration ``tag`` (a u64, big-endian)."""
    return ((0x6A7 << 52) | (tag << 32) | i).to_bytes(8, "big")


def block_stream(rank: int, tag: int, nbytes: int) -> np.ndarray:
    """What source rank ``rank`` holds for configuration ``tag``: hash ``i`` is bytes ``[i*bb, (i+1)*bb)``."""
    return np.random.default_rng([0x6A7, rank, tag]).integers(0, 256, nbytes, dtype=np.uint8)


def layout_dict(layout: BlockLayout) -> dict:
    return asdict(layout)
