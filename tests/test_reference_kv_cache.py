"""The reference engine's KV memory in one process: G1 block manager, G1 <-> model KV, G1 <-> G2, landing zone."""

from __future__ import annotations

import pytest
import torch

from remote_g2.adapters.host_pool import HostPool
from remote_g2.adapters.reference import ModelConfig, ReferenceModel, slice_kv
from remote_g2.adapters.reference.kv_cache import CacheConfig, G1BlockManager, PagedKv, block_layout
from remote_g2.errors import ConfigError
from remote_g2.identity.hashing import chain_block_hashes

H = [bytes([i]) * 8 for i in range(1, 40)]


def test_g1_manager_prefix_match_refs_and_lru_eviction() -> None:
    m = G1BlockManager(4)
    a = m.allocate(3)
    for b, h in zip(a, H):
        m.commit(b, h)
    assert m.match(H[:5]) == a  # longest cached prefix, one more reference each
    m.release(a)
    assert m.available() == 1  # still referenced once by the allocation
    m.release(a)
    assert m.available() == 4 and m.cached() == 3
    # Allocation takes the free block first, then idle cached blocks, least recently released first.
    m.release(m.match([H[0]]))  # H[0]'s block becomes the most recently used
    got = m.allocate(3)
    assert got[0] not in a and set(got[1:]) == {a[1], a[2]}
    assert m.match(H[:3]) == [a[0]]  # H[1], H[2] were evicted, so the prefix stops after H[0]
    with pytest.raises(RuntimeError):
        m.allocate(2)


def test_g1_manager_commit_keeps_the_first_block_of_a_hash() -> None:
    m = G1BlockManager(2)
    x, y = m.allocate(2)
    m.commit(x, H[0])
    m.commit(y, H[0])  # the same contents computed twice: the first block stays the cached one
    m.release([x, y])
    assert m.match([H[0]]) == [x]
    assert m.available() == 1  # y went back to the free list, x is referenced again


@pytest.mark.parametrize("mla", [False, True])
def test_scatter_then_gather_returns_the_models_kv_bits(mla: bool) -> None:
    cfg = ModelConfig.mla_default() if mla else ModelConfig()
    model = ReferenceModel(cfg)
    kv = PagedKv(cfg, CacheConfig(g1_blocks=8, g2_blocks=8, landing_blocks=2), model.local_kv_heads)
    out = model.prefill(list(range(50)))
    blocks = [5, 2, 7, 0]
    kv.scatter(blocks, 0, slice_kv(out.kv, tokens=slice(0, 20)))  # ragged: 16 + 4 tokens
    kv.scatter(blocks, 20, slice_kv(out.kv, tokens=slice(20, 50)))
    back = kv.gather(blocks, 50)
    assert back is not None
    for (k0, v0), (k1, v1) in zip(out.kv, back):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert kv.gather(blocks, 0) is None


def test_write_through_onboard_and_landing_zone() -> None:
    cfg = ModelConfig()
    cache = CacheConfig(tokens_per_block=16, g1_blocks=8, g2_blocks=4, landing_blocks=2)
    kv = PagedKv(cfg, cache, 2)
    assert list(kv.landing_slot_ids()) == [4, 5]
    kv.g1.normal_()
    hashes = chain_block_hashes(list(range(64)), 16)
    kv.store_g2(hashes, [0, 1, 2, 3])
    assert len(kv.g2) == 4
    assert kv.onboard_g2(hashes + [H[0]], [4, 5, 6, 7, 3]) == 4  # the prefix G2 holds
    assert torch.equal(kv.g1[4:8], kv.g1[0:4]) and kv.g2.stats()["pinned_blocks"] == 0
    # More stores evict LRU blocks but never use the landing zone.
    for i, h in enumerate(H[:6]):
        kv.store_g2([h], [i])
    assert len(kv.g2) == 4 and all(kv.g2.lookup(h) in range(4) for h in H[2:6])
    # A remote read lands in slots 4 and 5; land copies exactly those bytes into G1.
    kv.g2.block_view(4).view(torch.float32).fill_(1.5)
    kv.g2.block_view(5).view(torch.float32).fill_(-2.0)
    kv.land([5, 4], [6, 1])
    assert bool((kv.g1[6] == -2.0).all()) and bool((kv.g1[1] == 1.5).all())


def test_host_pool_reserved_blocks_are_never_cached() -> None:
    layout = block_layout(ModelConfig(), CacheConfig(g2_blocks=3, landing_blocks=2), 1)
    pool = HostPool(layout, reserved_blocks=2)
    ids = pool.store(H[:10][:3])
    assert sorted(ids) == [0, 1, 2]
    for h in H[3:10]:
        assert pool.store([h])[0] in (0, 1, 2)
    with pytest.raises(ValueError):
        HostPool(layout, reserved_blocks=layout.num_blocks)


def test_cache_config_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        CacheConfig(g1_blocks=0)
