"""``RemoteG2Connector``: vLLM's KV connector (V1) for remote-g2.

Enable it with::

    kv_transfer_config={"kv_connector": "RemoteG2Connector",
                        "kv_connector_module_path": "remote_g2.adapters.vllm",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"registry": "tcp://10.0.0.5:7450",
                                                      "worker_id": "vllm-a", "g2_blocks": 2048}}

Scheduler side (vLLM's scheduler process)
  ``get_num_new_matched_tokens`` takes vLLM's own block hashes of the
  prompt's full blocks (``request.block_hashes``: they fold in the LoRA
  adapter, multimodal inputs, ``cache_salt`` and prompt embeddings; see
  :mod:`.block_identity`) and asks the registry how many leading blocks one
  other worker with the same layout fingerprint holds; the tokens beyond
  vLLM's local prefix hit are loaded asynchronously.
  ``update_state_after_alloc`` records the destination blocks,
  ``build_connector_meta`` sends the step's loads and the blocks to save
  (prompt blocks that became full) to the worker.

Worker side (each model runner; one per TP rank)
  ``register_kv_caches`` builds the rank's G2 pool (a
  :class:`~remote_g2.adapters.host_pool.HostPool` in remote-g2's block
  layout, over the rank's own KV heads, plus landing slots), checks that the
  tensors it was given have the dtype and shape the scheduler's fingerprint
  promised, and starts the source service and target client on it — the same
  hooks an engine executor calls. At ``tensor_parallel_size > 1`` their
  start-up exchange runs over vLLM's CPU TP group
  (:class:`~remote_g2.torch_group.TorchGroupComm`), rank 0's target client
  resolves each load and hands every rank its share (heterogeneous TP as the
  core plans it), and the ranks agree on what each step decides
  (:mod:`.tp_sync`).
  ``wait_for_save`` queues the step's new full prompt blocks for the
  worker's copy thread (:mod:`.saver`), which copies them into G2 beside the
  engine's next step; the source's pool listener publishes them to the
  registry once copied. A finished request's blocks are kept (vLLM's delayed
  free: ``request_finished`` says so, ``get_finished`` reports the request
  finished sending) until no copy reads them, and ``handle_preemptions``
  waits for a preempted request's copies before its blocks can be reused.
  ``start_load_kv``
  starts each request's load: blocks already in this worker's G2 are copied
  at once, blocks another request is already fetching are waited for
  (:mod:`.fetches`: one READ per block), the rest are read into landing
  slots; ``get_finished`` polls the target client, copies what arrived into
  vLLM's blocks, and reports the request as received;
  ``get_block_ids_with_load_errors`` lists the blocks vLLM must recompute
  (with ``kv_load_failure_policy="recompute"``).

Abort safety: vLLM keeps the blocks of a request it finishes while that
request waits for remote KV (``WAITING_FOR_REMOTE_KVS``) until the connector
reports the request received; the connector reports it only once every fetch
it waits on has ended, and copies nothing into the blocks of a request vLLM
has finished.

Limits (refused with a ConfigError by the plugin of :mod:`.plugin`
before the model loads): pipeline_parallel_size 1; at tensor_parallel_size
> 1 the model's KV heads must divide among the ranks (vLLM replicates them
otherwise). Uniform attention layers, the layouts in :mod:`.kv_blocks`.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from remote_g2.errors import ConfigError, RemoteG2Error
from remote_g2.messages import LayoutFingerprint

from ..failed_sources import FailedSources
from ..landing_slots import LandingSlots, valid_prefix
from . import block_identity
from .fetches import FetchTable, RequestLoad
from .kv_blocks import VllmKvLayout
from .saver import BlockSaver
from .seen_blocks import SeenBlocks
from .settings import ConnectorSettings
from .tp_sync import FetchOutcome, TpSync

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

__all__ = ["RemoteG2Connector", "RemoteG2ConnectorMetadata", "RemoteG2WorkerMetadata", "ConnectorSettings",
           "check_vllm_config"]

log = logging.getLogger("remote_g2.adapters.vllm")

#: How long a step waits for the copies of a preempted request's blocks before it drops them.
_PREEMPT_WAIT_S = 30.0
#: Tests only: called in the saver's thread between a job's gather and its store (see :mod:`.saver`).
_SAVE_COPY_HOOK: Any = None


def _tp_comm(tp_size: int) -> Any:
    """vLLM's CPU TP group as the TP-group communicator (None at TP 1)."""
    if tp_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    from remote_g2.torch_group import TorchGroupComm

    group = get_tp_group()
    comm = TorchGroupComm(group.cpu_group)
    if comm.Get_size() != tp_size:
        raise ConfigError(f"vLLM's TP group has {comm.Get_size()} ranks, tensor_parallel_size is {tp_size}")
    return comm


