"""The connector's worker side (each vLLM model runner; one per TP rank): G2, saves, loads.

* ``register_kv_caches`` builds the rank's G2 pool (a
  :class:`~remote_g2.adapters.host_pool.HostPool` in remote-g2's block
  layout, over the rank's own KV heads, plus landing slots), checks that the
  tensors it was given have the dtype and shape the configuration's
  fingerprint promised, and starts the source service and target client on
  it — the same hooks an engine executor calls. At ``tensor_parallel_size >
  1`` their start-up exchange runs over vLLM's CPU TP group
  (:class:`~remote_g2.tp.torch_group.TorchGroupComm`), rank 0's target client
  resolves each load and hands every rank its share (heterogeneous TP as the
  core plans it), and the ranks agree on what each step decides
  (:mod:`.tp_sync`).
* ``wait_for_save`` queues the step's new full prompt blocks for the
  worker's copy thread (:mod:`.saver`), which copies them into G2 beside the
  engine's next step; the source's pool listener publishes them to the
  registry once copied (a LoRA request's blocks only if its adapter's files
  are still the ones digested, checked after the forward:
  :mod:`.lora_identity`). A finished request's blocks are kept (vLLM's delayed
  free) until ``get_finished`` reports no copy reads them any more, and
  ``handle_preemptions`` waits for a preempted request's copies before its
  blocks can be reused.
* ``start_load_kv`` starts each request's load: blocks already in this
  worker's G2 are copied at once, blocks another request is already fetching
  are waited for (:mod:`.fetches`: one READ per block), the rest are read
  into landing slots; ``get_finished`` polls the target client (in a step
  that runs no forward, the leader first waits a little for a fetch to end),
  copies what arrived into vLLM's blocks and reports the request as
  received; ``get_block_ids_with_load_errors`` lists the blocks vLLM must
  recompute (with ``kv_load_failure_policy="recompute"``). The landed blocks
  are kept in G2 too, by the saver, from the ``wait_for_save`` after they
  landed: their copy runs beside a later step's forward, not beside the one
  that first uses them; their landing slots go back a step after that.

Abort safety: vLLM keeps the blocks of a request it finishes while that
request waits for remote KV (``WAITING_FOR_REMOTE_KVS``) until the connector
reports the request received; the connector reports it only once every fetch
it waits on has ended, and copies nothing into the blocks of a request vLLM
has finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from remote_g2.errors import ConfigError

from ..landing_slots import LandingSlots, valid_prefix
from . import block_identity
from .fetches import FetchTable, RequestLoad
from .instance_identity import InstanceIdentity
from .kv_blocks import VllmKvLayout
from .lora_identity import changed_adapters
from .metadata import LoadPlan, RemoteG2ConnectorMetadata, RemoteG2WorkerMetadata
from .saver import BlockSaver
from .tp_sync import FetchOutcome, TpSync

__all__ = ["WorkerSide"]

log = logging.getLogger("remote_g2.adapters.vllm")

#: How long a step waits for the copies of a preempted request's blocks before it drops them.
_PREEMPT_WAIT_S = 30.0
#: In a step that runs no forward (every request waits, some for their remote KV), how long the leader
#: waits for a fetch to end before the ranks compare notes: the load is reported in this step rather
#: than a later one, and vLLM's engine loop, which steps without pause while requests wait, sleeps
#: instead of spinning the cores the READs and the sources need. Nothing else is scheduled to wait.
_IDLE_STEP_WAIT_S = 0.005
#: Tests only: called in the saver's thread between a job's gather and its store (see :mod:`.saver`).
SAVE_COPY_HOOK: Any = None


def _tp_comm(tp_size: int) -> Any:
    """vLLM's CPU TP group as the TP-group communicator (None at TP 1)."""
    if tp_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    from remote_g2.tp.torch_group import TorchGroupComm

    group = get_tp_group()
    comm = TorchGroupComm(group.cpu_group)
    if comm.Get_size() != tp_size:
        raise ConfigError(f"vLLM's TP group has {comm.Get_size()} ranks, tensor_parallel_size is {tp_size}")
    return comm


