"""``RemoteG2Connector``: vLLM's KV connector (V1) for remote-g2.

Enable it with::

    kv_transfer_config={"kv_connector": "RemoteG2Connector",
                        "kv_connector_module_path": "remote_g2.adapters.vllm",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"registry": "tcp://10.0.0.5:7450",
                                                      "worker_id": "vllm-a", "g2_blocks": 2048}}

Scheduler side (vLLM's scheduler process)
  ``get_num_new_matched_tokens`` hashes the prompt's full blocks itself
  (:func:`~remote_g2.hashing.chain_block_hashes` over the token ids:
  deterministic in every process, unlike vLLM's own chain, which is seeded at
  random unless ``PYTHONHASHSEED`` is set) and asks the registry how many
  leading blocks one other worker holds; the tokens beyond vLLM's local prefix
  hit are loaded asynchronously. ``update_state_after_alloc`` records the
  destination blocks, ``build_connector_meta`` sends the step's loads and the
  blocks to save (prompt blocks that became full) to the worker.

Worker side (each model runner)
  ``register_kv_caches`` builds the worker's G2 pool (a
  :class:`~remote_g2.adapters.host_pool.HostPool` in remote-g2's block
  layout, plus landing slots) and starts the source service and target
  client on it — the same hooks an engine executor calls. ``wait_for_save``
  copies the step's full prompt blocks into G2 (the source's pool listener
  publishes them to the registry). ``start_load_kv`` starts each remote load
  into landing slots; ``get_finished`` polls the target client, copies what
  arrived into vLLM's blocks, and reports the request as received;
  ``get_block_ids_with_load_errors`` lists the blocks vLLM must recompute
  (with ``kv_load_failure_policy="recompute"``).

Limits: tensor_parallel_size 1 (a TP group's ranks would each need the
load's outcome; the target client reports it to rank 0 only), uniform
attention layers, the layouts in :mod:`.kv_blocks`.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from remote_g2.errors import ConfigError, RemoteG2Error
from remote_g2.hashing import chain_block_hashes
from remote_g2.messages import LayoutFingerprint

from ..failed_sources import FailedSources
from ..landing_slots import LandingSlots, valid_prefix
from .kv_blocks import VllmKvLayout

try:  # vLLM is an optional dependency: `make test-vllm` installs it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError(f"remote_g2.adapters.vllm needs vLLM ({e}); install it (make venv-vllm)") from e

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["RemoteG2Connector", "RemoteG2ConnectorMetadata", "RemoteG2WorkerMetadata", "ConnectorSettings"]

log = logging.getLogger("remote_g2.adapters.vllm")


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, checked. ``registry`` may also come from ``REMOTE_G2_REGISTRY``."""

    registry: str | None
    worker_id: str
    g2_blocks: int = 1024
    landing_blocks: int = 256
    source: bool = True
    target: bool = True
    transfer: str = "nixl"
    transfer_timeout_ms: int = 10_000
    ipc_dir: str | None = None
    model_id: str | None = None
    failed_source_cooldown_s: float = 30.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(extra) - known
        if unknown:
            raise ConfigError(f"unknown remote-g2 settings in kv_connector_extra_config: {sorted(unknown)} "
                              f"(known: {sorted(known)})")
        values = dict(extra)
        values.setdefault("registry", os.environ.get("REMOTE_G2_REGISTRY"))
        values.setdefault("worker_id", f"vllm-{socket.gethostname()}-{os.getpid()}")
        s = cls(**values)
        if s.g2_blocks < 1 or s.landing_blocks < 1:
            raise ConfigError("g2_blocks and landing_blocks must be >= 1")
        if not s.failed_source_cooldown_s >= 0:
            raise ConfigError(f"failed_source_cooldown_s must be >= 0, not {s.failed_source_cooldown_s}")
        return s


@dataclass
class _Load:
    request_id: str
    hashes: list[bytes]
    block_ids: list[int]  # vLLM destination blocks, one per hash