def check_vllm_config(vllm_config: VllmConfig) -> str:
    """Refuse a configuration the connector cannot serve correctly, with what to change (``ConfigError``).

    Returns the hash scheme of the instance's block hashes (:func:`.block_identity.hash_scheme`).

    Called where vLLM creates its config (:mod:`.plugin`, before the model
    loads), whenever vLLM consults the connector class, and when a connector
    is built.
    """
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if pp != 1:
        raise ConfigError(f"remote-g2's vLLM connector supports pipeline_parallel_size=1, got {pp}")
    mc = vllm_config.model_config
    if tp > 1 and not getattr(mc, "use_mla", False):
        heads = int(mc.get_total_num_kv_heads())
        if heads % tp:
            # vLLM then replicates KV heads across ranks: no rank holds a slice the TP planner can address.
            raise ConfigError(f"remote-g2's vLLM connector needs the model's {heads} KV heads to divide among "
                              f"tensor_parallel_size={tp} ranks (vLLM would replicate them); use a TP size that "
                              f"divides {heads}")
    return block_identity.hash_scheme(str(vllm_config.cache_config.prefix_caching_hash_algo))


@dataclass
class _Load:
    request_id: str
    hashes: list[bytes]
    block_ids: list[int]  # vLLM destination blocks, one per hash
    source: tuple[str, str, int] | None = None  # the scheduler's match: worker id, endpoint, TP size


