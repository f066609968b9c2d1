"""The TensorRT-LLM adapter against stand-ins shaped like TensorRT-LLM's KV cache manager classes.

TensorRT-LLM cannot run here (no GPU), so these stand-ins play its Python
``KVCacheManager`` (sizes as attributes, the C++ binding as ``.impl``) and
that binding (a host secondary pool tensor, hash-keyed find-and-pin, pins by
id), in the method-name variants different builds have. The last test plugs
the adapter into the real source service and resolves/releases over its
real RPC socket.
"""

from __future__ import annotations

import pytest
import torch
from remote_g2.adapters.registry import load_adapter
from remote_g2.adapters.trtllm import (
    TrtllmSecondaryPool,
    detect_api,
    start_remote_g2,
    tp_from_executor,
)
from remote_g2.source import SourceConfig

from remote_g2.errors import ConfigError
from remote_g2.hashing import u64_to_hash
from remote_g2.messages import Release, Resolve
from remote_g2.rpc_client import RpcClient

LAYERS, KV, HEADS, TPB, DIM, BLOCKS = 2, 2, 4, 8, 16, 12


class CppManager:
    """Stand-in for the C++ BaseKVCacheManager binding, newest API."""

    def __init__(self, kv_factor: int = KV) -> None:
        self.pool = torch.zeros(BLOCKS, LAYERS * kv_factor * HEADS * TPB * DIM, dtype=torch.float16)
        self.by_hash: dict[int, int] = {}
        self.pins = [0] * BLOCKS

    def get_unique_secondary_pool(self) -> torch.Tensor:
        return self.pool

    def find_and_pin_secondary_block_by_hash(self, h: int) -> int:
        b = self.by_hash.get(h, -1)
        if b >= 0:
            self.pins[b] += 1
        return b

    def pin_blocks_by_id(self, ids: list[int]) -> None:
        for b in ids:
            self.pins[b] += 1

    def unpin_blocks_by_id(self, ids: list[int]) -> None:
        if any(self.pins[b] == 0 for b in ids):
            raise ValueError("not pinned")
        for b in ids:
            self.pins[b] -= 1

    def get_secondary_block_hashes(self) -> list[int]:
        return list(self.by_hash)


class OlderCppManager:
    """An older binding: no unique-pool getter, no hash listing, pin/unpin under their old names."""

    def __init__(self) -> None:
        self.inner = CppManager()
        self.by_hash, self.pins = self.inner.by_hash, self.inner.pins

    def find_and_pin_secondary_block_by_hash(self, h: int) -> int | None:
        b = self.inner.find_and_pin_secondary_block_by_hash(h)
        return None if b < 0 else b

    def pin_blocks(self, ids: list[int]) -> None:
        self.inner.pin_blocks_by_id(ids)

    def unpin_blocks(self, ids: list[int]) -> None:
        self.inner.unpin_blocks_by_id(ids)


class PyManager:
    """Stand-in for the Python KVCacheManager: sizes as attributes, the binding as ``impl``."""

    def __init__(self, impl: object, **sizes: object) -> None:
        self.impl = impl
        self.num_local_layers = LAYERS
        self.num_kv_heads_per_layer = [HEADS] * LAYERS
        self.tokens_per_block = TPB
        self.head_dim = DIM
        self.kv_factor = KV
        for k, v in sizes.items():
            setattr(self, k, v)


def _fill(impl: CppManager | OlderCppManager, n: int) -> list[bytes]:
    for i in range(n):
        impl.by_hash[1000 + i] = i
    return [u64_to_hash(1000 + i) for i in range(n)]


def test_newest_api_is_found_on_impl_and_layout_read_from_the_manager() -> None:
    impl = CppManager()
    pool = TrtllmSecondaryPool(PyManager(impl))
    assert (pool.api.pool_name, pool.api.find_and_pin_name, pool.api.pin_name, pool.api.unpin_name) == \
        ("impl.get_unique_secondary_pool", "impl.find_and_pin_secondary_block_by_hash", "impl.pin_blocks_by_id",
         "impl.unpin_blocks_by_id")
    lay = pool.layout
    assert (lay.num_blocks, lay.num_layers, lay.kv, lay.num_kv_heads, lay.tokens_per_block, lay.head_dim,
            lay.dtype_bytes, lay.order) == (BLOCKS, LAYERS, KV, HEADS, TPB, DIM, 2, "HND")
    assert lay.block_bytes == LAYERS * KV * HEADS * TPB * DIM * 2
    region, = pool.regions()
    assert (region.base, region.nbytes) == (impl.pool.data_ptr(), BLOCKS * lay.block_bytes)
    hashes = _fill(impl, 5)
    assert pool.find_and_pin(hashes[:3] + [u64_to_hash(7)] + hashes[3:]) == [0, 1, 2]  # stops at the miss
    assert impl.pins[:4] == [1, 1, 1, 0]
    pool.pin_blocks_by_id([0])
    pool.unpin_blocks_by_id([0, 0, 1, 2])
    assert impl.pins == [0] * BLOCKS
    assert sorted(pool.block_hashes()) == sorted(hashes)


