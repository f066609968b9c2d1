"""The engine-facing contract of a rank's secondary (G2) pool.

An engine adapter implements :class:`SecondaryPool` once per TP rank; the
source service (``remote_g2.source``) serves remote reads from it and the
registry publisher mirrors its contents. :class:`remote_g2.adapters.host_pool.HostPool`
is the first implementation (a :class:`~remote_g2.memory.pool_index.PoolIndex` over
one host buffer); the reference engine uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from remote_g2.protocol.messages import BlockLayout

__all__ = ["SecondaryPool", "MemoryRegion", "BlockLayout", "PoolListener", "PoolEventKind"]

PoolEventKind = Literal["stored", "removed", "cleared"]
#: ``listener(kind, hashes)``: called after blocks were stored or evicted/removed.
PoolListener = Callable[[PoolEventKind, Sequence[bytes]], None]


@dataclass(frozen=True)
class MemoryRegion:
    """A registered span of the pool: ``base`` address, length, and NIXL memory type."""

    base: int
    nbytes: int
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: int = 0


@runtime_checkable
class SecondaryPool(Protocol):
    """One TP rank's G2 pool, as the source service sees it.

    Thread-safety: every method may be called from the source's RPC threads
    while the engine keeps storing and evicting; ``find_and_pin`` is atomic
    with respect to eviction (a pinned block is never evicted or overwritten).
    """

    @property
    def layout(self) -> BlockLayout:
        """How blocks sit in :meth:`regions` (bytes per block per rank, slab structure)."""
        ...

    def regions(self) -> list[MemoryRegion]:
        """The memory to register with NIXL; block ``b`` starts at ``regions()[0].base + b * block_bytes``."""
        ...

    def find_and_pin(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest present prefix of ``hashes``, each pinned once more (atomic)."""
        ...

    def pin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        """Pin each block once more; all-or-nothing."""
        ...

    def unpin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        """Drop one pin from each block; raises and changes nothing if one is not pinned."""
        ...

    def block_hashes(self) -> list[bytes]:
        """Every hash the pool caches now (the registry resync snapshot)."""
        ...

    def add_listener(self, listener: PoolListener) -> None:
        """Call ``listener(kind, hashes)`` after every store / eviction, in order (possibly from another pool caller's thread)."""
        ...