@dataclass
class RemoteG2ConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler → worker: loads to start, full prompt blocks to save (of which request),
    requests vLLM preempted (their blocks may be reused in this very step)."""

    loads: list[_Load] = field(default_factory=list)
    save_hashes: list[bytes] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)
    save_request_ids: list[str] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


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

    hashes: list[bytes]  # vLLM's hash of each full prompt block
    eligible: int = 0  # leading blocks seen in save_threshold requests: only these are saved
    blocks: list[int] = field(default_factory=list)
    saved: int = 0  # leading prompt blocks already sent for saving
    load_from: int = 0  # first block to load (vLLM's local hit, in blocks)
    load_blocks: int = 0
    source: tuple[str, str, int] | None = None  # where the matched blocks would come from: worker id, endpoint, TP
    tried: bool = False  # a remote load was issued: this request never gets another


class RemoteG2Connector(KVConnectorBase_V1):
    """remote-g2 for vLLM: share full prompt blocks through a G2 pool, load others' blocks over NIXL."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if not logging.getLogger("remote_g2").handlers:  # vLLM configures only its own loggers
            from remote_g2.log import configure_logging

            configure_logging()
        # The scheduler and every TP rank run in processes of their own: the default name comes from the
        # engine id they all share.
        engine_id = str(getattr(self._kv_transfer_config, "engine_id", None) or "")
        self.settings = ConnectorSettings.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config or {}),
            default_worker_id=f"vllm-{socket.gethostname()}-{engine_id[:12]}" if engine_id else None)
        self._hash_scheme = check_vllm_config(vllm_config)
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.block_size = int(vllm_config.cache_config.block_size)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kv_load_failure_policy=%r: a failed remote load fails the request; set \"recompute\" to "
                        "recompute the blocks instead", policy)
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self._identity: block_identity.ModelIdentity | None = None
        # scheduler side
        self._registry: Any = None
        self._mirror: Any = None  # a RegistryMirror answering lookups from memory (registry_mirror)
        self._mirror_answered = False
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[_Load] = []
        self._fingerprint: LayoutFingerprint | None = None
        self._failed_sources = FailedSources(self.settings.failed_source_cooldown_s)
        self._seen = SeenBlocks(self.settings.save_threshold)
        # worker side
        self._kv: VllmKvLayout | None = None
        self._pool: Any = None
        self._pool_rows: torch.Tensor | None = None
        self.source: Any = None
        self.target: Any = None
        self._landing: LandingSlots | None = None
        self._saver: BlockSaver | None = None
        self._save_reqs: set[str] = set()  # requests some step's metadata sent blocks of for saving
        self._finishing: set[str] = set()  # of those, finished by vLLM: their blocks are kept until copied
        self._slots_after_keep: list[tuple[Any, list[int]]] = []  # (saver job, landing slots it reads)
        self._fetches = FetchTable()
        self._sync = TpSync()
        self._load_errors: set[int] = set()
        self._received: set[str] = set()
        self._source_failures: set[str] = set()  # for the scheduler, in the next worker metadata
        log.info("remote-g2 connector (%s) for %s: registry %s, worker %s, hashes %s", role.name,
                 vllm_config.model_config.model, self.settings.registry, self.settings.worker_id, self._hash_scheme)
        if role.name == "SCHEDULER":  # vLLM makes the scheduler's connector after the model loaded
            self._model_identity()

    def _model_identity(self) -> block_identity.ModelIdentity:
        """This instance's model identity (the loaded weights' digest), worked out once per process.

        Asked once the weights are on disk: the scheduler's connector is made
        after the model loaded, a worker's asks in ``register_kv_caches``. The
        file digests are cached on the node, so the second process to ask
        (and every restart) reads nothing. Without one, the instance shares
        nothing: the scheduler says so in one warning.
        """
        if self._identity is None:
            vc = self._vllm_config
            self._identity = ident = block_identity.model_identity(vc.model_config, vc.load_config, vc.cache_config,
                                                                   self.settings.model_id)
            if ident.model_id is None:
                if self._role.name == "SCHEDULER":
                    log.warning("remote-g2: not sharing KV blocks: %s", ident.why_not)
            else:
                log.info("remote-g2 model identity %s (%s)", ident.model_id,
                         f"{ident.where}: {ident.weights.summary()}" if ident.weights else ident.where)
        return self._identity

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM consults this while it sets attention backends up: refuse what cannot work there as well."""
        check_vllm_config(vllm_config)
        return None

    # ======================= scheduler side =======================

    def _scheduler_fingerprint(self) -> LayoutFingerprint | None:
        """The layout this worker's blocks have, as the scheduler knows it (model config; dtype resolved).

        None when there is none to match by (no model identity, no layout): then nothing is loaded or saved."""
        model_id = self._model_identity().model_id
        if model_id is None:
            return None
        if self._fingerprint is None:
            mc = self._vllm_config.model_config
            mla = bool(getattr(mc, "use_mla", False))
            try:
                heads = 1 if mla else int(mc.get_total_num_kv_heads())
                layers = int(mc.get_num_layers(self._vllm_config.parallel_config))
                head_dim = int(mc.get_head_size())
            except Exception as e:  # no layout, no fingerprint: never match rather than guess
                log.warning("no layout fingerprint for lookups (%s): not loading remote blocks", e)
                return None
            dtype = block_identity.resolved_kv_dtype(mc.dtype, self._cache_dtype)
            self._fingerprint = block_identity.fingerprint(
                model_id=model_id, dtype=block_identity.kv_dtype_name(dtype, self._cache_dtype),
                block_size=self.block_size, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                scheme=self._hash_scheme, tp_size=self._tp_size, is_mla=mla)
        return self._fingerprint

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past vLLM's local hit that one remote G2 holds (whole blocks; never the last prompt token)."""
        state = self._reqs.get(request.request_id)
        if state is None:
            prompt_len = len(request.prompt_token_ids or ())
            hashes = block_identity.prompt_block_hashes(request.block_hashes, request.num_tokens, prompt_len,
                                                        self.block_size)
            if hashes is None:
                log.warning("%s: %d block hashes for %d tokens of %d-token blocks: not sharing its blocks",
                            request.request_id, len(request.block_hashes), request.num_tokens, self.block_size)
                hashes = []
            state = self._reqs[request.request_id] = _ReqState(hashes, self._seen.count(hashes))
        if not self.settings.target or not self.settings.registry:
            return 0, False
        if state.tried:
            # One remote load per request. vLLM puts a request whose load failed back in the queue and
            # asks again; matching the same source again would retry it for as long as the registry
            # names that source (seen: 21,098 retries in 2 min against a source that had stalled).
            return 0, False
        prompt_len = len(request.prompt_token_ids or ())
        reusable = min((prompt_len - 1) // self.block_size, len(state.hashes))
        local = num_computed_tokens // self.block_size
        if reusable <= local:
            return 0, False
        fp = self._scheduler_fingerprint()
        if fp is None:
            return 0, False
        if self._registry is None:
            from remote_g2.curve import CurveClientConfig
            from remote_g2.registry import RegistryClient, RegistryMirror

            curve = CurveClientConfig.from_env("REMOTE_G2_CURVE_SERVER_KEY")
            self._registry = RegistryClient(self.settings.registry, timeout_s=2.0, curve=curve)
            if self.settings.registry_mirror:
                # Only the workers whose blocks this instance's layout can use: not the whole fleet's index.
                self._mirror = RegistryMirror(self.settings.registry, timeout_s=2.0, curve=curve,
                                              compat_key=fp.compat_key()).start()
        try:
            reply = self._lookup(state.hashes[:reusable], fp.compat_key())
        except RemoteG2Error as e:
            log.warning("registry lookup for %s failed: %s", request.request_id, e)
            return 0, False
        matched = min(int(reply.matched), reusable) if reply.reason == "ok" else 0
        if matched <= local:
            return 0, False
        best = reply.best
        if best is not None and self._failed_sources.remaining(best.worker_id) > 0:
            return 0, False  # a load from it failed moments ago: recompute now rather than wait it out
        if best is not None:
            from remote_g2.target.layout_compat import check_holder_tp

            why = check_holder_tp(fp, best.tp_size)
            if why:  # e.g. TP 2 and TP 3: the same blocks, but no plan reads one from the other
                log.info("%s: %s holds %d blocks this instance cannot read (%s)", request.request_id, best.worker_id,
                         matched, why)
                return 0, False
        state.load_from, state.load_blocks = local, matched - local
        state.source = (best.worker_id, best.endpoint, int(best.tp_size)) if best is not None else None
        # async: the request waits (WAITING_FOR_REMOTE_KVS) while others run; sync: it is scheduled now and the
        # step's forward waits for its READ (start_load_kv blocks).
        return (matched - local) * self.block_size, self.settings.load == "async"

    def _lookup(self, hashes: list[bytes], compat_key: str) -> Any:
        """The registry's answer: from the in-process mirror when it holds a complete copy, else the server."""
        if self._mirror is not None:
            from remote_g2.messages import Lookup

            replies = self._mirror.lookup_many([Lookup(hashes, self.settings.worker_id, compat_key, False)])
            if replies is not None:
                if not self._mirror_answered:
                    self._mirror_answered = True
                    log.info("registry lookups are answered by the in-process registry mirror")
                return replies[0]
        return self._registry.lookup(hashes, requester=self.settings.worker_id, compat_key=compat_key)

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
        self._pending_loads.append(_Load(request.request_id, state.hashes[lo:lo + n], ids[lo:lo + n], state.source))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Give the source of every load that failed there a cooldown, so other requests skip it for a while."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, RemoteG2WorkerMetadata):
            return
        for rid in sorted(meta.source_failures):
            state = self._reqs.get(rid)
            if state is not None and state.source:
                self._failed_sources.note_failure(state.source[0], rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RemoteG2ConnectorMetadata(loads=self._pending_loads,
                                         preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        self._pending_loads = []
        if not self.settings.source or self._scheduler_fingerprint() is None:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.blocks = list(new.block_ids[0])
                after = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
                self._plan_save(meta, new.req_id, state, after)
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
            self._plan_save(meta, req_id, state,
                            cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: RemoteG2ConnectorMetadata, request_id: str, state: _ReqState,
                   computed_after_step: int) -> None:
        full = min(state.eligible, computed_after_step // self.block_size, len(state.blocks))
        if full > state.saved:
            meta.save_hashes += state.hashes[state.saved:full]
            meta.save_block_ids += state.blocks[state.saved:full]
            meta.save_request_ids += [request_id] * (full - state.saved)
            state.saved = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks of a request that had blocks sent for saving until the workers' copies of them ended.

        The rule is the workers' too: a request any step's metadata named in ``save_request_ids`` is
        reported finished sending (``get_finished``) once no copy reads its blocks; vLLM frees them then.
        A request finished while its remote load runs is in ``WAITING_FOR_REMOTE_KVS``: vLLM itself
        keeps its blocks until the worker reports it received, which happens only after its fetches
        ended (and nothing is copied into them then).
        """
        state = self._reqs.pop(request.request_id, None)
        return (state is not None and state.saved > 0), None

    # ======================= worker side =======================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from remote_g2.adapters.host_pool import HostPool
        from remote_g2.source import SourceConfig, maybe_start_source_service
        from remote_g2.target import maybe_start_target_client

        s = self.settings
        comm = _tp_comm(self._tp_size)
        # Every rank digested the same files; should one have failed, none shares (a rank left out of the
        # source's start-up exchange would hang the others).
        mine = self._model_identity().model_id
        ids = comm.allgather(mine) if comm is not None else [mine]
        if None in ids or len(set(ids)) != 1:
            log.info("remote-g2 worker %s: not sharing KV blocks (model identity on the TP ranks: %s)", s.worker_id,
                     ids)
            return
        model_id = ids[0]
        self._sync = TpSync(comm)
        rank, tp = self._sync.rank, self._sync.size
        self._kv = kv = VllmKvLayout.from_kv_caches(kv_caches, self.block_size,
                                                    mla=bool(getattr(self._vllm_config.model_config, "use_mla", False)))
        fp = block_identity.fingerprint(model_id=model_id,
                                        dtype=block_identity.kv_dtype_name(kv.dtype, self._cache_dtype),
                                        block_size=self.block_size, num_layers=len(kv.views),
                                        # MLA: one latent on every rank; otherwise each rank holds its heads
                                        num_kv_heads=kv.kv_heads if kv.is_mla else kv.kv_heads * tp,
                                        head_dim=kv.head_dim, scheme=self._hash_scheme, tp_size=tp,
                                        is_mla=kv.is_mla)
        promised = self._scheduler_fingerprint()
        if promised is not None and promised.compat_key() != fp.compat_key():
            raise ConfigError(f"vLLM's KV tensors on TP rank {rank} ({fp}) differ from what its configuration "
                              f"says ({promised}): the scheduler's lookups would never match this worker's blocks")
        self._pool = HostPool(kv.g2_layout(s.g2_blocks + s.landing_blocks), reserved_blocks=s.landing_blocks)
        self._pool_rows = kv.pool_view(self._pool.tensor)
        self._landing = LandingSlots(self._pool.reserved_block_ids, clock=self._sync.now)
        self._saver = BlockSaver(kv, self._pool, copy_hook=_SAVE_COPY_HOOK)
        common = {"registry_endpoint": s.registry, "fingerprint": fp}
        if s.ipc_dir:
            common["ipc_dir"] = s.ipc_dir
        try:  # both collective over the TP group: every rank starts both, in this order
            if s.source:
                self.source = maybe_start_source_service(
                    self._pool, worker_id=s.worker_id, tp_rank=rank, tp_size=tp, comm=comm,
                    config=replace(SourceConfig.from_env(fingerprint=fp), enabled=True, **common))
            if s.target and s.registry:
                self.target = maybe_start_target_client(
                    self._pool, worker_id=s.worker_id, tp_rank=rank, tp_size=tp, comm=comm,
                    config=s.target_config(**common))
        except BaseException:
            self.shutdown()
            raise
        log.info("remote-g2 worker %s rank %d/%d: %d layers (%s layout, %s, %d of %d KV heads), %d-byte blocks, "
                 "G2 %d blocks + %d landing; source %s, target %s", s.worker_id, rank, tp, len(kv.views), kv.kind,
                 fp.dtype, kv.kv_heads, fp.num_kv_heads, kv.block_bytes, s.g2_blocks, s.landing_blocks,
                 "on" if self.source else "off", "on" if self.target else "off")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteG2ConnectorMetadata)
        if not meta.loads:
            return
        # A block is copied from this instance's own G2 only if every rank holds it (one exchange a step).
        # Each is pinned until its copy is done: the saver's thread stores into G2 meanwhile, and may evict.
        wanted = list(dict.fromkeys(h for load in meta.loads for h in load.hashes))
        rows = [None] * len(wanted) if self._pool is None else \
            [(pinned[0] if (pinned := self._pool.find_and_pin([h])) else None) for h in wanted]
        try:
            agreed = self._sync.held_everywhere([row is not None for row in rows])
            everywhere = {h: row for h, row, ok in zip(wanted, rows, agreed) if ok}
            for load in meta.loads:
                self._start_load(load, everywhere)
        finally:
            if any(row is not None for row in rows):
                self._pool.unpin_blocks_by_id([row for row in rows if row is not None])
        if self.settings.load == "sync":
            self._wait_sync_loads([load.request_id for load in meta.loads])

    def _start_load(self, load: _Load, held_everywhere: dict[bytes, int]) -> None:
        """Copy the blocks this worker's G2 has, wait on those already being fetched, fetch the rest once.

        Every rank takes the same decisions here (``held_everywhere`` — hash → this rank's G2 block — is
        agreed; the fetch table and the landing slots are kept alike by :mod:`.tp_sync`); only the leader
        starts the fetch, whose shares its target client hands to the other ranks, into the same landing slots.
        """
        assert self._pool is not None or self.target is None
        # this worker's G2 block of each hash another request is not already fetching
        held = [None if self._fetches.in_flight(h) else held_everywhere.get(h) for h in load.hashes]
        local = [b is not None for b in held]
        need = self._fetches.to_fetch(load.hashes, local)
        if need and (self.target is None or self._landing is None or self._landing.available() < need):
            why = "no target client" if self.target is None else "no free landing slots"
            log.warning("%s: not loading %d blocks (%s); vLLM recomputes them", load.request_id, len(load.hashes), why)
            self._load_errors.update(load.block_ids)
            if self.settings.load == "async":  # a sync load is no request vLLM waits on
                self._received.add(load.request_id)
            return
        if any(local):  # from our own G2 now: this thread is the only one that evicts from it
            self._copy_local(load, held)
        slots = self._landing.take(need) if need else []
        _, fetch = self._fetches.add(load.request_id, load.hashes, load.block_ids, local=local, new_slots=slots)
        if fetch is not None and self._sync.rank == 0:
            assert self.target is not None
            if load.source is not None:  # the scheduler's lookup: no second registry round trip
                from remote_g2.target import TargetMatch

                wid, endpoint, tp = load.source
                self.target.remember_match(fetch.hashes, TargetMatch(len(fetch.hashes), "ok", wid, endpoint, tp))
            self.target.start_load(fetch.fetch_id, fetch.hashes, fetch.slots)

    def _copy_local(self, load: _Load, held: list[int | None]) -> None:
        """Copy G2 blocks ``held`` (None: not held here) into the load's vLLM blocks."""
        assert self._kv is not None and self._pool_rows is not None
        pairs = [(b, row) for b, row in zip(load.block_ids, held) if row is not None]
        self._kv.scatter([b for b, _ in pairs], self._pool_rows[torch.as_tensor([row for _, row in pairs])])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM runs the request only after get_finished reported it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved at once, in wait_for_save

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a step's forward: wait for the copies reading blocks of requests vLLM preempted.

        vLLM freed those blocks when it preempted the request and may hand them to another request in
        this very step. Should a copy not end in time, its blocks are dropped instead of stored: a
        block overwritten while it was copied must never enter G2.
        """
        meta = kv_connector_metadata
        if self._saver is None or not isinstance(meta, RemoteG2ConnectorMetadata) or not meta.preempted:
            return
        t0 = time.perf_counter()
        if not self._saver.wait_for(meta.preempted, timeout_s=_PREEMPT_WAIT_S):
            log.error("copies of preempted requests %s did not end within %.0f s: their blocks are not saved",
                      sorted(meta.preempted), _PREEMPT_WAIT_S)
            self._saver.drop(meta.preempted)
        else:
            log.info("%d requests preempted: no copy reads their blocks any more (waited %.1f ms)",
                     len(meta.preempted), (time.perf_counter() - t0) * 1e3)

    def wait_for_save(self) -> None:
        """Queue this step's newly full prompt blocks for the saver's thread (:mod:`.saver`); returns at once."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteG2ConnectorMetadata)
        if not meta.save_hashes:
            return
        # Every rank sees the same metadata: each reports these requests finished sending alike.
        self._save_reqs.update(meta.save_request_ids)
        if self._saver is not None:
            self._saver.submit(meta.save_request_ids, meta.save_hashes, meta.save_block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(sent, received)``: finished requests none of whose blocks a save still copies (vLLM frees their
        blocks now), and requests whose remote load ended (loaded or failed) since the last call."""
        for rid in finished_req_ids:
            if self._fetches.abort(rid):
                log.info("%s finished by vLLM while its remote load runs: its blocks get nothing", rid)
            if rid in self._save_reqs:
                self._save_reqs.discard(rid)
                self._finishing.add(rid)
        if self._slots_after_keep:
            self._give_back_kept_slots()
        sent: set[str] = set()
        if self._finishing:
            sent = {rid for rid in self._finishing if self._saver is None or not self._saver.pending(rid)}
            self._finishing -= sent
        received, self._received = self._received, set()
        ready: list[RequestLoad] = self._fetches.ready_now()
        if self.target is not None and len(self._fetches):
            ready += self._take_ended(self._sync.leader_outcome(self._leader_outcome()))
        for load in ready:
            self._finish(load)
            if self.settings.load == "async":  # vLLM waits on async loads only
                received.add(load.request_id)
        return (sent or None), (received or None)

    def _take_ended(self, ended: FetchOutcome) -> list[RequestLoad]:
        """Apply the fetches that ended (the same outcome on every rank); the requests now ready."""
        ready: list[RequestLoad] = []
        for fid in sorted(ended.done | ended.failed):
            fetch = self._fetches.fetch(fid)
            if fetch is None:
                continue
            good = valid_prefix(fetch.slots, ended.invalid) if fid in ended.done else 0
            ready += self._fetches.ended(fid, good, failed=fid in ended.failed)
            if good and self._saver is not None:  # kept in G2 too, off this thread: shared and reused later
                fetch.kept = True  # on every rank alike, whether or not this rank's G2 already held them
                fetch.keep = self._saver.submit_landed(fetch.hashes[:good], fetch.slots[:good])
            if fid in ended.failed:
                self._source_failures.add(fid)
            log.info("fetch %s: %d of %d blocks read from a remote G2", fid, good, len(fetch.hashes))
        return ready

    def _wait_sync_loads(self, request_ids: list[str]) -> None:
        """``load="sync"``: block until this step's loads ended, their blocks copied into vLLM's (or listed for
        recompute by ``get_block_ids_with_load_errors``, which vLLM asks right after this step's forward).

        Bounded: the target client ends every load within its transfer and RPC timeouts; should rank 0 still
        be waiting a second after that, every rank gives the loads up (their blocks are recomputed, and a
        late end copies nothing into them).
        """
        pending = {rid for rid in request_ids if self._fetches.load(rid) is not None}
        cfg = self.target.config if self.target is not None else None
        wait_s = 1.0 + ((cfg.transfer_timeout_ms + 2 * cfg.rpc_timeout_ms) / 1e3 if cfg is not None else 0.0)
        deadline = time.monotonic() + wait_s  # only rank 0 checks it
        ready = [ld for ld in self._fetches.ready_now() if ld.request_id in pending]
        while True:
            for load in ready:  # (a load given up in an earlier step may end here too: nothing is copied)
                self._finish(load)
                pending.discard(load.request_id)
            if not pending:
                return
            assert self.target is not None  # a load waiting on a fetch has a target client
            mine = None
            if self._sync.rank == 0:
                self.target.wait_finished(max(0.0, min(0.05, deadline - time.monotonic())))
                mine = self._leader_outcome()
                if time.monotonic() > deadline:
                    mine = replace(mine, expired=True)
            ended = self._sync.leader_outcome(mine)
            if ended.expired:
                log.error("sync loads %s did not end within %.1f s: vLLM recomputes their blocks", sorted(pending),
                          wait_s)
                for rid in pending:
                    load = self._fetches.load(rid)
                    if load is not None and self._fetches.abort(rid):
                        self._load_errors.update(load.block_ids)
                return
            ready = self._take_ended(ended)

    def _leader_outcome(self) -> FetchOutcome | None:
        """Rank 0: the fetches its target client finished (every rank's share ended, or timed out). Other
        ranks: None; they drain their own shares' outcomes, which the leader has already counted."""
        assert self.target is not None
        if self._sync.rank != 0:
            self.target.get_finished_shares()
            self.target.share_invalid_block_ids()
            return None
        done, failed = self.target.get_finished()
        if failed:
            self.target.failure_reasons()  # the target client logged each one (with the backend's words)
        return FetchOutcome(done, failed, self.target.invalid_block_ids())

    def _finish(self, load: RequestLoad) -> None:
        """Copy a ready request's blocks into vLLM's (unless vLLM finished it), give back freed slots."""
        good = load.good_blocks()
        if load.aborted:
            log.info("%s: dropped %d loaded blocks (vLLM finished the request)", load.request_id, good)
        else:
            remote = [(b, f.slots[i]) for (f, i), b in zip(load.parts[:good], load.block_ids) if f is not None]
            if remote:
                assert self._kv is not None and self._pool_rows is not None
                self._kv.scatter([b for b, _ in remote], self._pool_rows[torch.as_tensor([s for _, s in remote])])
            self._load_errors.update(load.block_ids[good:])
            log.info("%s: %d of %d blocks loaded from a remote G2", load.request_id, good, len(load.block_ids))
        assert self._landing is not None or not load.fetches()
        for fetch in self._fetches.done(load):
            if fetch.failed:
                self._landing.quarantine(fetch.slots)
            elif fetch.kept:  # the saver may still read them: back at the next step, on every rank
                self._slots_after_keep.append((fetch.keep, fetch.slots))
            else:
                self._landing.give_back(fetch.slots)

    def _give_back_kept_slots(self) -> None:
        """Landing slots whose blocks the saver kept in G2 go back once its job ended.

        At the same point of the next step on every rank (the job took a copy's time; should it be slower,
        this waits), so the ranks' landing slots stay alike (:mod:`.tp_sync`)."""
        kept, self._slots_after_keep = self._slots_after_keep, []
        for job, slots in kept:
            assert self._saver is not None and self._landing is not None
            if job is not None and not self._saver.wait_job(job):
                log.error("keeping %d loaded blocks in G2 did not end: their landing slots sit out a quarantine",
                          len(job.hashes))
                self._landing.quarantine(slots)
            else:
                self._landing.give_back(slots)

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
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        for name in ("target", "source"):
            hook = getattr(self, name)
            if hook is not None:
                try:
                    hook.shutdown()
                except Exception:
                    log.exception("remote-g2 %s shutdown failed", name)
                setattr(self, name, None)
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
        if self._registry is not None:
            self._registry.close()
            self._registry = None
