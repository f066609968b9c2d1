"""Block hashes: validation, hex for people, u64 packing, and the reference chain hash.

A block hash is opaque bytes, 1..32 long. TensorRT-LLM and Dynamo hash blocks
to a u64, which travels as 8 bytes big-endian; vLLM's SHA-256 block hash is
32 bytes. People see lowercase hex.

The reference engine chains hashes so equal hashes mean equal prefixes:
``h_i = H(h_{i-1} || token_ids_of_block_i || extra_keys)``, with ``H`` BLAKE2b
truncated to ``digest_size`` bytes (8 by default: the u64 fast path of the
pool index).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = [
    "MIN_HASH_LEN",
    "MAX_HASH_LEN",
    "check_block_hash",
    "hash_to_hex",
    "hash_from_hex",
    "u64_to_hash",
    "hash_to_u64",
    "chain_block_hashes",
    "chain_hash_scheme",
]

MIN_HASH_LEN = 1
MAX_HASH_LEN = 32
_U64 = struct.Struct(">Q")


def check_block_hash(h: object) -> bytes:
    """Return ``h`` if it is a valid block hash, else raise ValueError."""
    if not isinstance(h, bytes):
        raise ValueError(f"a block hash is bytes, not {type(h).__name__}")
    if not MIN_HASH_LEN <= len(h) <= MAX_HASH_LEN:
        raise ValueError(f"a block hash is {MIN_HASH_LEN}..{MAX_HASH_LEN} bytes, got {len(h)}")
    return h


def hash_to_hex(h: bytes) -> str:
    """Lowercase hex, as the CLI shows hashes."""
    return h.hex()


def hash_from_hex(text: str) -> bytes:
    """Parse hex as the CLI accepts it (``0x`` prefix and upper case allowed)."""
    t = text.strip().lower()
    if t.startswith("0x"):
        t = t[2:]
    try:
        h = bytes.fromhex(t)
    except ValueError:
        raise ValueError(f"not a hex block hash: {text!r}") from None
    return check_block_hash(h)


def u64_to_hash(value: int) -> bytes:
    """A u64 block hash (TensorRT-LLM, Dynamo) as its 8-byte big-endian wire form."""
    if not 0 <= value < 2**64:
        raise ValueError(f"u64 block hash out of range: {value}")
    return _U64.pack(value)


def hash_to_u64(h: bytes) -> int:
    """Inverse of :func:`u64_to_hash`; the hash must be exactly 8 bytes."""
    if len(h) != 8:
        raise ValueError(f"a u64 block hash is 8 bytes, got {len(h)}")
    return int(_U64.unpack(h)[0])


def chain_hash_scheme(digest_size: int = 8) -> str:
    """The :attr:`~remote_g2.protocol.messages.LayoutFingerprint.hash_scheme` of :func:`chain_block_hashes`' hashes."""
    return f"remote-g2/blake2b-{8 * digest_size}"


def chain_block_hashes(
    token_ids: Sequence[int],
    tokens_per_block: int,
    *,
    extra_keys: bytes = b"",
    parent: bytes = b"",
    digest_size: int = 8,
) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``, each chained on its parent.

    A trailing partial block is not hashed (it cannot be shared). ``parent`` lets a
    caller continue a chain; ``extra_keys`` folds in what else makes KV differ
    (LoRA id, multimodal hashes, cache salt).
    """
    if tokens_per_block <= 0:
        raise ValueError("tokens_per_block must be positive")
    if not MIN_HASH_LEN <= digest_size <= MAX_HASH_LEN:
        raise ValueError(f"digest_size must be {MIN_HASH_LEN}..{MAX_HASH_LEN}")
    out: list[bytes] = []
    prev = parent
    full = len(token_ids) - len(token_ids) % tokens_per_block
    for start in range(0, full, tokens_per_block):
        block = token_ids[start:start + tokens_per_block]
        h = hashlib.blake2b(digest_size=digest_size)
        h.update(len(prev).to_bytes(1, "little"))
        h.update(prev)
        h.update(struct.pack(f"<{len(block)}q", *block))
        h.update(extra_keys)
        prev = h.digest()
        out.append(prev)
    return out

