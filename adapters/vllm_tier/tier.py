"""remote-g2 as a secondary tier of vLLM's offloading: chunks found fleet-wide, READ from the peer that holds them.

vLLM's tiering stack (``OffloadingConnector`` + ``TieringOffloadingSpec``)
owns the copies between the GPU and its primary CPU tier. This tier adds what
it lacks: the fleet-wide index of which live, compatible peer holds which
chunk, the READ from that peer's primary region with no router in the loop,
and the leases that keep the chunk there meanwhile. Configuration (one entry
of ``secondary_tiers`` in ``kv_connector_extra_config``)::

    {"type": "RemoteG2Tier", "module_path": "remote_g2.adapters.vllm_tier.tier",
     "registry": "tcp://registry:7450",        # or REMOTE_G2_REGISTRY
     "worker_id": "pod-a",                     # default: host and pid
     "bind": "tcp://0.0.0.0:0", "advertise": "tcp://10.0.0.5:0",   # where peers reach this instance
     "pin_leases": false,                      # true: pin chunks for peers at the next step (serving.py)
     "publish_interval_s": 0.25,               # batches to the registry at most this often (below)
     "fetch_switch_interval_s": 0.0005}        # the GIL's switch interval while a fetch runs (fetching.py)

The contract with vLLM's manager (``vllm/v1/kv_offload/tiering/base.py``):
every call below runs on the scheduler thread and returns at once; the work
is done by threads of :mod:`.serving` and :mod:`.fetching`.

* **lookup:** the registry, through its in-process mirror
  (:class:`~remote_g2.registry.RegistryMirror`): ``HIT`` when a live peer of
  the same fingerprint (:mod:`.identity`) holds the chunk, ``MISS``
  otherwise, and while the mirror has no complete copy yet. A chunk whose
  load failed is a ``MISS`` for ``failed_ttl_s``, so it is not tried every step.
* **submit_load:** :class:`~.fetching.ChunkFetcher`: resolve and lease at the
  holder, one NIXL READ into the rows the manager reserved, release; or,
  once the holder granted its chunk table, the rows found there with
  one-sided READs and no RPC; partial success reported by key.
* **submit_store:** the chunk is complete in the primary tier: it is
  published (a :class:`~remote_g2.registry.SourcePublisher` registered under
  the tier's fingerprint and this instance's serving endpoint). The job ends
  at once: the chunk stays where the primary keeps it.
* **Serving peers:** :class:`~.serving.ChunkServer`. Where the tier sees the
  primary's evictions (below), a peer's ask is answered at once from the
  rows of the chunks stored, and its lease is validated at release by the
  rows' generations (an eviction mid-READ fails those chunks). Otherwise
  asks are pinned through the ``ParentManager`` in
  ``serve_external_requests``, and unpinned when their lease ends.
* **Eviction:** the manager tells a tier nothing when the primary evicts, so
  the tier wraps the primary's cache policy (:func:`watch_evictions`: its
  ``evict``, ``remove`` and ``clear``) and unpublishes each key as it leaves.
  The registry lags by the publisher's batching and the feed: a store or an
  eviction after a quiet spell goes 50 ms after it, while under a steady
  stream batches go every ``publish_interval_s`` (0.25 s): each batch wakes
  the publisher, the registry server and every mirror, and on vLLM's CPU
  backend each wake stalls the forward's OpenMP team. Where the
  primary is not found, a published chunk a peer asks for and that is gone
  is answered ``miss`` and unpublished then, and the published set is capped
  at the primary's row count. Either way a chunk the registry still names
  but the holder no longer has is a failed load, recomputed, never read
  wrong.
* **An idle engine:** validated leases need no engine step. Pinned ones are
  served only while the engine steps: the tier says it has work only while
  asks wait or pinned leases are open, and a new ask wakes an idle engine
  (vLLM's own ``WAKEUP`` on the engine core's input queue), so an idle
  instance costs no steps either way (docs/benchmarks.md).
* **A killed instance leaves no region behind:** once every process of the
  engine has mapped the primary's ``/dev/shm`` file, the tier unlinks its
  name (:func:`forget_region_name`); the memory goes with the last mapping.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import Locality, LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from remote_g2.protocol.messages import Lookup

from .fetching import ChunkFetcher, LoadRun
from .identity import TierIdentity, tier_identity, vllm_config_of_caller
from .serving import TIER_GROUP, ChunkServer

__all__ = ["RemoteG2Tier"]

log = logging.getLogger("remote_g2.adapters.vllm_tier")

_TIER_SUFFIX = TIER_GROUP.to_bytes(4, "big")  # the end of the OffloadKey of a chunk of the shared group


def _engine_input_queue(max_depth: int = 48) -> Any:
    """A weak reference to the engine core whose construction built this tier (its ``input_queue`` is read at
    wake time), or None (an engine built some other way: then peers are served whenever it steps)."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if type(owner).__name__.endswith("EngineCoreProc") and isinstance(getattr(owner, "input_queue", None),
                                                                             queue.Queue):
            return weakref.ref(owner)
        frame = frame.f_back
    return None