@dataclass
class RemoteG2ConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler → worker: loads to start, full prompt blocks to save."""

    loads: list[_Load] = field(default_factory=list)
    save_hashes: list[bytes] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)


@dataclass
class RemoteG2WorkerMetadata(KVConnectorWorkerMetadata):
    """One step's news, worker → scheduler: requests whose remote load failed at the source.

    Not loads refused for want of a landing slot (this worker's own shortage): only these put the
    source in its cooldown.
    """

    source_failures: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, RemoteG2WorkerMetadata)
        return RemoteG2WorkerMetadata(self.source_failures | other.source_failures)


@dataclass
class _ReqState:
    """The scheduler side's view of one request."""

    hashes: list[bytes]
    blocks: list[int] = field(default_factory=list)
    saved: int = 0  # leading prompt blocks already sent for saving
    load_from: int = 0  # first block to load (vLLM's local hit, in blocks)
    load_blocks: int = 0
    source: str | None = None  # the worker the matched blocks would come from
    tried: bool = False  # a remote load was issued: this request never gets another


class RemoteG2Connector(KVConnectorBase_V1):
    """remote-g2 for vLLM: share full prompt blocks through a G2 pool, load others' blocks over NIXL."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if not logging.getLogger("remote_g2").handlers:  # vLLM configures only its own loggers
            from remote_g2.log import configure_logging

            configure_logging()
        self.settings = ConnectorSettings.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.block_size = int(vllm_config.cache_config.block_size)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        if tp != 1:
            raise ConfigError(f"remote-g2's vLLM connector supports tensor_parallel_size=1, got {tp}")
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kv_load_failure_policy=%r: a failed remote load fails the request; set \"recompute\" to "
                        "recompute the blocks instead", policy)
        self._model_id = self.settings.model_id or str(vllm_config.model_config.model)
        self._dtype = str(vllm_config.cache_config.cache_dtype)
        # scheduler side
        self._registry: Any = None
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[_Load] = []
        self._fingerprint: LayoutFingerprint | None = None
        self._failed_sources = FailedSources(self.settings.failed_source_cooldown_s)
        # worker side
        self._kv: VllmKvLayout | None = None
        self._pool: Any = None
        self._pool_rows: torch.Tensor | None = None
        self.source: Any = None
        self.target: Any = None
        self._landing: LandingSlots | None = None
        self._inflight: dict[str, tuple[_Load, list[int]]] = {}
        self._load_errors: set[int] = set()
        self._received: set[str] = set()
        self._source_failures: set[str] = set()  # for the scheduler, in the next worker metadata
        log.info("remote-g2 connector (%s) for %s: registry %s, worker %s", role.name, self._model_id,
                 self.settings.registry, self.settings.worker_id)

    # ======================= scheduler side =======================

    def _scheduler_fingerprint(self) -> LayoutFingerprint | None:
        """The layout this worker's blocks have, as far as the scheduler knows it (from the model config)."""
        if self._fingerprint is None:
            mc = self._vllm_config.model_config
            try:
                heads = int(mc.get_total_num_kv_heads())
                layers = int(mc.get_num_layers(self._vllm_config.parallel_config))
                head_dim = int(mc.get_head_size())
            except Exception as e:  # a model config without these: match without a layout check
                log.warning("no layout fingerprint for lookups (%s); relying on model_id only", e)
                return None
            self._fingerprint = LayoutFingerprint(model_id=self._model_id[:256], dtype=self._dtype[:64],
                                                  tokens_per_block=self.block_size, kv_layout="HND",
                                                  num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                                                  tp_size=1)
        return self._fingerprint

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past vLLM's local hit that one remote G2 holds (whole blocks; never the last prompt token)."""
        prompt = list(request.prompt_token_ids or [])
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqState(chain_block_hashes(prompt, self.block_size))
        if not self.settings.target or not self.settings.registry:
            return 0, False
        if state.tried:
            # One remote load per request. vLLM puts a request whose load failed back in the queue and
            # asks again; matching the same source again would retry it for as long as the registry
            # names that source (seen: 21,098 retries in 2 min against a source that had stalled).
            return 0, False
        reusable = (len(prompt) - 1) // self.block_size
        local = num_computed_tokens // self.block_size
        if reusable <= local:
            return 0, False
        if self._registry is None:
            from remote_g2.registry import RegistryClient

            from remote_g2.curve import CurveClientConfig

            self._registry = RegistryClient(self.settings.registry, timeout_s=2.0,
                                            curve=CurveClientConfig.from_env("REMOTE_G2_CURVE_SERVER_KEY"))
        fp = self._scheduler_fingerprint()
        try:
            reply = self._registry.lookup(state.hashes[:reusable], requester=self.settings.worker_id,
                                          compat_key=fp.compat_key() if fp else None)
        except RemoteG2Error as e:
            log.warning("registry lookup for %s failed: %s", request.request_id, e)
            return 0, False
        matched = min(int(reply.matched), reusable) if reply.reason == "ok" else 0
        if matched <= local:
            return 0, False
        source = reply.best.worker_id if reply.best is not None else None
        if source is not None and self._failed_sources.remaining(source) > 0:
            return 0, False  # a load from it failed moments ago: recompute now rather than wait it out
        state.load_from, state.load_blocks, state.source = local, matched - local, source
        return (matched - local) * self.block_size, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        ids = list(blocks.get_block_ids()[0])
        lo, n = state.load_from, num_external_tokens // self.block_size
        if len(ids) < lo + n:
            log.warning("%s: %d blocks allocated, %d needed for the load; not loading", request.request_id,
                        len(ids), lo + n)
            return
        state.tried = True
        self._pending_loads.append(_Load(request.request_id, state.hashes[lo:lo + n], ids[lo:lo + n]))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Give the source of every load that failed there a cooldown, so other requests skip it for a while."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, RemoteG2WorkerMetadata):
            return
        for rid in sorted(meta.source_failures):
            state = self._reqs.get(rid)
            if state is not None and state.source:
                self._failed_sources.note_failure(state.source, rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RemoteG2ConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.settings.source:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.blocks = list(new.block_ids[0])
                after = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
                self._plan_save(meta, state, after)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in getattr(cached, "resumed_req_ids", ()):
                    state.blocks = list(new_ids[0])
                else:
                    state.blocks.extend(new_ids[0])
            self._plan_save(meta, state, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: RemoteG2ConnectorMetadata, state: _ReqState, computed_after_step: int) -> None:
        full = min(len(state.hashes), computed_after_step // self.block_size, len(state.blocks))
        if full > state.saved:
            meta.save_hashes += state.hashes[state.saved:full]
            meta.save_block_ids += state.blocks[state.saved:full]
            state.saved = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None  # saves are synchronous (wait_for_save): vLLM may free the blocks now

    # ======================= worker side =======================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from remote_g2.adapters.host_pool import HostPool
        from remote_g2.source import SourceConfig, maybe_start_source_service
        from remote_g2.target import TargetConfig, maybe_start_target_client

        s = self.settings
        self._kv = kv = VllmKvLayout.from_kv_caches(kv_caches, self.block_size)
        self._pool = HostPool(kv.g2_layout(s.g2_blocks + s.landing_blocks), reserved_blocks=s.landing_blocks)
        self._pool_rows = kv.pool_view(self._pool.tensor)
        self._landing = LandingSlots(self._pool.reserved_block_ids)
        fp = LayoutFingerprint(model_id=self._model_id[:256], dtype=self._dtype[:64], tokens_per_block=self.block_size,
                               kv_layout="HND", num_layers=len(kv.views), num_kv_heads=kv.kv_heads,
                               head_dim=kv.head_dim, tp_size=1)
        common = {"registry_endpoint": s.registry, "fingerprint": fp}
        if s.ipc_dir:
            common["ipc_dir"] = s.ipc_dir
        try:
            if s.source:
                self.source = maybe_start_source_service(
                    self._pool, worker_id=s.worker_id, tp_rank=0, tp_size=1,
                    config=replace(SourceConfig.from_env(fingerprint=fp), enabled=True, **common))
            if s.target and s.registry:
                self.target = maybe_start_target_client(
                    self._pool, worker_id=s.worker_id, tp_rank=0, tp_size=1,
                    config=replace(TargetConfig.from_env(), enabled=True, transfer=s.transfer,
                                   transfer_timeout_ms=s.transfer_timeout_ms, **common))
        except BaseException:
            self.shutdown()
            raise
        log.info("remote-g2 worker %s: %d layers (%s layout), %d-byte blocks, G2 %d blocks + %d landing; "
                 "source %s, target %s", s.worker_id, len(kv.views), kv.kind, kv.block_bytes, s.g2_blocks,
                 s.landing_blocks, "on" if self.source else "off", "on" if self.target else "off")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteG2ConnectorMetadata)
        for load in meta.loads:
            self._start_load(load)

    def _start_load(self, load: _Load) -> None:
        if self.target is None or self._landing is None or self._landing.available() < len(load.hashes):
            why = "no target client" if self.target is None else "no free landing slots"
            log.warning("%s: not loading %d blocks (%s); vLLM recomputes them", load.request_id, len(load.hashes), why)
            self._load_errors.update(load.block_ids)
            self._received.add(load.request_id)
            return
        slots = self._landing.take(len(load.hashes))
        self._inflight[load.request_id] = (load, slots)
        self.target.start_load(load.request_id, load.hashes, slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM runs the request only after get_finished reported it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved at once, in wait_for_save

    def wait_for_save(self) -> None:
        """Copy this step's newly full prompt blocks into G2 (cached ones are skipped)."""
        if self._pool is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteG2ConnectorMetadata) and self._kv is not None
        todo = [(h, b) for h, b in zip(meta.save_hashes, meta.save_block_ids) if self._pool.lookup(h) is None]
        if not todo:
            return
        data = self._kv.gather([b for _, b in todo])
        try:
            self._pool.store([h for h, _ in todo], list(data))
        except RemoteG2Error as e:  # every G2 block pinned by readers: these blocks just are not shared
            log.warning("saving %d blocks to G2 failed: %s", len(todo), e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(None, received)``: requests whose remote load ended (loaded or failed) since the last call."""
        received, self._received = self._received, set()
        if self.target is not None and self._inflight:
            done, failed = self.target.get_finished()
            invalid = self.target.invalid_block_ids()
            for rid in done | failed:
                entry = self._inflight.pop(rid, None)
                if entry is None:
                    continue
                load, slots = entry
                good = valid_prefix(slots, invalid) if rid in done else 0
                if good:
                    assert self._kv is not None and self._pool_rows is not None
                    rows = self._pool_rows[torch.as_tensor(slots[:good])]
                    self._kv.scatter(load.block_ids[:good], rows)
                    try:  # keep them in G2 too: this worker can share them in turn
                        self._pool.store(load.hashes[:good], list(rows))
                    except RemoteG2Error as e:
                        log.warning("caching %d loaded blocks in G2 failed: %s", good, e)
                self._load_errors.update(load.block_ids[good:])
                assert self._landing is not None
                if rid in done:
                    self._landing.give_back(slots)
                else:
                    self._landing.quarantine(slots)
                    self._source_failures.add(rid)
                received.add(rid)
                log.info("%s: %d of %d blocks loaded from a remote G2", rid, good, len(slots))
        return None, (received or None)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's loads that failed at the source (see :class:`RemoteG2WorkerMetadata`)."""
        if not self._source_failures:
            return None
        out, self._source_failures = self._source_failures, set()
        return RemoteG2WorkerMetadata(out)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        for name in ("target", "source"):
            hook = getattr(self, name)
            if hook is not None:
                try:
                    hook.shutdown()
                except Exception:
                    log.exception("remote-g2 %s shutdown failed", name)
                setattr(self, name, None)
        if self._registry is not None:
            self._registry.close()
            self._registry = None
