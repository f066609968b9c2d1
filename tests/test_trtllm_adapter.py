"""The TensorRT-LLM adapter against stand-ins shaped like TensorRT-LLM's KV cache manager classes.

TensorRT-LLM cannot run here (no GPU), so these stand-ins play its Python
``KVCacheManager`` (sizes as attributes, the C++ binding as ``.impl``) and
that binding (a host secondary pool tensor, hash-keyed find-and-pin, pins by
id), in the method-name variants different builds have. The fingerprint
tests give those stand-ins pools of different dtypes and declared
quantisations, since TensorRT-LLM itself cannot be installed here. The last
test plugs the adapter into the real source service and resolves/releases
over its real RPC socket.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from remote_g2.plugins import load_adapter
from remote_g2.adapters.trtllm import (
    TrtllmSecondaryPool,
    detect_api,
    start_remote_g2,
    tp_from_executor,
)
from remote_g2.adapters.trtllm.hooks import resolve_fingerprint
from remote_g2.source import SourceConfig
from remote_g2.target import TargetConfig

from remote_g2.errors import ConfigError
from remote_g2.identity.hashing import u64_to_hash
from remote_g2.protocol.messages import LayoutFingerprint, Release, Resolve
from remote_g2.rpc.client import RpcClient

LAYERS, KV, HEADS, TPB, DIM, BLOCKS = 2, 2, 4, 8, 16, 12


class DataType(enum.Enum):
    """Stand-in for ``tensorrt_llm.bindings.DataType`` (the Python manager's ``dtype``); str() is ``DataType.FP8``."""

    HALF = 1
    BF16 = 2
    FP8 = 3
    INT8 = 4
    NVFP4 = 5


class CppManager:
    """Stand-in for the C++ BaseKVCacheManager binding, newest API."""

    def __init__(self, kv_factor: int = KV, dtype: torch.dtype = torch.float16) -> None:
        self.pool = torch.zeros(BLOCKS, LAYERS * kv_factor * HEADS * TPB * DIM, dtype=dtype)
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
        self.dtype = DataType.HALF  # TensorRT-LLM's default, whatever the pool tensor holds
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


class TpTwo:
    """An executor whose ``mapping`` says TP rank 0 of 2."""

    class mapping:  # noqa: N801 - shaped like PyExecutor.mapping
        tp_rank, tp_size = 0, 2


def _pool_fingerprint(tensor_dtype: torch.dtype = torch.float16, **manager: object) -> LayoutFingerprint:
    """The fingerprint of a TP-2 rank whose pool tensor is ``tensor_dtype``; ``manager``: the manager's attributes."""
    return resolve_fingerprint(TrtllmSecondaryPool(PyManager(CppManager(dtype=tensor_dtype), **manager)), tp_size=2,
                               model_id="m")


def test_fingerprint_dtype_follows_the_pool_tensor_not_the_configuration() -> None:
    fp16, bf16 = _pool_fingerprint(torch.float16), _pool_fingerprint(torch.bfloat16)
    assert (fp16.dtype, bf16.dtype) == ("float16", "bfloat16")
    assert fp16.compat_key() != bf16.compat_key()  # the registry never pairs them
    assert (fp16.num_layers, fp16.num_kv_heads, fp16.head_dim, fp16.tokens_per_block, fp16.kv_layout,
            fp16.tp_size, fp16.is_mla) == (LAYERS, HEADS * 2, DIM, TPB, "HND", 2, False)
    assert fp16.hash_scheme == "trtllm/u64" and fp16.model_id.startswith("m#o-")
    # The manager's declared dtype is HALF in both: a plain float type adds nothing to the tensor's.
    assert _pool_fingerprint(torch.bfloat16, dtype=DataType.BF16).dtype == "bfloat16"


def test_declared_kv_quantisation_is_named_beside_the_storage_dtype() -> None:
    fp8 = _pool_fingerprint(torch.float8_e4m3fn, dtype=DataType.FP8)
    assert fp8.dtype == "float8_e4m3fn/fp8"
    assert _pool_fingerprint(torch.uint8, kv_cache_dtype="fp8").dtype == "uint8/fp8"
    assert _pool_fingerprint(torch.int8, dtype=DataType.INT8).dtype == "int8"
    with pytest.raises(ConfigError, match="nvfp4 .*block scales"):
        _pool_fingerprint(torch.uint8, dtype=DataType.NVFP4)


def test_hash_scheme_names_the_seed_and_algorithm_when_the_manager_exposes_them() -> None:
    seeded = _pool_fingerprint(block_hash_seed=1234)
    assert seeded.hash_scheme.startswith("trtllm/u64/seed-") and "1234" not in seeded.hash_scheme
    assert _pool_fingerprint(block_hash_seed=1234).hash_scheme == seeded.hash_scheme
    assert _pool_fingerprint(block_hash_seed=99).hash_scheme != seeded.hash_scheme
    assert _pool_fingerprint(hash_algo="xxh64").hash_scheme == "trtllm/u64/xxh64"


def test_mla_kv_heads_are_not_multiplied_by_tp() -> None:
    impl = CppManager(kv_factor=1)
    fp = resolve_fingerprint(TrtllmSecondaryPool(PyManager(impl, kv_factor=1, num_kv_heads_per_layer=[1, 1],
                                                           head_dim=HEADS * DIM)), tp_size=2, model_id="m")
    assert (fp.is_mla, fp.num_kv_heads, fp.head_dim) == (True, 1, HEADS * DIM)


def test_a_configured_fingerprint_that_disagrees_with_the_tensors_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("REMOTE_G2_SOURCE", "REMOTE_G2_TARGET", "REMOTE_G2_REGISTRY", "REMOTE_G2_TARGET_FINGERPRINT"):
        monkeypatch.delenv(var, raising=False)
    own = _pool_fingerprint(torch.float16)

    def start(*, target: bool = False, model_id_arg: str | None = None, **fields: object) -> None:
        """Start on a float16 pool, the source's (``target``: the target's) config naming ``fields``."""
        fp = replace(own, **fields)  # type: ignore[arg-type]
        start_remote_g2(PyManager(CppManager()), worker_id="w", executor=TpTwo(), model_id=model_id_arg,
                        source_config=None if target else SourceConfig(enabled=True, fingerprint=fp),
                        target_config=TargetConfig(enabled=True, fingerprint=fp) if target else None)

    with pytest.raises(ConfigError, match=r"source_config.fingerprint .*dtype='bfloat16'.*pool holds dtype='float16'"):
        start(dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"head_dim=64.*pool holds head_dim=16"):
        start(head_dim=64)
    with pytest.raises(ConfigError, match=r"target_config.fingerprint .*dtype='auto'"):
        start(target=True, dtype="auto")
    with pytest.raises(ConfigError, match=r"hash_scheme='vllm/sha256/00'.*hash_scheme='trtllm/u64'"):
        start(hash_scheme="vllm/sha256/00")
    with pytest.raises(ConfigError, match=r"names model 'other', model_id= names 'm'"):
        start(model_id_arg="m", model_id="other")
    # The environment's fingerprint is checked the same way, before anything starts.
    monkeypatch.setenv("REMOTE_G2_SOURCE", "1")
    monkeypatch.setenv("REMOTE_G2_SOURCE_FINGERPRINT", json.dumps(asdict(replace(own, dtype="bfloat16"))))
    with pytest.raises(ConfigError, match=r"REMOTE_G2_SOURCE_FINGERPRINT .*dtype='bfloat16'.*dtype='float16'"):
        start_remote_g2(PyManager(CppManager()), worker_id="w", executor=TpTwo())


def test_the_model_id_comes_from_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("REMOTE_G2_SOURCE", "REMOTE_G2_TARGET", "REMOTE_G2_REGISTRY", "REMOTE_G2_SOURCE_FINGERPRINT",
                "REMOTE_G2_TARGET_FINGERPRINT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"no model identity .*checkpoint=.*model_id=.*REMOTE_G2_SOURCE_FINGERPRINT"):
        start_remote_g2(PyManager(CppManager()), worker_id="w", source_config=SourceConfig(enabled=True))
    # Nothing enabled: nothing to announce, so no model id is needed.
    hooks = start_remote_g2(PyManager(CppManager()), worker_id="w")
    assert hooks.source is None and hooks.target is None
    # A configured fingerprint names the model; its other fields must match, tp_size is the group's, and a
    # fingerprint written without hash_scheme takes the pool's.
    configured = replace(_pool_fingerprint(), model_id="from-config", tp_size=8, hash_scheme="")
    fp = resolve_fingerprint(TrtllmSecondaryPool(PyManager(CppManager())), tp_size=2,
                             configured=[("REMOTE_G2_TARGET_FINGERPRINT", configured)])
    assert fp.model_id.startswith("from-config#o-") and (fp.tp_size, fp.hash_scheme) == (2, "trtllm/u64")


def _checkpoint(d: Path, weights: bytes = b"\x01" * 4096) -> Path:
    """A TensorRT-LLM checkpoint directory: the build options and one rank's weights."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"dtype": "float16", "rotary_base": 10000.0}))
    (d / "rank0.safetensors").write_bytes(weights)
    return d


def test_the_model_identity_is_the_digest_of_the_checkpoint_the_engine_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMOTE_G2_DIGEST_CACHE_DIR", str(tmp_path / "digests"))
    pool = TrtllmSecondaryPool(PyManager(CppManager()))
    v1 = resolve_fingerprint(pool, tp_size=2, checkpoint=_checkpoint(tmp_path / "models" / "llama"))
    assert v1.model_id.startswith(str(tmp_path / "models" / "llama") + "#w-")
    copy = resolve_fingerprint(pool, tp_size=2, checkpoint=_checkpoint(tmp_path / "mnt" / "llama"))
    assert copy.model_identity == v1.model_identity and copy.compat_key() == v1.compat_key()
    one_byte = bytearray(b"\x01" * 4096)
    one_byte[2049] = 2  # one weight element
    v2 = resolve_fingerprint(pool, tp_size=2, checkpoint=_checkpoint(tmp_path / "v2", bytes(one_byte)))
    assert v2.model_identity != v1.model_identity
    rope = _checkpoint(tmp_path / "rope")
    (rope / "config.json").write_text(json.dumps({"dtype": "float16", "rotary_base": 500000.0}))
    assert resolve_fingerprint(pool, tp_size=2, checkpoint=rope).model_identity != v1.model_identity
    engines = tmp_path / "engines"  # a built engine directory: its engines and build config
    engines.mkdir()
    (engines / "config.json").write_text("{}")
    (engines / "rank0.engine").write_bytes(b"plan-a")
    e1 = resolve_fingerprint(pool, tp_size=2, checkpoint=engines).model_identity
    (engines / "rank0.engine").write_bytes(b"plan-b")
    assert resolve_fingerprint(pool, tp_size=2, checkpoint=engines).model_identity != e1
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint files"):
        resolve_fingerprint(pool, tp_size=2, checkpoint=tmp_path / "empty")
    # The operator's model_id overrides the digest; a configured fingerprint must name the same model.
    named = resolve_fingerprint(pool, tp_size=2, model_id="llama@r2", checkpoint=tmp_path / "v2")
    assert named.model_id.startswith("llama@r2#o-")
    with pytest.raises(ConfigError, match="names model 'llama@r1'"):
        resolve_fingerprint(pool, tp_size=2, checkpoint=tmp_path / "v2",
                            configured=[("source_config.fingerprint", replace(v2, model_id="llama@r1"))])
    assert resolve_fingerprint(pool, tp_size=2, checkpoint=tmp_path / "v2",
                               configured=[("x", replace(v2, model_id="other-label#" + v2.model_identity))]) == v2
    # start_remote_g2 takes the checkpoint from the environment as well
    for var in ("REMOTE_G2_SOURCE", "REMOTE_G2_TARGET", "REMOTE_G2_REGISTRY", "REMOTE_G2_SOURCE_FINGERPRINT",
                "REMOTE_G2_TARGET_FINGERPRINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("REMOTE_G2_MODEL_CHECKPOINT", str(tmp_path / "models" / "llama"))
    hooks = start_remote_g2(PyManager(CppManager()), worker_id="trt-ckpt", source_config=SourceConfig(enabled=True))
    try:
        assert hooks.source.config.fingerprint.model_identity == v1.model_identity
    finally:
        hooks.shutdown()


def test_real_source_service_resolves_and_releases_through_the_adapter() -> None:
    impl = CppManager()
    hashes = _fill(impl, 6)
    hooks = start_remote_g2(PyManager(impl), worker_id="trt-standin", executor=None, model_id="standin-model",
                            source_config=SourceConfig(enabled=True))
    try:
        assert hooks.source is not None and hooks.target is None and (hooks.tp_rank, hooks.tp_size) == (0, 1)
        assert hooks.source.config.fingerprint.model_id.startswith("standin-model#o-")
        assert hooks.source.config.fingerprint == LayoutFingerprint(
            model_id=hooks.source.config.fingerprint.model_id, dtype="float16", tokens_per_block=TPB, kv_layout="HND", num_layers=LAYERS,
            num_kv_heads=HEADS, head_dim=DIM, tp_size=1, is_mla=False, hash_scheme="trtllm/u64")
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
