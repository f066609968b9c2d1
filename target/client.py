"""The target client: one per TP rank of a worker that reuses blocks other workers hold in G2.

Engine-facing contract (rank 0 is the *leader*: the rank the engine's
scheduler talks to; every rank must create its client)::

    client = maybe_start_target_client(pool, tp_rank=r, tp_size=n, worker_id="w1", config=cfg)
    m = client.lookup(block_hashes)            # leader: how many leading blocks a remote source has
    client.start_load(req_id, block_hashes[:m.matched], dst_block_ids)   # leader; returns at once
    client.remember_match(hashes, match)       # leader: a lookup answered elsewhere (vLLM's scheduler)
    done, failed = client.get_finished()       # leader, every engine step; never blocks
    bad = client.invalid_block_ids()           # destination blocks to recompute (drained on read)
    client.finished_fd() / client.wait_finished(timeout_s)   # leader: wake when a load ends, not poll
    done, failed = client.get_finished_shares()  # any rank: how this rank's own share of each load ended
    client.shutdown()                          # every rank

The parts behind it:

* :mod:`.coordinator` — the leader's coordinator thread: every load in
  flight, as a state machine (:mod:`.load`), its lease taken by one of two
  strategies (:mod:`.resolve_strategies`: classic through source rank 0, or
  each rank with its peer source rank);
* :mod:`.rank_loop` — the loop of each rank > 0, and the leader's own share
  thread: they drive the rank's :class:`~.rank_worker.RankWorker`, which
  plans and posts the READs;
* the ranks talk over :mod:`~remote_g2.rpc.local_link` links (a Unix stream socket per rank to the leader,
  set up here): one thread to wake per hop; a rank that is gone closes its end, failing its loads at once.

Outcomes: a request is *done* when every rank read every byte of the prefix
the source pinned; destination blocks past that prefix (the source held
fewer than the registry said) are listed by :meth:`TargetClient.invalid_block_ids`.
A request is *failed* — and all its destination blocks are invalid — when
lookup or resolve found nothing, the source answered ERR or did not answer
within ``rpc_timeout_ms``, any rank's READ ended in error or outlived
``transfer_timeout_ms``, a rank never answered, or the lease was lost.

Time bounds: each RPC step before the READs (lookup when the scheduler's
answer is not cached, resolve, metadata) is bounded by ``rpc_timeout_ms``; the
READs by ``transfer_timeout_ms`` from the moment the leader hands them out
(no rank posts a READ after it: :mod:`.rank_worker`); a rank that never
answered is reported ``rpc_timeout_ms`` after that.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from remote_g2.errors import ConfigError, RemoteG2Error, TransferError
from remote_g2.rpc.ipc_paths import ipc_endpoint, prepare_ipc_dir
from remote_g2.rpc.local_link import LinkListener, MessageLink, boot_id, connect_link
from remote_g2.log import cpu_set_text
from remote_g2.protocol.messages import Lookup, LookupReply, TargetDone, TargetLoad
from remote_g2.plugins import load_adapter
from remote_g2.rpc.mux import RpcMux
from remote_g2.memory.secondary_pool import SecondaryPool
from remote_g2.stall_watchdog import maybe_start_stall_watchdog
from remote_g2.tp.group import TpGroup
from remote_g2.tp.start import start_on_every_rank

from .config import TargetConfig
from .coordinator import LOOKUP_CACHE, Coordinator
from .metrics import TargetMetrics
from .outcomes import Outcomes
from .rank_loop import RankLoop, ShareBook, ShareLoop
from .rank_worker import RankWorker, rank_buffers
from .layout_compat import check_holder_tp

__all__ = ["TargetClient", "TargetMatch", "maybe_start_target_client", "start_target_client"]

log = logging.getLogger("remote_g2.target")


@dataclass(frozen=True)
class TargetMatch:
    """What :meth:`TargetClient.lookup` found: ``matched`` leading blocks on ``worker_id``, or why not."""

    matched: int
    reason: str
    worker_id: str | None = None
    endpoint: str | None = None
    tp_size: int | None = None


def maybe_start_target_client(pool: SecondaryPool, *, tp_rank: int | None = None, tp_size: int | None = None,
                              worker_id: str, config: TargetConfig | None = None,
                              comm: Any = None) -> TargetClient | None:
    """This rank's target client when enabled (``config.enabled`` or ``REMOTE_G2_TARGET=1``), else None.

    ``pool`` is the rank's destination memory (its ``layout`` property and
    ``regions()``; block ``b`` at ``regions()[0].base + b * block_bytes``).
    Collective over the TP group (``comm``; default MPI world split by
    ``tp_size``) at start-up, as the source service is: call it on every rank.
    """
    config = TargetConfig.from_env() if config is None else config.with_env_enable()
    if not config.enabled:
        log.debug("target client disabled (set REMOTE_G2_TARGET=1 or TargetConfig.enabled)")
        return None
    return start_target_client(pool, tp_rank=tp_rank, tp_size=tp_size, worker_id=worker_id, config=config,
                               comm=comm)


def start_target_client(pool: SecondaryPool, *, tp_rank: int | None = None, tp_size: int | None = None,
                        worker_id: str, config: TargetConfig, comm: Any = None) -> TargetClient:
    """Start unconditionally (see :func:`maybe_start_target_client`)."""
    return start_on_every_rank(lambda group: TargetClient(pool, worker_id=worker_id, group=group, config=config),
                               TargetClient._start, worker_id=worker_id, tp_rank=tp_rank, tp_size=tp_size,
                               comm=comm)


class TargetClient:
    """One rank's client; see the module docstring. Build with :func:`start_target_client`."""

    def __init__(self, pool: SecondaryPool, *, worker_id: str, group: TpGroup, config: TargetConfig) -> None:
        self.worker_id = worker_id
        self.rank, self.tp_size = group.rank, group.size
        self.config = config
        self._group = group
        self._pool = pool
        self._worker: RankWorker | None = None
        self._scratch: Any = None  # staged parts' counters land here (target/rank_worker.py)
        self._closed = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._link: MessageLink | None = None        # rank > 0: to the leader
        self._listener: LinkListener | None = None   # leader: every other rank connects here
        self._links: dict[int, MessageLink] = {}     # leader: rank -> link
        self.coordinator: Coordinator | None = None  # leader
        self._registry: Any = None  # leader: RegistryClient for the scheduler's synchronous lookups
        self._mirror: Any = None    # leader: RegistryMirror answering them from memory, when configured
        self._lookups: OrderedDict[tuple[bytes, ...], TargetMatch] = OrderedDict()
        self._lookups_lock = threading.Lock()
        self._outcomes: Outcomes | None = None  # leader: whole requests
        self._shares = ShareBook(Outcomes())     # every rank: its own shares
        self.stats = {"loads": 0, "done": 0, "failed": 0, "bytes": 0, "descriptors": 0, "mirror_lookups": 0,
                      "peer_loads": 0}
        self.metrics = TargetMetrics()

    # -- start-up ------------------------------------------------------------------------

    def _start(self) -> None:
        error: str | None = None
        maybe_start_stall_watchdog()  # REMOTE_G2_STALL_DUMP_S: stacks to stderr when Python stalls
        path = ""
        clock = boot_id()
        transfer = bounce = None
        try:
            layout = self._pool.layout
            regions, self._scratch, bounce = rank_buffers(self._pool.regions(), self.config)
            transfer = load_adapter("transfer", self.config.transfer)(
                f"remote-g2-target-{self.worker_id}-tp{self.rank}")
            transfer.register_local(regions)
            if self.rank == 0 and self.tp_size > 1:
                directory = prepare_ipc_dir(self.config.ipc_directory)
                path = ipc_endpoint(directory, f"target-{self.worker_id}", 0)[len("ipc://"):]
                self._listener = LinkListener(path)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        mine = {"path": path, "error": error, "clock": clock}
        try:
            gathered = self._gather(mine)
        except BaseException:
            if transfer is not None:
                transfer.close()
            raise
        assert transfer is not None
        loop: RankLoop | ShareLoop | None = None
        # Owned from here on: shutdown() closes the adapter even when the links below fail.
        self._worker = RankWorker(rank=self.rank, tp_size=self.tp_size, layout=layout, pool_base=regions[0].base,
                                  transfer=transfer, report=lambda done: self._report(loop, done),
                                  shares_leader_clock=gathered[0]["clock"] == clock, scratch=self._scratch,
                                  bounce=bounce, stats=self.stats)
        timeout = float(self.config.rpc_timeout_ms)
        # The links: every other rank connects to the leader's listener and says which rank it is.
        try:
            if self.rank == 0 and self._listener is not None:
                self._links = self._listener.accept_ranks(set(range(1, self.tp_size)), self.worker_id,
                                                          timeout_s=timeout / 1000.0)
            elif self.rank > 0:
                self._link = connect_link(gathered[0]["path"], rank=self.rank, worker_id=self.worker_id,
                                          timeout_s=timeout / 1000.0)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self._gather({"error": error})
        name = f"remote-g2-target-{self.worker_id}"
        if self.rank == 0:
            loop = self._start_leader(timeout, name)
        else:
            assert self._link is not None
            loop = RankLoop(rank=self.rank, link=self._link, config=self.config, book=self._shares, stop=self._stop)
            loop.attach(self._worker)
            self._spawn(loop.run, f"{name}-tp{self.rank}")
        log.info("target client %s rank %d/%d up (%s; threads on CPUs %s)", self.worker_id, self.rank, self.tp_size,
                 self.config.transfer, cpu_set_text())

    def _start_leader(self, timeout_ms: float, name: str) -> ShareLoop:
        """The leader's registry clients, its share thread and its coordinator thread."""
        assert self._worker is not None
        if self.config.metrics_port is not None:
            self.metrics.serve_http(self.config.metrics_port, self.config.metrics_addr)
        if self.config.registry_endpoint:
            from remote_g2.registry import RegistryClient, RegistryMirror

            self._registry = RegistryClient(self.config.registry_endpoint, timeout_s=timeout_ms / 1000.0,
                                            curve=self.config.registry_curve)
            if self.config.registry_mirror:
                self._mirror = RegistryMirror(self.config.registry_endpoint, timeout_s=timeout_ms / 1000.0,
                                              curve=self.config.registry_curve, compat_key=self._compat_key()).start()
        self._outcomes = Outcomes()
        own: queue.SimpleQueue[TargetLoad | None] = queue.SimpleQueue()
        share = ShareLoop(shares=own, book=self._shares, report=lambda done: self._post_done(done))
        share.attach(self._worker)
        share_thread = self._spawn(share.run, f"{name}-tp0")
        self.coordinator = Coordinator(
            worker_id=self.worker_id, tp_size=self.tp_size, config=self.config, metrics=self.metrics,
            stats=self.stats, mux=RpcMux(timeout_ms=timeout_ms, curve=self.config.source_curve), links=self._links,
            outcomes=self._outcomes, own_share=own, share_thread=share_thread, match_from=self._match_from,
            compat_key=self._compat_key(), lookups=self._lookups, lookups_lock=self._lookups_lock,
            kv_heads=self._pool.layout.num_kv_heads, gather=self._scratch is not None)
        self._spawn(self.coordinator.run, name)
        return share

    def _spawn(self, target: Any, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def _report(self, loop: RankLoop | ShareLoop | None, done: TargetDone) -> None:
        """The worker's report of a share: through this rank's loop (which tells the leader and the book)."""
        if loop is not None:
            loop.report(done)

    def _post_done(self, done: TargetDone) -> None:
        if self.coordinator is not None:
            self.coordinator.post("done", done)

    def _gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``mine``; raises on every rank when any rank reported an error."""
        gathered = [mine] if self._group.comm is None else self._group.comm.allgather(mine)
        failed = [f"rank {i}: {g['error']}" for i, g in enumerate(gathered) if g["error"]]
        if failed:
            raise TransferError("target client start-up failed on TP rank(s): " + "; ".join(failed))
        return gathered

    # -- engine-facing (leader) --------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> TargetMatch:
        """How many leading blocks of ``block_hashes`` one remote source can give, from whom, or why not.

        Synchronous: one registry round trip, or none when the config keeps a
        registry mirror and its copy is complete (the server answers while it
        is not). Answers ``no_registry`` without a registry and never raises
        for a registry that is down (``registry_error``).
        The answer is remembered, so a :meth:`start_load` of the matched
        prefix goes straight to the resolve.
        """
        self._leader_only("lookup")
        if not block_hashes:
            return TargetMatch(0, "no_candidate")
        if self._registry is None:
            return TargetMatch(0, "no_registry")
        request = Lookup(list(block_hashes), self.worker_id, self._compat_key())
        try:
            # Without a complete copy (still syncing, or retaking it) the server answers.
            replies = self._mirror.lookup_many([request]) if self._mirror is not None else None
            if replies is not None:
                reply = replies[0]
                self.metrics.mirror_lookups.inc()
                self.stats["mirror_lookups"] += 1
            else:
                reply = self._registry.lookup(request.hashes, requester=request.requester,
                                              compat_key=request.compat_key)
        except RemoteG2Error as e:
            log.warning("lookup failed: %s", e)
            self.metrics.lookup("registry_error", 0)
            return TargetMatch(0, "registry_error")
        match = self._match_from(reply)
        self.metrics.lookup(match.reason, match.matched)
        self._remember(block_hashes[:match.matched], match)
        return match

    def remember_match(self, block_hashes: Sequence[bytes], match: TargetMatch) -> bool:
        """Take a lookup answer the engine got elsewhere, so :meth:`start_load` of ``block_hashes`` goes
        straight to the resolve; False (nothing kept) when ``match`` is not a usable one.

        For engines whose scheduler asks the registry in another process (vLLM's), saving the
        leader a second registry round trip. ``match.matched`` must cover ``block_hashes``; the
        source's TP layout is checked against this client's fingerprint as :meth:`lookup` does.
        A stale answer costs what a stale lookup does: the resolve finds less, or fails, and the
        blocks are recomputed.
        """
        self._leader_only("remember_match")
        if match.reason != "ok" or not match.worker_id or not match.endpoint or match.tp_size is None:
            return False
        if match.matched < len(block_hashes) or not block_hashes:
            return False
        fp = self.config.fingerprint
        if fp is not None and check_holder_tp(fp, match.tp_size):
            return False
        self._remember(block_hashes, replace(match, matched=len(block_hashes)))
        return True

    def _remember(self, block_hashes: Sequence[bytes], match: TargetMatch) -> None:
        """Keep ``match`` for a :meth:`start_load` of exactly ``block_hashes`` (the most recent LOOKUP_CACHE)."""
        with self._lookups_lock:
            self._lookups[tuple(block_hashes)] = match
            while len(self._lookups) > LOOKUP_CACHE:
                self._lookups.popitem(last=False)

    def wait_registry_mirror(self, timeout_s: float) -> bool:
        """True once the registry mirror (``config.registry_mirror``) holds a complete copy; False without
        one, or when ``timeout_s`` passed first. Lookups work either way (the server answers meanwhile)."""
        self._leader_only("wait_registry_mirror")
        return self._mirror is not None and bool(self._mirror.wait_ready(timeout_s))

    def start_load(self, request_id: str, block_hashes: Sequence[bytes], dst_block_ids: Sequence[int]) -> None:
        """Load the blocks of ``block_hashes`` into ``dst_block_ids`` (same length), asynchronously.

        The outcome arrives through :meth:`get_finished`. Uses the source the
        last :meth:`lookup` of these hashes chose (or looks up again).
        """
        self._leader_only("start_load")
        if len(block_hashes) != len(dst_block_ids) or not block_hashes:
            raise ValueError(f"start_load({request_id!r}): {len(block_hashes)} hashes for "
                             f"{len(dst_block_ids)} destination blocks")
        assert self.coordinator is not None
        self.coordinator.post("start", (request_id, list(block_hashes), [int(b) for b in dst_block_ids]))

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose load finished since the last call: ``(done, failed)``. Never blocks."""
        return self._leader_outcomes().take() if self.rank == 0 and self._outcomes else (set(), set())

    def finished_fd(self) -> int:
        """A file descriptor (leader) that is readable while :meth:`get_finished` has outcomes to hand out.

        For engines with an event loop (``loop.add_reader(fd, ...)``, ``select``)
        that would rather wake when a load ends than poll every step;
        :meth:`get_finished` makes it unreadable again. Owned by the client:
        do not read or close it, and stop watching it before :meth:`shutdown`.
        """
        self._leader_only("finished_fd")
        return self._leader_outcomes().fd

    def wait_finished(self, timeout_s: float) -> bool:
        """Block (leader) until :meth:`get_finished` has outcomes, at most ``timeout_s``; True if it has.

        Costs no CPU while it waits, unlike a polling loop, which on a small
        host takes the CPU the READs copy with.
        """
        self._leader_only("wait_finished")
        return self._leader_outcomes().wait(timeout_s)

    def invalid_block_ids(self) -> set[int]:
        """Destination blocks whose load failed since the last call (the engine recomputes them)."""
        return self._outcomes.take_invalid() if self._outcomes is not None else set()

    def failure_reasons(self) -> dict[str, str]:
        """Why each failed load failed, by request id, since the last call (leader): the source's ERR, a
        timeout, or the transfer backend's own words (e.g. ``NIXL_ERR_BACKEND`` and where UCX's reason is)."""
        self._leader_only("failure_reasons")
        return self._outcomes.take_errors() if self._outcomes is not None else {}

    # -- every rank --------------------------------------------------------------------------

    def get_finished_shares(self) -> tuple[set[str], set[str]]:
        """How this rank's own share of each load ended since the last call: ``(done, failed)`` request ids.

        For engines that run one worker per rank and ask each of them what
        finished (vLLM's workers): a rank's share is done when every byte of
        it landed in this rank's destination blocks. The request as a whole
        is the leader's :meth:`get_finished`. Never blocks.
        """
        return self._shares.outcomes.take()

    def share_invalid_block_ids(self) -> set[int]:
        """This rank's destination blocks its own shares did not load since the last call."""
        return self._shares.outcomes.take_invalid()

    def shutdown(self) -> None:
        """Stop this rank's client; loads still running fail (their leases are released). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.coordinator is not None:
            self.coordinator.post("stop", None)
        for thread in reversed(self._threads):  # the coordinator (it stops the share thread) or the rank loop
            thread.join(10)
        if not self._threads and self._worker is not None:  # start-up failed before a loop owned it
            self._worker.close()
        if self.coordinator is not None:
            self.coordinator.close()
        for link in [self._link, *self._links.values()]:
            if link is not None:
                link.close()
        if self._listener is not None:
            self._listener.close()
        if self._mirror is not None:
            self._mirror.close()
        if self._registry is not None:
            self._registry.close()
        self.metrics.close()
        if self._outcomes is not None:
            self._outcomes.close()
        self._shares.outcomes.close()

    def _leader_only(self, what: str) -> None:
        if self.rank != 0:
            raise ConfigError(f"{what} is called on target rank 0 (the leader), not rank {self.rank}")
        if self._closed:
            raise ConfigError(f"{what}: the target client is shut down")

    def _leader_outcomes(self) -> Outcomes:
        assert self._outcomes is not None
        return self._outcomes

    def _compat_key(self) -> str | None:
        fp = self.config.fingerprint
        return fp.compat_key() if fp else None

    def _match_from(self, reply: LookupReply) -> TargetMatch:
        if reply.reason != "ok" or reply.best is None:
            return TargetMatch(0, reply.reason)
        best, fp = reply.best, self.config.fingerprint
        reason = check_holder_tp(fp, best.tp_size) if fp else None
        if reason:
            return TargetMatch(0, f"incompatible_layout: {reason}", best.worker_id, best.endpoint, best.tp_size)
        return TargetMatch(reply.matched, "ok", best.worker_id, best.endpoint, best.tp_size)
