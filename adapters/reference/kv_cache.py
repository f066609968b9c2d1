"""The reference engine's paged KV cache: G1 blocks, the G2 host pool, and the copies between them.

Tiers
-----
* **G1** (primary, "device" memory — host memory here, there is no GPU) is one
  float32 tensor per rank, ``[g1_blocks, layers, 2, local_kv_heads,
  tokens_per_block, head_dim]``: block-major, then head-major inside each
  (layer, K/V) slab, so a block's bytes are exactly a G2 block's bytes and a
  head range is contiguous (the ``HND`` :class:`~remote_g2.protocol.messages.BlockLayout`).
* **G2** (secondary, host) is a :class:`~remote_g2.adapters.host_pool.HostPool`
  per rank: the :class:`~remote_g2.memory.pool_index.PoolIndex` keeps hash → block,
  the pins, and the LRU order; eviction never touches a pinned block. Its last
  ``landing_blocks`` blocks are reserved: remote READs land there (same ids on
  every rank, chosen by the leader) and are then onboarded into G1 and stored
  into the cache proper like any other block.

Who decides what
----------------
G1 is touched only by the engine's own steps, which every rank runs in the
same order, so the leader's :class:`G1BlockManager` decides G1 block ids for
every rank. G2 is different: a remote target pins a rank's G2 blocks at its
own pace, so two ranks' pools can make different eviction choices. Steps
therefore name G2 blocks by *hash* and each rank resolves them in its own
pool; where ranks disagree (one rank lost a block the others still hold) the
engine takes the prefix every rank has (an allgather) and recomputes the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from remote_g2.adapters.host_pool import HostPool

from remote_g2.errors import ConfigError
from remote_g2.identity.hashing import chain_hash_scheme
from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint

from .config import KV, KV_DTYPE, ModelConfig
from .weights import weights_model_id

__all__ = ["CacheConfig", "G1BlockManager", "PagedKv", "block_layout", "fingerprint"]


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the two tiers, in blocks of ``tokens_per_block`` tokens (the same on every rank)."""

    tokens_per_block: int = 16
    g1_blocks: int = 512
    g2_blocks: int = 1024
    landing_blocks: int = 256

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "g1_blocks", "g2_blocks", "landing_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")


def block_layout(model: ModelConfig, cache: CacheConfig, local_kv_heads: int) -> BlockLayout:
    """One rank's G2 layout: ``layers × {K, V}`` slabs of ``local_kv_heads`` heads, head-major, float32."""
    per_slab = local_kv_heads * cache.tokens_per_block * model.head_dim * 4
    return BlockLayout(num_blocks=cache.g2_blocks + cache.landing_blocks,
                       block_bytes=model.num_layers * 2 * per_slab, num_layers=model.num_layers, kv=2,
                       num_kv_heads=local_kv_heads, tokens_per_block=cache.tokens_per_block,
                       head_dim=model.head_dim, dtype_bytes=4, order="HND")


def fingerprint(model: ModelConfig, cache: CacheConfig, tp_size: int,
                kv_dtype: torch.dtype = KV_DTYPE) -> LayoutFingerprint:
    """What a peer's blocks must match to be usable here (every field but ``tp_size``).

    ``kv_dtype`` is the dtype of the KV tensors as allocated (the executor
    passes its own G1 tensor's), so the fingerprint states what the bytes are.
    """
    return LayoutFingerprint(model_id=weights_model_id(model), dtype=str(kv_dtype).removeprefix("torch."),
                             tokens_per_block=cache.tokens_per_block, kv_layout="HND",
                             num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                             tp_size=tp_size, is_mla=model.mla, hash_scheme=chain_hash_scheme())


