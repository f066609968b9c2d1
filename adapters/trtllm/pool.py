"""TensorRT-LLM's host secondary pool as a remote-g2 :class:`~remote_g2.memory.secondary_pool.SecondaryPool`.

**Not run against TensorRT-LLM** (it needs a GPU; this machine has none).
Written against the public shape of its KV cache manager as an engine
integrator would, and tested against stand-in objects shaped like those
classes (``tests/test_trtllm_adapter.py``). Every method it needs is
*feature-detected*, because builds differ:

================================  ==========================================================
need                              looked up, in order, on ``manager.impl`` then ``manager``
================================  ==========================================================
the pool tensor                   ``get_unique_secondary_pool()``, ``get_secondary_pool()``,
                                  attribute ``secondary_pool``
find-and-pin one block by hash    ``find_and_pin_secondary_block_by_hash(h)`` (→ id, or
                                  None / negative on a miss)
pin by id                         ``pin_blocks_by_id(ids)``, else ``pin_blocks(ids)``
unpin by id                       ``unpin_blocks_by_id(ids)``, else ``unpin_blocks(ids)``
cached hashes (resync)            ``get_secondary_block_hashes()``; else the hashes seen
                                  through :meth:`TrtllmSecondaryPool.notify`
KV-cache quantisation (optional)  attribute ``kv_cache_dtype``, ``cache_dtype`` or ``dtype``
                                  (e.g. ``DataType.FP8``)
hash seed / algorithm (optional)  attributes ``block_hash_seed`` or ``hash_seed``,
                                  ``block_hash_algorithm``, ``hash_algorithm`` or ``hash_algo``
================================  ==========================================================

``impl`` is the C++ ``BaseKVCacheManager`` binding the Python
``KVCacheManager`` wraps; methods are looked up there first because the
wrapper does not forward all of them. TensorRT-LLM block hashes are u64;
remote-g2 carries them as 8 bytes big-endian
(:func:`~remote_g2.identity.hashing.u64_to_hash`).

Layout: TensorRT-LLM's pool rows are ``[num_layers, kv_factor, num_kv_heads,
tokens_per_block, head_dim]`` per block (head-major, ``HND``); the sizes come
from the manager (``num_local_layers`` or ``num_layers``,
``num_kv_heads_per_layer[0]`` or ``num_kv_heads``, ``tokens_per_block``,
``head_dim``, ``kv_factor``; MLA has ``kv_factor == 1``) unless the caller
passes a :class:`~remote_g2.protocol.messages.BlockLayout`.

What the bytes are (:meth:`TrtllmSecondaryPool.fingerprint`) is read from the
pool, never from configuration: ``dtype`` is the pool tensor's dtype, with the
quantisation the manager declares beside it (``float8_e4m3fn/fp8``), and
``hash_scheme`` names TensorRT-LLM's u64 block-hash space (``trtllm/u64``,
plus the algorithm and a digest of the seed when the manager exposes them).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from remote_g2.errors import ConfigError
from remote_g2.identity.hashing import hash_to_u64, u64_to_hash
from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint

from remote_g2.memory.secondary_pool import MemoryRegion, PoolEventKind, PoolListener

__all__ = ["TrtllmApi", "TrtllmSecondaryPool", "block_hash_scheme", "detect_api", "kv_dtype_name", "tp_from_executor"]

log = logging.getLogger("remote_g2.adapters.trtllm")

_POOL = ("get_unique_secondary_pool", "get_secondary_pool")
_FIND_AND_PIN = ("find_and_pin_secondary_block_by_hash",)
_PIN = ("pin_blocks_by_id", "pin_blocks")
_UNPIN = ("unpin_blocks_by_id", "unpin_blocks")
_HASHES = ("get_secondary_block_hashes",)
_KV_QUANT = ("kv_cache_dtype", "cache_dtype", "dtype")
_HASH_SEED = ("block_hash_seed", "hash_seed")
_HASH_ALGO = ("block_hash_algorithm", "hash_algorithm", "hash_algo")
# Declared dtypes that are a KV-cache quantisation rather than the model's own float type.
_QUANTISED = ("fp8", "float8", "int8", "int4", "fp4", "nvfp4", "e4m3", "e5m2")
# Formats whose block scales live in a pool of their own, which this adapter does not share.
_SCALES_IN_ANOTHER_POOL = ("fp4", "nvfp4")


@dataclass(frozen=True)
class TrtllmApi:
    """Which TensorRT-LLM methods were found (``"impl.name"`` / ``"manager.name"``), for logs and checks."""

    pool: Callable[[], Any]
    pool_name: str
    find_and_pin: Callable[[int], Any]
    find_and_pin_name: str
    pin: Callable[[list[int]], Any]
    pin_name: str
    unpin: Callable[[list[int]], Any]
    unpin_name: str
    hashes: Callable[[], Any] | None
    hashes_name: str | None


def _targets(manager: Any) -> list[tuple[str, Any]]:
    impl = getattr(manager, "impl", None)
    return ([("impl", impl)] if impl is not None else []) + [("manager", manager)]


def _find(manager: Any, names: Sequence[str]) -> tuple[Callable[..., Any], str] | None:
    for where, obj in _targets(manager):
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                return fn, f"{where}.{name}"
    return None


def detect_api(manager: Any) -> TrtllmApi:
    """Find every method remote-g2 needs on a KV cache manager; ``ConfigError`` listing what is missing."""
    pool = _find(manager, _POOL)
    if pool is None:
        for where, obj in _targets(manager):
            tensor = getattr(obj, "secondary_pool", None)
            if tensor is not None and not callable(tensor):
                pool = ((lambda t=tensor: t), f"{where}.secondary_pool")
                break
    found = {"pool": pool, "find_and_pin": _find(manager, _FIND_AND_PIN), "pin": _find(manager, _PIN),
             "unpin": _find(manager, _UNPIN)}
    missing = [k for k, v in found.items() if v is None]
    if missing:
        wanted = {"pool": _POOL + ("secondary_pool",), "find_and_pin": _FIND_AND_PIN, "pin": _PIN, "unpin": _UNPIN}
        raise ConfigError("this TensorRT-LLM KV cache manager cannot share its secondary pool: missing "
                          + "; ".join(f"{k} (one of {', '.join(wanted[k])})" for k in missing)
                          + " on .impl or the manager (needs a build with host secondary-pool block reuse)")
    hashes = _find(manager, _HASHES)
    return TrtllmApi(pool[0], pool[1], found["find_and_pin"][0], found["find_and_pin"][1],  # type: ignore[index]
                     found["pin"][0], found["pin"][1], found["unpin"][0], found["unpin"][1],  # type: ignore[index]
                     hashes[0] if hashes else None, hashes[1] if hashes else None)


def _first_attr(manager: Any, *names: str) -> Any:
    for _, obj in _targets(manager):
        for name in names:
            value = getattr(obj, name, None)
            if value is not None and not callable(value):
                return value
    return None


def layout_from_manager(manager: Any, pool_tensor: Any) -> BlockLayout:
    """The pool's :class:`BlockLayout` from the manager's sizes; ``ConfigError`` when one is missing."""
    layers = _first_attr(manager, "num_local_layers", "num_layers")
    heads = _first_attr(manager, "num_kv_heads_per_layer", "num_kv_heads")
    if isinstance(heads, (list, tuple)):
        if len(set(heads)) != 1:
            raise ConfigError(f"layers have different kv head counts {sorted(set(heads))}: pass a BlockLayout")
        heads = heads[0]
    tpb = _first_attr(manager, "tokens_per_block")
    head_dim = _first_attr(manager, "head_dim")
    kv = _first_attr(manager, "kv_factor") or 2
    sizes = {"num_layers": layers, "num_kv_heads": heads, "tokens_per_block": tpb, "head_dim": head_dim}
    if any(v is None for v in sizes.values()):
        raise ConfigError(f"cannot read the block layout from the manager ({sizes}): pass layout=BlockLayout(...)")
    num_blocks = int(pool_tensor.shape[0])
    nbytes = int(pool_tensor.numel()) * int(pool_tensor.element_size())
    block_bytes = nbytes // num_blocks
    dtype_bytes = block_bytes // (int(layers) * int(kv) * int(heads) * int(tpb) * int(head_dim))
    if dtype_bytes < 1:
        raise ConfigError(f"pool rows of {block_bytes} bytes cannot hold {layers}x{kv}x{heads}x{tpb}x{head_dim} "
                          f"elements: pass layout=BlockLayout(...)")
    return BlockLayout(num_blocks=num_blocks, block_bytes=block_bytes, num_layers=int(layers), kv=int(kv),
                       num_kv_heads=int(heads), tokens_per_block=int(tpb), head_dim=int(head_dim),
                       dtype_bytes=dtype_bytes, order="HND")


def _type_name(value: Any) -> str:
    """``torch.float16`` -> ``float16``; TensorRT-LLM's ``DataType.FP8`` -> ``fp8``."""
    return str(value).rsplit(".", 1)[-1].lower()