def test_older_build_falls_back_to_old_names_and_tracks_hashes_from_events() -> None:
    impl = OlderCppManager()
    manager = PyManager(impl)
    manager.get_secondary_pool = lambda: impl.inner.pool  # this build exposes the pool on the Python wrapper
    pool = TrtllmSecondaryPool(manager)
    assert (pool.api.pool_name, pool.api.pin_name, pool.api.unpin_name, pool.api.hashes_name) == \
        ("manager.get_secondary_pool", "impl.pin_blocks", "impl.unpin_blocks", None)
    hashes = _fill(impl, 3)
    assert pool.find_and_pin(hashes) == [0, 1, 2]
    pool.unpin_blocks_by_id([0, 1, 2])
    seen: list[tuple[str, list[bytes]]] = []
    pool.add_listener(lambda kind, hs: seen.append((kind, list(hs))))
    pool.notify("stored", [1000, 1001])
    pool.notify("removed", [1000])
    assert pool.block_hashes() == [u64_to_hash(1001)]
    assert seen == [("stored", [u64_to_hash(1000), u64_to_hash(1001)]), ("removed", [u64_to_hash(1000)])]


def test_pool_as_an_attribute_and_mla_kv_factor_one() -> None:
    impl = CppManager(kv_factor=1)

    class Binding:  # only attributes and the pin methods
        secondary_pool = impl.pool
        find_and_pin_secondary_block_by_hash = impl.find_and_pin_secondary_block_by_hash
        pin_blocks_by_id = impl.pin_blocks_by_id
        unpin_blocks_by_id = impl.unpin_blocks_by_id

    pool = TrtllmSecondaryPool(PyManager(Binding(), kv_factor=1, num_kv_heads_per_layer=[HEADS, HEADS]))
    assert pool.api.pool_name == "impl.secondary_pool"
    assert (pool.layout.kv, pool.layout.block_bytes) == (1, LAYERS * HEADS * TPB * DIM * 2)


def test_missing_methods_are_named_in_one_clear_error() -> None:
    class Bare:
        def get_unique_secondary_pool(self) -> torch.Tensor:
            return torch.zeros(4, 8)

    with pytest.raises(ConfigError, match=r"missing find_and_pin .*find_and_pin_secondary_block_by_hash.*"
                                          r"pin \(one of pin_blocks_by_id, pin_blocks\)"):
        detect_api(PyManager(Bare()))


def test_layout_problems_ask_for_an_explicit_layout() -> None:
    with pytest.raises(ConfigError, match="different kv head counts"):
        TrtllmSecondaryPool(PyManager(CppManager(), num_kv_heads_per_layer=[4, 2]))
    with pytest.raises(ConfigError, match="pass layout"):
        TrtllmSecondaryPool(PyManager(CppManager(), head_dim=None, tokens_per_block=None))


def test_tp_rank_and_size_come_from_the_executor_else_mpi() -> None:
    class Mapping:
        tp_rank, tp_size = 1, 2

    class Executor:
        mapping = Mapping()

    class DistExecutor:
        class dist:  # noqa: N801 - shaped like PyExecutor.dist
            tp_rank, tp_size = 3, 4

    assert tp_from_executor(Executor()) == (1, 2)
    assert tp_from_executor(DistExecutor()) == (3, 4)
    assert tp_from_executor(None) == (0, 1)  # MPI world of this single process


def test_registered_by_name_in_the_adapter_registry() -> None:
    assert load_adapter("pool", "trtllm") is TrtllmSecondaryPool
    assert load_adapter("engine", "trtllm") is start_remote_g2


def test_real_source_service_resolves_and_releases_through_the_adapter() -> None:
    impl = CppManager()
    hashes = _fill(impl, 6)
    hooks = start_remote_g2(PyManager(impl), worker_id="trt-standin", executor=None,
                            source_config=SourceConfig(enabled=True))
    try:
        assert hooks.source is not None and hooks.target is None and (hooks.tp_rank, hooks.tp_size) == (0, 1)
        with RpcClient(hooks.source.endpoint, timeout_ms=5000) as client:
            reply = client.call(Resolve(hashes[:4], 10_000, "tester", []))
            assert reply.reason == "ok" and reply.matched == 4
            assert impl.pins[:4] == [1, 1, 1, 1] and impl.pins[4:] == [0] * (BLOCKS - 4)
            # Every descriptor lies inside the pool's registered memory.
            base, size = impl.pool.data_ptr(), impl.pool.numel() * impl.pool.element_size()
            assert reply.metadata[0].pool_base == base and reply.metadata[0].pool_bytes == size
            assert client.call(Release(reply.lease_id)).released
        assert impl.pins == [0] * BLOCKS
    finally:
        hooks.shutdown()