class G1BlockManager:
    """The leader's map of G1: free blocks, the prefix cache (hash → block), references, LRU.

    A block is *free* (on the free list), *in use* (referenced by running
    requests; possibly also cached) or *cached idle* (no reference, still
    found by its hash, evicted least-recently-released first when a new block
    is needed). Not thread-safe: the leader's engine loop owns it.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    def available(self) -> int:
        """Blocks :meth:`allocate` can hand out now (free + cached idle)."""
        return len(self._free) + len(self._idle)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes``, each referenced once more."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            self._ref(b)
            out.append(b)
        return out

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, referenced once: free ones first, then the least recently used idle ones.

        ``MemoryError``-free contract: raises ``RuntimeError`` (and takes nothing)
        when fewer than ``n`` are available; the scheduler checks first.
        """
        if n > self.available():
            raise RuntimeError(f"G1 has {self.available()} blocks available, {n} asked")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._idle.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def commit(self, block: int, block_hash: bytes) -> None:
        """Make ``block`` (referenced, full) findable by ``block_hash``, unless another block has it already."""
        if block_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; an unreferenced block becomes idle (cached) or free."""
        for b in blocks:
            left = self._refs[b] - 1
            if left:
                self._refs[b] = left
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._idle[b] = None
            else:
                self._free.append(b)

    def cached(self) -> int:
        return len(self._by_hash)

    def _ref(self, b: int) -> None:
        self._refs[b] = self._refs.get(b, 0) + 1
        self._idle.pop(b, None)


class PagedKv:
    """One rank's KV memory: the G1 tensor and the G2 pool, with the copies between them and the model.

    Every method acts on this rank's memory only; the leader's plan says
    which blocks, so every rank does the same thing to its own heads.
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, local_kv_heads: int) -> None:
        self.model, self.cache = model, cache
        self.tpb = cache.tokens_per_block
        self.layout = block_layout(model, cache, local_kv_heads)
        self.g1 = torch.zeros((cache.g1_blocks, model.num_layers, 2, local_kv_heads, self.tpb, model.head_dim),
                              dtype=KV_DTYPE)
        self.g2 = HostPool(self.layout, reserved_blocks=cache.landing_blocks)
        self.g2.prefault()  # landing blocks first: no READ or store pays the pool's first touch
        self._g2_blocks = self.g2.tensor.view(KV_DTYPE).view(self.layout.num_blocks, *self.g1.shape[1:])

    # -- G1 <-> model ---------------------------------------------------------------------

    def gather(self, blocks: Sequence[int], tokens: int) -> KV | None:
        """The KV of the first ``tokens`` positions held in ``blocks``, as the model's ``past_kv``."""
        if tokens == 0:
            return None
        need = -(-tokens // self.tpb)
        # [n, L, 2, H, tpb, D] -> [L, 2, H, n * tpb, D]
        kv = self.g1[list(blocks[:need])].permute(1, 2, 3, 0, 4, 5).reshape(
            self.model.num_layers, 2, self.g1.shape[3], need * self.tpb, self.model.head_dim)
        return [(kv[i, 0, :, :tokens].contiguous(), kv[i, 1, :, :tokens].contiguous())
                for i in range(self.model.num_layers)]

    def scatter(self, blocks: Sequence[int], start_pos: int, kv: KV) -> None:
        """Write the model's new KV of positions ``start_pos..`` into the request's ``blocks``."""
        n = kv[0][0].shape[1]
        pos = start_pos
        while pos < start_pos + n:
            b, off = divmod(pos, self.tpb)
            take = min(self.tpb - off, start_pos + n - pos)
            src = slice(pos - start_pos, pos - start_pos + take)
            dst = self.g1[blocks[b]]
            for i, (k, v) in enumerate(kv):
                dst[i, 0, :, off:off + take] = k[:, src]
                dst[i, 1, :, off:off + take] = v[:, src]
            pos += take

    # -- G1 <-> G2 ------------------------------------------------------------------------

    def store_g2(self, hashes: Sequence[bytes], g1_blocks: Sequence[int]) -> None:
        """Write-through: cache the G1 blocks' bytes in G2 under their hashes (evicting LRU unpinned)."""
        self.g2.store(list(hashes), [self.g1[b] for b in g1_blocks])

    def onboard_g2(self, hashes: Sequence[bytes], g1_blocks: Sequence[int]) -> int:
        """Copy the longest G2-cached prefix of ``hashes`` into ``g1_blocks``; return how many blocks.

        The blocks are pinned while copied, so a concurrent eviction cannot
        hand their memory to another hash mid-copy.
        """
        found = self.g2.find_and_pin(list(hashes))
        try:
            self._copy_to_g1(found, g1_blocks[:len(found)])
        finally:
            if found:
                self.g2.unpin_blocks_by_id(found)
        return len(found)

    def land(self, slots: Sequence[int], g1_blocks: Sequence[int]) -> None:
        """Remote blocks read into landing ``slots``: copy them into G1 (the slots are free again after).

        Caching them in G2 proper is left to the write-through after the
        request's first token, off the time-to-first-token path.
        """
        self._copy_to_g1(slots, g1_blocks)

    def _copy_to_g1(self, g2_blocks: Sequence[int], g1_blocks: Sequence[int]) -> None:
        if len(g2_blocks):
            # One gather-scatter, not a copy per block.
            self.g1[torch.as_tensor(list(g1_blocks))] = self._g2_blocks[torch.as_tensor(list(g2_blocks))]

    def landing_slot_ids(self) -> range:
        return self.g2.reserved_block_ids