def kv_dtype_name(manager: Any, pool_tensor: Any) -> str:
    """The fingerprint's ``dtype``: the pool tensor's dtype, plus the KV-cache quantisation the manager declares.

    A quantised format keeps its name beside the storage dtype
    (``float8_e4m3fn/fp8``, ``uint8/...``), since two formats can share a
    storage dtype; a declared plain float type (TensorRT-LLM's
    ``DataType.HALF``) adds nothing, the tensor already says it. ``ConfigError``
    for an FP4 cache: its block scales live in a second pool this adapter
    does not share, so its blocks alone are not the KV.
    """
    stored = _type_name(pool_tensor.dtype)
    declared = _first_attr(manager, *_KV_QUANT)
    quant = _type_name(declared) if declared is not None else ""
    if not quant.startswith(_QUANTISED):
        return stored
    if quant.startswith(_SCALES_IN_ANOTHER_POOL):
        raise ConfigError(f"the KV cache is {quant} (stored as {stored}): its block scales live in a pool of their "
                          "own, which remote-g2 does not share; not sharing these blocks")
    return stored if quant == stored else f"{stored}/{quant}"


def block_hash_scheme(manager: Any) -> str:
    """The fingerprint's ``hash_scheme``: TensorRT-LLM's u64 block hashes, with the seed and algorithm if exposed.

    ``trtllm/u64``, then ``/<algorithm>`` and ``/seed-<digest>`` when the
    manager names them. Only a digest of the seed is published (it reaches
    the registry), enough to keep workers of different seeds apart.
    """
    scheme = "trtllm/u64"
    algo = _first_attr(manager, *_HASH_ALGO)
    if algo is not None:
        scheme += "/" + _type_name(algo)[:24]
    seed = _first_attr(manager, *_HASH_SEED)
    if seed is not None:
        scheme += "/seed-" + hashlib.blake2b(str(seed).encode(), digest_size=4).hexdigest()
    return scheme


