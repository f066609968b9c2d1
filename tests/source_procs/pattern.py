"""What the synthetic source pools hold, so a reader in another process can check every byte.

Block ``hash`` on TP rank ``rank`` holds :func:`block_bytes_for` ``(rank, hash)``:
pseudo-random bytes seeded by both, so a block read from the wrong rank, the
wrong block or a stale slot never matches by accident.
"""

from __future__ import annotations

import hashlib

import numpy as np

from remote_g2.protocol.messages import BlockLayout

__all__ = ["make_layout", "hash_of", "block_bytes_for"]


def make_layout(num_blocks: int = 64, num_kv_heads: int = 2) -> BlockLayout:
    """A small HND layout: 2 layers x K/V x heads x 4 tokens x 16 dims x 2 bytes (1 KiB per block at 2 heads)."""
    return BlockLayout(num_blocks=num_blocks, block_bytes=2 * 2 * num_kv_heads * 4 * 16 * 2, num_layers=2, kv=2,
                       num_kv_heads=num_kv_heads, tokens_per_block=4, head_dim=16, dtype_bytes=2, order="HND")


def hash_of(i: int) -> bytes:
    """The ``i``-th block hash of the synthetic prompt (a u64, 8 bytes big-endian)."""
    return (0x5EED_0000_0000_0000 + i).to_bytes(8, "big")


def block_bytes_for(rank: int, block_hash: bytes, nbytes: int) -> np.ndarray:
    """The ``nbytes`` a block caching ``block_hash`` holds on TP rank ``rank``."""
    seed = int.from_bytes(hashlib.blake2b(bytes([rank]) + block_hash, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
