"""The connector's scheduler side (vLLM's scheduler process): what to load from where, what to save.

* ``get_num_new_matched_tokens`` takes vLLM's own block hashes of the
  prompt's full blocks (``request.block_hashes``: they fold in the LoRA
  adapter's name and path, multimodal inputs, ``cache_salt`` and prompt
  embeddings; see :mod:`.block_identity`) — for a LoRA request bound to the
  digest of the adapter's files (:mod:`.lora_identity`; an adapter without
  one shares nothing) — and asks the registry (its in-process mirror by
  default) how many leading blocks one other worker with the same layout
  fingerprint holds; the tokens beyond vLLM's local prefix hit are loaded.
* ``update_state_after_alloc`` records the destination blocks;
  ``build_connector_meta`` sends the step's loads, the blocks to save (prompt
  blocks that became full, seen in ``save_threshold`` requests:
  :mod:`.seen_blocks`) and the requests vLLM preempted to the workers.
* ``request_finished`` keeps the blocks of a request that had blocks sent
  for saving until the workers report their copies ended.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from remote_g2.errors import RemoteG2Error

from ..failed_sources import FailedSources
from . import block_identity
from .instance_identity import InstanceIdentity
from .lora_identity import LoraIdentities, LoraIdentity, lora_block_keys, lora_options
from .metadata import LoadPlan, RemoteG2ConnectorMetadata, RemoteG2WorkerMetadata
from .seen_blocks import SeenBlocks

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger("remote_g2.adapters.vllm")


@dataclass
class _ReqState:
    """The scheduler side's view of one request."""

    hashes: list[bytes]  # vLLM's hash of each full prompt block (a LoRA request's: bound to its adapter's key)
    eligible: int = 0  # leading blocks seen in save_threshold requests: only these are saved
    blocks: list[int] = field(default_factory=list)
    saved: int = 0  # leading prompt blocks already sent for saving
    load_from: int = 0  # first block to load (vLLM's local hit, in blocks)
    load_blocks: int = 0
    source: tuple[str, str, int] | None = None  # where the matched blocks would come from: worker id, endpoint, TP
    tried: bool = False  # a remote load was issued: this request never gets another
    adapter: LoraIdentity | None = None  # a LoRA request's adapter: re-checked before each lookup and save


class SchedulerSide:
    """The scheduler's half of one instance's connector."""

    def __init__(self, ident: InstanceIdentity) -> None:
        self._ident = ident
        self.settings = ident.settings
        self.block_size = ident.block_size
        self._registry: Any = None
        self._mirror: Any = None  # a RegistryMirror answering lookups from memory (registry_mirror)
        self._mirror_answered = False
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadPlan] = []
        self._failed_sources = FailedSources(self.settings.failed_source_cooldown_s)
        self._seen = SeenBlocks(self.settings.save_threshold)
        # Built before vLLM loads any adapter (the engine takes no request, no add_lora, before its scheduler).
        self._loras = LoraIdentities(lora_options(getattr(ident.vllm_config, "lora_config", None)))
        ident.model_identity()  # vLLM makes the scheduler's connector after the model loaded

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
            adapter = None
            lora = getattr(request, "lora_request", None)
            if lora is not None and hashes:  # (no fingerprint: nothing is shared, so nothing to digest)
                if self._ident.fingerprint() is not None:
                    adapter = self._loras.identity(str(lora.lora_name), str(lora.lora_path))
                key = adapter.key if adapter is not None else None
                hashes = lora_block_keys(key, hashes) if key is not None else []
            state = self._reqs[request.request_id] = _ReqState(hashes, self._seen.count(hashes), adapter=adapter)
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
        if reusable <= local or not self._adapter_ok(state):
            return 0, False
        fp = self._ident.fingerprint()
        if fp is None:
            return 0, False
        if self._registry is None:
            from remote_g2.rpc.curve import CurveClientConfig
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

    def _adapter_ok(self, state: _ReqState) -> bool:
        """Whether a LoRA request's adapter still has the identity its blocks' keys were made with (no adapter: yes).

        Once its files changed the request neither looks up nor saves another block."""
        if state.adapter is None:
            return True
        if self._loras.still_valid(state.adapter) is None:
            state.adapter, state.hashes, state.eligible = None, [], 0
            return False
        return True

    def _lookup(self, hashes: list[bytes], compat_key: str) -> Any:
        """The registry's answer: from the in-process mirror when it holds a complete copy, else the server."""
        if self._mirror is not None:
            from remote_g2.protocol.messages import Lookup

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
        self._pending_loads.append(LoadPlan(request.request_id, state.hashes[lo:lo + n], ids[lo:lo + n], state.source))

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
                                         preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                                         idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._pending_loads = []
        # Each adapter's files are stat-checked again at their first use in this step's saves, then in the next
        # step's lookups (vLLM schedules, and so looks up, before it builds a step's metadata).
        self._loras.new_step()
        if not self.settings.source or self._ident.fingerprint() is None:
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
        if full > state.saved and self._adapter_ok(state):
            if state.adapter is not None or meta.save_lora:  # a worker checks the adapter again after the forward
                meta.add_lora_saves(len(meta.save_hashes), state.adapter, full - state.saved)
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

    def shutdown(self) -> None:
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
        if self._registry is not None:
            self._registry.close()
            self._registry = None