def tp_from_executor(executor: Any = None) -> tuple[int, int]:
    """``(tp_rank, tp_size)``: from the executor's ``mapping`` or ``dist`` when it has them, else MPI world."""
    for holder in (getattr(executor, "mapping", None), getattr(executor, "dist", None), executor):
        if holder is not None and isinstance(getattr(holder, "tp_size", None), int):
            return int(holder.tp_rank), int(holder.tp_size)
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    # MPI world equals the TP group only without attention-DP; an executor with DP must pass its mapping.
    return int(MPI.COMM_WORLD.Get_rank()), int(MPI.COMM_WORLD.Get_size())


class TrtllmSecondaryPool:
    """A TensorRT-LLM KV cache manager's host secondary pool, seen through the SecondaryPool contract.

    TensorRT-LLM owns the pool: it stores, evicts and pins. This adapter finds
    and pins blocks for remote reads, exposes the memory to NIXL, and relays
    the store/evict events the executor reports with :meth:`notify` (e.g.
    from TensorRT-LLM's KV-cache event stream) to listeners — the source
    service's registry publisher among them.
    """

    def __init__(self, manager: Any, *, layout: BlockLayout | None = None) -> None:
        self.api = detect_api(manager)
        self._manager = manager
        self._tensor = self.api.pool()
        if getattr(self._tensor, "device", None) is not None and str(self._tensor.device) != "cpu":
            raise ConfigError(f"the secondary pool lives on {self._tensor.device}; remote-g2 shares host memory")
        self._layout = layout or layout_from_manager(manager, self._tensor)
        self._lock = threading.Lock()
        self._listeners: tuple[PoolListener, ...] = ()
        self._known: set[bytes] = set()
        log.info("TensorRT-LLM secondary pool: %d blocks of %d bytes via %s, %s, %s, %s", self._layout.num_blocks,
                 self._layout.block_bytes, self.api.pool_name, self.api.find_and_pin_name, self.api.pin_name,
                 self.api.unpin_name)

    @property
    def layout(self) -> BlockLayout:
        return self._layout

    @property
    def kv_dtype(self) -> str:
        """What the pool's bytes are (:func:`kv_dtype_name`); ``ConfigError`` for a format it cannot share."""
        return kv_dtype_name(self._manager, self._tensor)

    @property
    def hash_scheme(self) -> str:
        """The hash space of the u64 block hashes this pool is keyed by (:func:`block_hash_scheme`)."""
        return block_hash_scheme(self._manager)

    def fingerprint(self, *, model_id: str, tp_size: int) -> LayoutFingerprint:
        """This worker's fingerprint as the pool states it; only ``model_id`` comes from outside.

        ``num_kv_heads`` counts the whole model's heads: this rank's times
        ``tp_size``, except with MLA (``kv == 1``), whose one latent head
        every rank holds whole.
        """
        lay = self._layout
        is_mla = lay.kv == 1
        return LayoutFingerprint(model_id=model_id, dtype=self.kv_dtype, tokens_per_block=lay.tokens_per_block,
                                 kv_layout=lay.order, num_layers=lay.num_layers,
                                 num_kv_heads=lay.num_kv_heads if is_mla else lay.num_kv_heads * tp_size,
                                 head_dim=lay.head_dim, tp_size=tp_size, is_mla=is_mla,
                                 hash_scheme=self.hash_scheme)

    def regions(self) -> list[MemoryRegion]:
        t = self._tensor
        return [MemoryRegion(base=int(t.data_ptr()), nbytes=int(t.numel()) * int(t.element_size()))]

    def find_and_pin(self, hashes: Sequence[bytes]) -> list[int]:
        """Pin, one block at a time (each atomic in C++), the longest cached prefix of ``hashes``."""
        out: list[int] = []
        for h in hashes:
            block = self.api.find_and_pin(hash_to_u64(h))
            if block is None or int(block) < 0:
                break
            out.append(int(block))
        return out

    def pin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        self.api.pin([int(b) for b in block_ids])

    def unpin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        self.api.unpin([int(b) for b in block_ids])

    def block_hashes(self) -> list[bytes]:
        if self.api.hashes is not None:
            return [u64_to_hash(int(v)) for v in self.api.hashes()]
        with self._lock:
            return list(self._known)

    def add_listener(self, listener: PoolListener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def notify(self, kind: PoolEventKind, u64_hashes: Sequence[int]) -> None:
        """The executor reports blocks stored into / evicted from the secondary pool (u64 hashes)."""
        hashes = [u64_to_hash(int(v)) for v in u64_hashes]
        with self._lock:
            if kind == "stored":
                self._known.update(hashes)
            elif kind == "removed":
                self._known.difference_update(hashes)
            else:
                self._known.clear()
            listeners = self._listeners
        for listener in listeners:
            try:
                listener(kind, hashes)
            except Exception:
                log.exception("pool listener failed on %s", kind)