def _primary_of_caller(max_depth: int = 8) -> Any:
    """The primary tier vLLM built just before this tier (``TieringOffloadingSpec.get_manager``'s local), or None."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        primary = frame.f_locals.get("primary_tier")
        if primary is not None and hasattr(primary, "_policy"):
            return primary
        frame = frame.f_back
    return None


def watch_evictions(policy: Any, removed: Callable[[list[bytes] | None], None]) -> None:
    """Have ``policy`` (the primary tier's cache policy) tell ``removed`` every key that leaves it: evicted,
    removed (a failed write), or all of them (``None``: the cache was reset). vLLM tells a secondary tier
    nothing of the primary's evictions; its policy is where they happen (``CPUOffloadingManager.prepare_store``)."""
    evict, remove, clear = policy.evict, policy.remove, policy.clear

    def evict_and_tell(n: int, protected: Any) -> Any:
        out = evict(n, protected)
        if out:
            removed([bytes(key) for key, _ in out])
        return out

    def remove_and_tell(key: Any) -> None:
        remove(key)
        removed([bytes(key)])

    def clear_and_tell() -> None:
        clear()
        removed(None)

    policy.evict, policy.remove, policy.clear = evict_and_tell, remove_and_tell, clear_and_tell


def forget_region_name(spec: Any) -> str | None:
    """Unlink the primary tier's ``/dev/shm`` file name once every process of the instance has it mapped; the
    path unlinked, or None where that is not known to be so.

    vLLM's tiering spec removes ``/dev/shm/vllm_offload_{engine_id}.mmap`` only on an orderly shutdown, so a
    killed instance leaves its whole primary tier in RAM for good. The mappings outlive the name, and the kernel
    frees the memory when the last of them goes, however the processes end. The name may go only once nobody
    will open it again, or a late opener would create a second, separate region (a worker writing where the
    scheduler and this tier never read). The engine core builds its workers' KV caches (each worker opens the
    region then) before its scheduler, whose manager opens it last and builds this tier: so the scheduler's
    region not being the file's creator is the sign that the workers came first. A manager built outside an
    engine creates the file itself, and its name is left to its owner."""
    region = getattr(spec, "_scheduler_mmap", None)
    path = getattr(region, "mmap_path", None)
    if not path or getattr(region, "_creator", True):
        return None
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    return str(path)


#: The tier's metrics, through vLLM's offloading stats (its ``/metrics``, beside the tiering manager's own).
_COUNTERS = {
    "vllm:remote_g2_tier_chunks_read": "Chunks this instance READ from peers through remote-g2's tier",
    "vllm:remote_g2_tier_chunks_read_one_sided": "Of the chunks READ from peers, those found in the peer's chunk "
                                                 "table (no RPC)",
    "vllm:remote_g2_tier_chunks_failed": "Chunks whose load from a peer failed (recomputed)",
    "vllm:remote_g2_tier_chunks_served": "Chunks this instance leased to peers' READs",
    "vllm:remote_g2_tier_asks_missed": "Peers' asks this instance held none of (evicted, or not served in time)",
    "vllm:remote_g2_tier_leases_lapsed": "Peers' leases that ended unreleased (their TTL passed)",
}
_OPEN_LEASES = "vllm:remote_g2_tier_open_leases"
_PUBLISHED = "vllm:remote_g2_tier_published_chunks"
_GAUGES = {
    _OPEN_LEASES: "Peers' leases open on this instance's chunks",
    _PUBLISHED: "Chunks this instance has published to the registry",
}
_FETCH_SECONDS = "vllm:remote_g2_tier_fetch_seconds"


class RemoteG2Tier(SecondaryTierManager):
    """The tier (see the module docstring); built by vLLM's ``SecondaryTierFactory``."""

    cache_hit_source = CacheHitSource.P2P

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        from vllm.v1.kv_offload.base import (OffloadingCounterMetadata, OffloadingGaugeMetadata,
                                             OffloadingHistogramMetadata)

        out: dict[str, Any] = {name: OffloadingCounterMetadata(doc) for name, doc in _COUNTERS.items()}
        out.update({name: OffloadingGaugeMetadata(doc) for name, doc in _GAUGES.items()})
        out[_FETCH_SECONDS] = OffloadingHistogramMetadata(
            "A load job's time from its first resolve to its last byte",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
        return out

    def get_stats(self) -> Any:
        """What changed since the last call: the counters' increases, the gauges that moved, the fetches' times;
        None when nothing did. (vLLM's manager asks every step and passes on any non-empty stats; a gauge keeps
        its last value until set again.)"""
        server, fetcher = self.server, self.fetcher
        if server is None or fetcher is None:
            return None
        now = {"vllm:remote_g2_tier_chunks_read": fetcher.chunks_read,
               "vllm:remote_g2_tier_chunks_read_one_sided": fetcher.chunks_read_one_sided,
               "vllm:remote_g2_tier_chunks_failed": fetcher.chunks_failed,
               "vllm:remote_g2_tier_chunks_served": server.chunks_served,
               "vllm:remote_g2_tier_asks_missed": server.missed,
               "vllm:remote_g2_tier_leases_lapsed": server.lapsed,
               _OPEN_LEASES: server.open_leases(),
               _PUBLISHED: len(self._published)}
        reported = self._reported
        if now == reported and not fetcher.unreported:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for name, value in now.items():
            if name in _GAUGES:
                if name not in reported or value != reported[name]:
                    stats.set_gauge(name, value)
            elif value != reported.get(name, 0):
                stats.increase_counter(name, value - reported.get(name, 0))
        self._reported = now
        while fetcher.unreported:
            stats.observe_histogram(_FETCH_SECONDS, fetcher.unreported.popleft())
        return stats

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str = "RemoteG2Tier",
                 backpressure_detector: Any = None, *, registry: str | None = None, worker_id: str | None = None,
                 bind: str = "tcp://127.0.0.1:0", advertise: str | None = None, model_id: str | None = None,
                 lease_ttl_ms: int = 10_000, fetch_timeout_s: float = 5.0, serve_wait_s: float = 2.0,
                 failed_ttl_s: float = 30.0, pin_leases: bool = False, fetch_switch_interval_s: float = 0.0005,
                 publish_interval_s: float = 0.25,
                 identity: TierIdentity | None = None, **unknown: Any) -> None:
        if unknown:
            raise ValueError(f"RemoteG2Tier: unknown settings {sorted(unknown)} "
                             "(see remote_g2.adapters.vllm_tier.tier)")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality.REMOTE
        self.registry = registry or os.environ.get("REMOTE_G2_REGISTRY") or None
        self.worker_id = worker_id or os.environ.get("REMOTE_G2_WORKER_ID") or \
            f"vllm-tier-{socket.gethostname()}-{os.getpid()}"
        self.row_bytes = int(primary_kv_view.strides[0])
        self.num_rows = int(primary_kv_view.shape[0])
        self.region_base = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view))
        self.failed_ttl_s = failed_ttl_s
        self.pin_leases = pin_leases
        self.publish_interval_s = publish_interval_s
        if identity is None:
            identity = tier_identity(offloading_spec, self.row_bytes, vllm_config_of_caller(), model_id=model_id)
        self.identity = identity
        self.fingerprint = identity.fingerprint
        gone = forget_region_name(offloading_spec)
        if gone:
            log.info("remote-g2 tier: %s unlinked (mapped by every process of the instance; freed as they end)",
                     gone)
        self._wake_ref = _engine_input_queue()
        self._primary = _primary_of_caller()
        self._watching = False  # the primary's evictions reach _evicted
        self._lock = threading.Lock()
        self._done: list[JobResult] = []  # store jobs, ended at once
        self._holders: dict[bytes, str] = {}  # key -> the endpoint its lookup found (until its load)
        self._loading: dict[int, list[bytes]] = {}  # load job -> its keys, until its result
        self._failed: dict[bytes, float] = {}  # key -> until when it is a MISS
        self._published: OrderedDict[bytes, None] = OrderedDict()
        self._reported: dict[str, int] = {}  # each counter's and gauge's value at the last get_stats
        self.server: ChunkServer | None = None
        self.fetcher: ChunkFetcher | None = None
        self._mirror: Any = None
        self._client: Any = None
        self._publisher: Any = None
        self._compat = ""
        self._mirror_missing_logged = False
        if self.fingerprint is None or not self.registry:
            why = identity.why_not if self.fingerprint is None else "no registry (setting 'registry' or " \
                                                                    "REMOTE_G2_REGISTRY)"
            log.warning("remote-g2 tier %s: not sharing chunks: %s", self.worker_id, why)
            return
        try:
            self._start(bind, advertise, lease_ttl_ms, fetch_timeout_s, serve_wait_s, fetch_switch_interval_s)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, bind: str, advertise: str | None, lease_ttl_ms: int, fetch_timeout_s: float,
               serve_wait_s: float, switch_interval_s: float) -> None:
        from remote_g2.registry import RegistryClient, RegistryMirror, SourcePublisher

        fp = self.fingerprint
        assert fp is not None and self.registry
        self._compat = fp.compat_key()
        # With the primary's evictions in sight, leases are validated by row generations and served at once; else
        # they pin through vLLM's manager at the holder's next step (serving.py).
        self.server = ChunkServer(self.worker_id, self.region_base, self.row_bytes, self.num_rows, bind=bind,
                                  validated=self._primary is not None and not self.pin_leases, wait_s=serve_wait_s,
                                  on_ask=self._wake_engine, on_unheld=self._unpublish)
        self.fetcher = ChunkFetcher(self.worker_id, self.region_base, self.row_bytes, self.num_rows,
                                    timeout_s=fetch_timeout_s, lease_ttl_ms=lease_ttl_ms,
                                    switch_interval_s=switch_interval_s)
        endpoint = self.server.endpoint
        if advertise:
            host = advertise.rsplit(":", 1)[0]
            endpoint = f"{host}:{endpoint.rsplit(':', 1)[1]}"
        self._client = RegistryClient(self.registry, timeout_s=5.0)
        self._publisher = SourcePublisher(self._client, worker_id=self.worker_id, endpoint=endpoint, fingerprint=fp,
                                          snapshot=self._snapshot, load=self.server.open_leases,
                                          min_batch_interval_s=self.publish_interval_s).start()
        self._mirror = RegistryMirror(self.registry, timeout_s=2.0).start()
        if self._primary is not None:
            watch_evictions(self._primary._policy, self._evicted)
            self._watching = True
        else:
            log.warning("remote-g2 tier %s: vLLM's primary tier not found: its evictions reach the registry only "
                        "when a peer asks for an evicted chunk", self.worker_id)
        self._primary = None  # (only its policy was needed)
        log.info("remote-g2 tier %s: sharing %d-token chunks (%d bytes a row, %d rows) as %s at %s", self.worker_id,
                 fp.tokens_per_block, self.row_bytes, self.num_rows, fp.model_id, endpoint)

    # -- lookups and loads -------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        mirror = self._mirror
        if mirror is None or key[-4:] != _TIER_SUFFIX:
            return LookupResult.MISS
        until = self._failed.get(key)
        if until is not None:
            if until > time.monotonic():
                return LookupResult.MISS
            del self._failed[key]
        chunk_hash = bytes(key[:-4])
        if mirror.holds_any(chunk_hash) is False:  # (held by nobody at all, the common miss: no full lookup)
            return LookupResult.MISS
        replies = mirror.lookup_many([Lookup([chunk_hash], self.worker_id, self._compat, False)])
        if replies is None:  # no complete copy yet (start-up, or the feed was lost): nothing to go by
            if not self._mirror_missing_logged:
                self._mirror_missing_logged = True
                log.info("remote-g2 tier %s: the registry mirror has no copy yet; lookups miss until it does",
                         self.worker_id)
            return LookupResult.MISS
        reply = replies[0]
        if reply.best is None:
            return LookupResult.MISS
        holders = self._holders
        holders[bytes(key)] = reply.best.endpoint
        if len(holders) > 4 * self.num_rows:  # HITs vLLM did not promote (its primary was full): the oldest go
            for k in list(holders)[:len(holders) - 4 * self.num_rows]:
                del holders[k]
        return LookupResult.HIT

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        rows = [int(c) for c in job_metadata.chunk_ids]
        runs: list[LoadRun] = []
        for key, row in zip(keys, rows):
            endpoint = self._holders.pop(key, "")
            if runs and runs[-1].endpoint == endpoint:
                runs[-1].keys.append(key)
                runs[-1].hashes.append(key[:-4])
                runs[-1].rows.append(row)
            else:
                runs.append(LoadRun(endpoint, [key], [key[:-4]], [row]))
        assert self.fetcher is not None  # (lookup HITs only with one)
        self._loading[job_metadata.job_id] = keys
        self.fetcher.submit(job_metadata.job_id, runs)  # (a key with no holder known fails: recomputed)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        if self._done:  # (every step: most have nothing; a job queued just after this look goes at the next)
            with self._lock:
                out, self._done = self._done, []
        if self.server is not None:
            out += self.server.finished_jobs()
        if self.fetcher is not None:
            for result in self.fetcher.results():
                keys = self._loading.pop(result.job_id, [])
                if not result.success:
                    read = set(result.successful_keys or ())
                    self.note_failed([k for k in keys if k not in read])
                out.append(result)
        return out

    def note_failed(self, keys: Collection[bytes]) -> None:
        """Keys whose load failed: a MISS for ``failed_ttl_s`` (recomputed meanwhile, not retried every step)."""
        until = time.monotonic() + self.failed_ttl_s
        for k in keys:
            self._failed[bytes(k)] = until
        if len(self._failed) > 4 * self.num_rows:  # bounded: the oldest go first
            for k in list(self._failed)[:len(self._failed) - 4 * self.num_rows]:
                del self._failed[k]

    # -- stores: publish --------------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        publisher = self._publisher
        if publisher is not None:
            new = []
            held: list[bytes] = []
            rows: list[int] = []
            published = self._published
            chunk_ids = job_metadata.chunk_ids
            for k, row in zip(job_metadata.keys, chunk_ids.tolist() if hasattr(chunk_ids, "tolist") else chunk_ids):
                if k[-4:] == _TIER_SUFFIX:
                    h = bytes(k[:-4])
                    if h in published:
                        published.move_to_end(h)
                    else:
                        published[h] = None
                        new.append(h)
                    held.append(h)
                    rows.append(int(row))
            if self.server is not None:
                self.server.held(held, rows)  # (before the registry names them: a peer's ask finds them)
            if new:
                publisher.stored(new)
            over = len(published) - self.num_rows
            if over > 0 and not self._watching:  # more than the primary holds: the oldest are gone, or soon
                old = [published.popitem(last=False)[0] for _ in range(over)]
                publisher.removed(old)
        with self._lock:
            self._done.append(JobResult(job_id=job_metadata.job_id, success=True))

    def _unpublish(self, hashes: list[bytes]) -> None:
        """Chunks this instance no longer holds (scheduler thread): the registry forgets them."""
        if self.server is not None:
            self.server.let_go(hashes)  # (first: a lease open on one of them fails from now on)
        gone = [h for h in hashes if h in self._published]
        for h in gone:
            self._published.pop(h, None)
        if gone and self._publisher is not None:
            self._publisher.removed(gone)

    def _evicted(self, keys: list[bytes] | None) -> None:
        """Keys the primary tier let go of (its cache policy, on the scheduler thread): unpublished at once."""
        if keys is None:
            if self.server is not None:
                self.server.let_go_all()
            gone = list(self._published)
            self._published.clear()
            if gone and self._publisher is not None:
                self._publisher.removed(gone)
            return
        self._unpublish([k[:-4] for k in keys if k[-4:] == _TIER_SUFFIX])

    def _snapshot(self) -> list[bytes]:
        return list(self._published)

    # -- serving peers ------------------------------------------------------------------------------------------

    def serve_external_requests(self, parent: Any) -> None:
        if self.server is not None:
            self.server.serve(parent)

    def _wake_engine(self) -> None:
        """An ask was queued (RPC thread): an idle engine steps once so that the next step serves it."""
        engine = self._wake_ref() if self._wake_ref is not None else None
        if engine is None:
            return
        try:
            from vllm.v1.engine import EngineCoreRequestType

            engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        except Exception as e:  # the engine is shutting down
            log.debug("remote-g2 tier: cannot wake the engine: %s", e)

    def has_pending_work(self) -> bool:
        if self.server is not None and self.server.has_work():
            return True
        if self.fetcher is not None and self.fetcher.busy():
            return True
        with self._lock:
            return bool(self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        if self.fetcher is not None:
            self.fetcher.drain()

    def shutdown(self) -> None:
        """Stop serving and fetching, unregister nothing (the lease lapses), release every view of the region."""
        for name in ("_publisher", "_mirror"):
            part = getattr(self, name)
            setattr(self, name, None)
            if part is not None:
                part.close()
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None
        if self._client is not None:
            self._client.close()
            self._client = None
