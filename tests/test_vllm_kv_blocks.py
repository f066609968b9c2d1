"""Block copies between vLLM-shaped KV tensors and a G2 pool (torch only; no vLLM needed)."""

from __future__ import annotations

import pytest
import torch
from remote_g2.adapters.host_pool import HostPool
from remote_g2.adapters.vllm.kv_blocks import VllmKvLayout, layer_order

from remote_g2.errors import ConfigError

B, H, N, D = 6, 2, 32, 8


def _cpu_caches(layers: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(B, H, N, 2 * D, generator=gen) for i in (2, 0, 1)[:layers]}


def test_layers_are_ordered_by_their_index_not_by_name() -> None:
    assert layer_order(["m.layers.10.attn", "m.layers.2.attn", "m.layers.1.attn"]) == \
        ["m.layers.1.attn", "m.layers.2.attn", "m.layers.10.attn"]


def test_cpu_layout_gather_matches_the_backends_own_k_and_v_split() -> None:
    caches = _cpu_caches()
    kv = VllmKvLayout.from_kv_caches(caches, block_size=N)
    assert (kv.kind, kv.num_blocks, kv.kv_heads, kv.block_size, kv.head_dim) == ("cpu", B, H, N, D)
    got = kv.gather([4, 1])
    for layer, name in enumerate(kv.names):
        # vLLM's CPU attention: view [B, H, 2N, D] and chunk dim 2 into K and V.
        k, v = caches[name].view(B, H, 2 * N, D).chunk(2, dim=2)
        for i, b in enumerate([4, 1]):
            assert torch.equal(got[i, layer, 0], k[b]) and torch.equal(got[i, layer, 1], v[b])


def test_scatter_through_a_g2_pool_round_trips_the_bytes() -> None:
    src = _cpu_caches()
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    a, b = VllmKvLayout.from_kv_caches(src, N), VllmKvLayout.from_kv_caches(dst, N)
    pool = HostPool(a.g2_layout(8), reserved_blocks=2)
    assert pool.layout.block_bytes == 3 * 2 * H * N * D * 4
    pool.store([b"h1", b"h2"], list(a.gather([3, 5])))
    rows = a.pool_view(pool.tensor)[torch.as_tensor([pool.lookup(b"h1"), pool.lookup(b"h2")])]
    b.scatter([0, 2], rows)
    for name in src:
        assert torch.equal(dst[name][0], src[name][3]) and torch.equal(dst[name][2], src[name][5])
        assert not dst[name][1].any() and not dst[name][3:].any()


def test_kv_first_nhd_layout_is_recognised() -> None:
    t = torch.randn(2, B, N, H, D)
    kv = VllmKvLayout.from_kv_caches({"l.0": t}, N)
    assert kv.kind == "kv_first_nhd"
    got = kv.gather([2])
    assert torch.equal(got[0, 0, 0], t[0, 2].transpose(0, 1)) and torch.equal(got[0, 0, 1], t[1, 2].transpose(0, 1))


def test_unknown_or_mixed_layouts_are_refused_with_the_shape() -> None:
    with pytest.raises(ConfigError, match=r"\(6, 7\)"):
        VllmKvLayout.from_kv_caches({"l.0": torch.zeros(6, 7)}, N)
    with pytest.raises(ConfigError, match="differ"):
        VllmKvLayout.from_kv_caches({"l.0": torch.zeros(B, H, N, 2 * D), "l.1": torch.zeros(B, H, N, 4 * D)}, N)
    with pytest.raises(ConfigError, match="no KV cache"):
        VllmKvLayout.from_kv_caches({}, N)