class WorkerSide:
    """One TP rank's half of one instance's connector."""

    def __init__(self, ident: InstanceIdentity) -> None:
        self._ident = ident
        self.settings = ident.settings
        self.block_size = ident.block_size
        self._kv: VllmKvLayout | None = None
        self.pool: Any = None
        self.pool_rows: torch.Tensor | None = None
        self.source: Any = None
        self.target: Any = None
        self.unshared: Any = None  # the registration of an instance without an identity (_announce_unshared)
        self._landing: LandingSlots | None = None
        self.saver: BlockSaver | None = None
        self._save_reqs: set[str] = set()  # requests some step's metadata sent blocks of for saving
        self._finishing: set[str] = set()  # of those, finished by vLLM: their blocks are kept until copied
        self._keep_due: list[Any] = []  # fetches whose good blocks the next wait_for_save hands the saver
        self._slots_after_keep: list[Any] = []  # fetches whose landing slots go back once the saver kept them
        self._step = 0  # this worker's step count (every rank counts alike: vLLM steps them together)
        self._fetches = FetchTable()
        self._sync = TpSync()
        self._load_errors: set[int] = set()
        self._received: set[str] = set()
        self._source_failures: set[str] = set()  # for the scheduler, in the next worker metadata
        self._idle_step = False  # this step runs no forward (its metadata says)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from remote_g2.adapters.host_pool import HostPool
        from remote_g2.source import SourceConfig, maybe_start_source_service
        from remote_g2.target import maybe_start_target_client

        s = self.settings
        comm = _tp_comm(self._ident.tp_size)
        # Every rank digested the same files; should one have failed, none shares (a rank left out of the
        # source's start-up exchange would hang the others).
        mine = self._ident.model_identity().model_id
        ids = comm.allgather(mine) if comm is not None else [mine]
        if None in ids or len(set(ids)) != 1:
            log.info("remote-g2 worker %s: not sharing KV blocks (model identity on the TP ranks: %s)", s.worker_id,
                     ids)
            if comm is None or int(comm.Get_rank()) == 0:
                self._announce_unshared(kv_caches)
            return
        model_id = ids[0]
        links = None
        if comm is not None and s.tp_exchange == "links":
            from .tp_links import connect_step_links

            links = connect_step_links(comm, s.worker_id, s.ipc_dir)
        self._sync = TpSync(comm, links)
        rank, tp = self._sync.rank, self._sync.size
        self._kv = kv = VllmKvLayout.from_kv_caches(kv_caches, self.block_size,
                                                    mla=self._ident.is_mla)
        fp = block_identity.fingerprint(model_id=model_id,
                                        dtype=block_identity.kv_dtype_name(kv.dtype, self._ident.cache_dtype),
                                        block_size=self.block_size, num_layers=len(kv.views),
                                        # MLA: one latent on every rank; otherwise each rank holds its heads
                                        num_kv_heads=kv.kv_heads if kv.is_mla else kv.kv_heads * tp,
                                        head_dim=kv.head_dim, scheme=self._ident.hash_scheme, tp_size=tp,
                                        is_mla=kv.is_mla)
        promised = self._ident.fingerprint()
        if promised is not None and promised.compat_key() != fp.compat_key():
            raise ConfigError(f"vLLM's KV tensors on TP rank {rank} ({fp}) differ from what its configuration "
                              f"says ({promised}): the scheduler's lookups would never match this worker's blocks")
        self.pool = HostPool(kv.g2_layout(s.g2_blocks + s.landing_blocks), reserved_blocks=s.landing_blocks)
        if s.g2_prefault:
            self.pool.prefault()  # landing slots first: no READ or save pays the pool's first touch
        self.pool_rows = kv.pool_view(self.pool.tensor)
        self._landing = LandingSlots(self.pool.reserved_block_ids, clock=self._sync.now)
        self.saver = BlockSaver(kv, self.pool, copy_hook=SAVE_COPY_HOOK)
        common = {"registry_endpoint": s.registry, "fingerprint": fp}
        if s.ipc_dir:
            common["ipc_dir"] = s.ipc_dir
        try:  # both collective over the TP group: every rank starts both, in this order
            if s.source:
                self.source = maybe_start_source_service(
                    self.pool, worker_id=s.worker_id, tp_rank=rank, tp_size=tp, comm=comm,
                    config=replace(SourceConfig.from_env(fingerprint=fp), enabled=True, **common))
            if s.target and s.registry:
                self.target = maybe_start_target_client(
                    self.pool, worker_id=s.worker_id, tp_rank=rank, tp_size=tp, comm=comm,
                    config=s.target_config(**common))
        except BaseException:
            self.shutdown()
            raise
        log.info("remote-g2 worker %s rank %d/%d: %d layers (%s layout, %s, %d of %d KV heads), %d-byte blocks, "
                 "G2 %d blocks + %d landing; source %s, target %s", s.worker_id, rank, tp, len(kv.views), kv.kind,
                 fp.dtype, kv.kv_heads, fp.num_kv_heads, kv.block_bytes, s.g2_blocks, s.landing_blocks,
                 "on" if self.source else "off", "on" if self.target else "off")

    def _announce_unshared(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register this instance without an identity (TP rank 0), so that ``admin models`` shows it and why.

        It registers under :func:`~remote_g2.identity.model_identity.unshared_model_id` (an identity no other instance
        has: nothing matches it either way), publishes no block and keeps its lease by heartbeats; routers'
        scores list it as unscored. Best effort: a registry it cannot reach costs a log line, nothing else.
        """
        s = self.settings
        if not s.registry:
            return
        from remote_g2.identity.model_identity import unshared_model_id
        from remote_g2.registry import RegistryClient, SourcePublisher
        from remote_g2.source import SourceConfig

        mine = self._ident.model_identity()
        kind = mine.kind if mine.model_id is None else "ranks_differ"
        try:
            kv = VllmKvLayout.from_kv_caches(kv_caches, self.block_size, mla=self._ident.is_mla)
            tp = self._ident.tp_size
            fp = block_identity.fingerprint(
                model_id=unshared_model_id(str(self._ident.vllm_config.model_config.model), kind),
                dtype=block_identity.kv_dtype_name(kv.dtype, self._ident.cache_dtype), block_size=self.block_size,
                num_layers=len(kv.views), num_kv_heads=kv.kv_heads if kv.is_mla else kv.kv_heads * tp,
                head_dim=kv.head_dim, scheme=self._ident.hash_scheme, tp_size=tp, is_mla=kv.is_mla)
            cfg = SourceConfig.from_env(fingerprint=fp)
            client = RegistryClient(s.registry, timeout_s=cfg.registry_timeout_s, curve=cfg.registry_curve)
            self.unshared = SourcePublisher(client, worker_id=s.worker_id, endpoint=f"unshared://{s.worker_id}",
                                            fingerprint=fp, snapshot=tuple).start()
        except Exception as e:  # (what it would show is in the log already)
            log.warning("remote-g2 worker %s: not registered for operators to see: %s", s.worker_id, e)

    def start_load_kv(self, meta: RemoteG2ConnectorMetadata) -> None:
        # vLLM calls this first of the step's hooks (before the forward for sync loads, after it otherwise)
        self._step += 1
        self._idle_step = meta.idle
        if not meta.loads:
            return
        # A block is copied from this instance's own G2 only if every rank holds it (one exchange a step).
        # Each is pinned until its copy is done: the saver's thread stores into G2 meanwhile, and may evict.
        wanted = list(dict.fromkeys(h for load in meta.loads for h in load.hashes))
        rows = [None] * len(wanted) if self.pool is None else \
            [(pinned[0] if (pinned := self.pool.find_and_pin([h])) else None) for h in wanted]
        try:
            agreed = self._sync.held_everywhere([row is not None for row in rows])
            everywhere = {h: row for h, row, ok in zip(wanted, rows, agreed) if ok}
            for load in meta.loads:
                self._start_load(load, everywhere)
        finally:
            if any(row is not None for row in rows):
                self.pool.unpin_blocks_by_id([row for row in rows if row is not None])
        if self.settings.load == "sync":
            self._wait_sync_loads([load.request_id for load in meta.loads])

    def _start_load(self, load: LoadPlan, held_everywhere: dict[bytes, int]) -> None:
        """Copy the blocks this worker's G2 has, wait on those already being fetched, fetch the rest once.

        Every rank takes the same decisions here (``held_everywhere`` — hash → this rank's G2 block — is
        agreed; the fetch table and the landing slots are kept alike by :mod:`.tp_sync`); only the leader
        starts the fetch, whose shares its target client hands to the other ranks, into the same landing slots.
        """
        assert self.pool is not None or self.target is None
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
        if any(local):  # from our own G2 now: start_load_kv pinned these rows, so the saver cannot evict them
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

    def _copy_local(self, load: LoadPlan, held: list[int | None]) -> None:
        """Copy G2 blocks ``held`` (None: not held here) into the load's vLLM blocks."""
        pairs = [(b, row) for b, row in zip(load.block_ids, held) if row is not None]
        self._into_vllm([b for b, _ in pairs], [row for _, row in pairs])

    def _into_vllm(self, block_ids: list[int], rows: list[int]) -> None:
        """Copy G2 pool rows into vLLM blocks: one C++ copy on a host KV, else (a device's) torch's."""
        assert self._kv is not None and self.pool_rows is not None
        if not self._kv.scatter_rows(block_ids, self.pool.tensor, rows):
            self._kv.scatter(block_ids, self.pool_rows[torch.as_tensor(rows)])

    def handle_preemptions(self, meta: RemoteG2ConnectorMetadata) -> None:
        """Before a step's forward: wait for the copies reading blocks of requests vLLM preempted.

        vLLM freed those blocks when it preempted the request and may hand them to another request in
        this very step. Should a copy not end in time, its blocks are dropped instead of stored: a
        block overwritten while it was copied must never enter G2.
        """
        if self.saver is None or not meta.preempted:
            return
        t0 = time.perf_counter()
        if not self.saver.wait_for(meta.preempted, timeout_s=_PREEMPT_WAIT_S):
            log.error("copies of preempted requests %s did not end within %.0f s: their blocks are not saved",
                      sorted(meta.preempted), _PREEMPT_WAIT_S)
            self.saver.drop(meta.preempted)
        else:
            log.info("%d requests preempted: no copy reads their blocks any more (waited %.1f ms)",
                     len(meta.preempted), (time.perf_counter() - t0) * 1e3)

    def wait_for_save(self, meta: RemoteG2ConnectorMetadata) -> None:
        """Queue this step's newly full prompt blocks, and the blocks loads landed before this step's forward,
        for the saver's thread (:mod:`.saver`); returns at once."""
        if self._keep_due:
            self._submit_keeps()
        if not meta.save_hashes:
            return
        # Every rank sees the same metadata: each reports these requests finished sending alike.
        self._save_reqs.update(meta.save_request_ids)
        if self.saver is None:
            return
        rids, hashes, blocks = meta.save_request_ids, meta.save_hashes, meta.save_block_ids
        changed = changed_adapters(meta.save_lora, meta.lora_files) if meta.save_lora else set()
        if changed:  # after this forward: whatever vLLM loaded of the adapter may not be what was digested
            keep = [i for i in range(len(hashes)) if i >= len(meta.save_lora) or meta.save_lora[i] not in changed]
            log.warning("not saving %d blocks of LoRA adapters whose files changed since they were digested (%s)",
                        len(hashes) - len(keep), ", ".join(k[:16] for k in sorted(changed)))
            rids, hashes, blocks = [rids[i] for i in keep], [hashes[i] for i in keep], [blocks[i] for i in keep]
        if hashes:
            self.saver.submit(rids, hashes, blocks)

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
            sent = {rid for rid in self._finishing if self.saver is None or not self.saver.pending(rid)}
            self._finishing -= sent
        received, self._received = self._received, set()
        ready: list[RequestLoad] = self._fetches.ready_now()
        if self.target is not None and len(self._fetches):
            if self._idle_step and self._sync.rank == 0 and self.settings.load == "async":
                self.target.wait_finished(_IDLE_STEP_WAIT_S)
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
            if good and self.saver is not None:  # kept in G2 too, after this step's forward: shared, reused later
                self._keep_due.append(fetch)
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
                self._into_vllm([b for b, _ in remote], [s for _, s in remote])
            self._load_errors.update(load.block_ids[good:])
            log.info("%s: %d of %d blocks loaded from a remote G2", load.request_id, good, len(load.block_ids))
        assert self._landing is not None or not load.fetches()
        for fetch in self._fetches.done(load):
            if fetch.failed:
                self._landing.quarantine(fetch.slots)
            elif fetch.good and self.saver is not None:  # the saver keeps them (_submit_keeps): back a step
                # later, on every rank alike, whether or not this rank's G2 already held them (keep None)
                self._slots_after_keep.append(fetch)
            else:
                self._landing.give_back(fetch.slots)

    def _submit_keeps(self) -> None:
        """Hand the saver the good blocks of the fetches that ended before this step's forward."""
        assert self.saver is not None
        due, self._keep_due = self._keep_due, []
        for fetch in due:
            fetch.keep = self.saver.submit_landed(fetch.hashes[:fetch.good], fetch.slots[:fetch.good])
            fetch.kept_step = self._step

    def _give_back_kept_slots(self) -> None:
        """Landing slots whose blocks the saver kept in G2 go back once its job ended.

        In the first step after the one that handed the job over, at the same point on every rank (the
        job took a copy's time; should it be slower, this waits), so the ranks' landing slots stay alike
        (:mod:`.tp_sync`)."""
        later = []
        kept, self._slots_after_keep = self._slots_after_keep, []
        for fetch in kept:
            assert self.saver is not None and self._landing is not None
            if fetch.kept_step is None or fetch.kept_step >= self._step:  # not handed over before this step
                later.append(fetch)
            elif fetch.keep is not None and not self.saver.wait_job(fetch.keep):
                log.error("keeping %d loaded blocks in G2 did not end: their landing slots sit out a quarantine",
                          len(fetch.keep.hashes))
                self._landing.quarantine(fetch.slots)
            else:
                self._landing.give_back(fetch.slots)
        self._slots_after_keep = later

    def build_connector_worker_meta(self) -> RemoteG2WorkerMetadata | None:
        """This step's loads that failed at the source (see :class:`RemoteG2WorkerMetadata`)."""
        if not self._source_failures:
            return None
        out, self._source_failures = self._source_failures, set()
        return RemoteG2WorkerMetadata(out)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._sync.close()
        unshared, self.unshared = self.unshared, None
        if unshared is not None:
            unshared.close(flush_timeout_s=0.5)
            unshared.client.close()
        if self.pool is not None:
            self.pool.stop_prefault()
        if self.saver is not None:
            self.saver.close()
            self.saver = None
        for name in ("target", "source"):
            hook = getattr(self, name)
            if hook is not None:
                try:
                    hook.shutdown()
                except Exception:
                    log.exception("remote-g2 %s shutdown failed", name)
                setattr(self, name, None)
