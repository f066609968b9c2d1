"""Run one reference engine worker under MPI and serve its request API from rank 0.

::

    mpiexec -n 2 python -m remote_g2.adapters.reference.server --worker-id A \\
        --registry tcp://127.0.0.1:5555 --source --ready-file /tmp/a.json

Every rank builds an :class:`~.executor.Executor` (which starts the source
and target hooks when enabled: ``--source`` / ``--target``, or
``REMOTE_G2_SOURCE=1`` / ``REMOTE_G2_TARGET=1`` with the ``REMOTE_G2_*``
settings). Rank 0 then serves the API (:mod:`.messages`: ``engine_submit``,
``engine_results``, ``engine_stats``, ``engine_evict``, ``engine_shutdown``)
on ``--bind`` from the same thread that runs the engine loop (a driven
:class:`~remote_g2.rpc.server.RpcServer`: no locks between the API and the
scheduler), and writes ``--ready-file`` (JSON: ``endpoint``, ``worker_id``,
``tp_size``, ``source_endpoint``, ``pid``) once everything is up. Ranks > 0
follow the leader's steps. ``engine_shutdown`` or SIGTERM stops every rank
and the hooks cleanly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

import torch
import zmq
from remote_g2.source import SourceConfig
from remote_g2.target import TargetConfig

from remote_g2.errors import RequestRejected
from remote_g2.log import configure_logging
from remote_g2.protocol.messages import LayoutFingerprint
from remote_g2.rpc.server import CallContext, RpcServer
from remote_g2.tp.group import resolve_tp_group

from .executor import EngineConfig, Executor
from .kv_cache import CacheConfig, fingerprint
from .messages import (
    EngineAccepted,
    EngineEvict,
    EngineEvictReply,
    EngineResults,
    EngineResultsReply,
    EngineShutdown,
    EngineStats,
    EngineStatsReply,
    EngineSubmit,
)
from .config import ModelConfig
from .weights import weights_model_id

__all__ = ["EngineServer", "main"]

log = logging.getLogger("remote_g2.adapters.reference.server")


class EngineServer:
    """Rank 0's request API and engine loop around an :class:`Executor`."""

    def __init__(self, executor: Executor, bind: str) -> None:
        self.ex = executor
        assert executor.scheduler is not None
        self.sched = executor.scheduler
        self.stop = threading.Event()
        self.finished = 0
        self.rpc = RpcServer(bind, {
            "engine_submit": self._submit,
            "engine_results": self._results,
            "engine_stats": self._stats,
            "engine_evict": self._evict,
            "engine_shutdown": self._shutdown,
        }, name=f"engine-{executor.config.worker_id}", workers=0, max_frame_bytes=256 * 1024 * 1024)
        self.endpoint = self.rpc.start()

    def serve(self) -> None:
        """The engine loop: answer the API, plan and run steps, until shutdown."""
        poller = zmq.Poller()
        poller.register(self.rpc.socket, zmq.POLLIN)
        target = self.sched.target
        if target is not None:  # a load's outcome wakes the loop (no polling while a remote load runs)
            poller.register(target.finished_fd(), zmq.POLLIN)
        try:
            while not self.stop.is_set():
                # Busy: only peek at the sockets. A load about to start (paused): look again in 1 ms.
                # Otherwise sleep until a request or a load's outcome arrives.
                states = [r.state for r in self.sched.running.values()]
                runnable = bool(self.sched.waiting) or "prefill" in states or "decode" in states
                timeout = 0 if runnable else (1 if "paused" in states else 50)
                if dict(poller.poll(timeout)).get(self.rpc.socket):
                    self.rpc.serve_ready()
                self.ex.step()
        finally:
            ops = self.sched.fail_all("engine shutting down")
            if ops:
                self.ex._run(ops)

    def close(self) -> None:
        self.rpc.close()

    # -- handlers (on the loop's thread) -------------------------------------------------------

    def _submit(self, req: EngineSubmit, ctx: CallContext) -> EngineAccepted:
        if self.stop.is_set():
            raise RequestRejected("engine is shutting down")
        cfg = self.ex.config.model
        self.sched.submit(req, cfg.vocab_size, cfg.max_positions)
        return EngineAccepted(len(self.sched.waiting) + len(self.sched.running))

    def _results(self, req: EngineResults, ctx: CallContext) -> EngineResultsReply:
        out = self.sched.take_results(list(req.request_ids))
        self.finished += len(out)
        return EngineResultsReply(out)

    def _stats(self, req: EngineStats, ctx: CallContext) -> EngineStatsReply:
        ex, s = self.ex, self.sched
        g2 = ex.stats()
        return EngineStatsReply(
            worker_id=ex.config.worker_id, tp_size=ex.tp_size, model_id=weights_model_id(ex.config.model),
            source_enabled=ex.source is not None, target_enabled=ex.target is not None,
            source_endpoint=getattr(ex.source, "endpoint", "") or "", running=len(s.running) + len(s.waiting),
            finished=self.finished + len(s.finished), g1_cached=s.g1.cached(), g2_cached=g2["g2_cached"],
            g2_pinned=g2["g2_pinned"], g2_pinned_per_rank=g2["g2_pinned_per_rank"],
            remote_lookups=s.remote_lookups, blocks_remote=s.blocks_remote,
            blocks_remote_failed=s.blocks_remote_failed, paused=s.paused())

    def _evict(self, req: EngineEvict, ctx: CallContext) -> EngineEvictReply:
        return EngineEvictReply(self.ex.evict(list(req.hashes)))

    def _shutdown(self, req: EngineShutdown, ctx: CallContext) -> EngineAccepted:
        self.stop.set()
        return EngineAccepted(len(self.sched.waiting) + len(self.sched.running))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m remote_g2.adapters.reference.server",
                                description=__doc__.split("\n")[0])
    p.add_argument("--worker-id", required=True)
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="rank 0's API endpoint (tcp:// or ipc://)")
    p.add_argument("--ready-file", help="rank 0 writes its endpoints here (JSON) once serving")
    p.add_argument("--registry", help="registry endpoint for the hooks (else REMOTE_G2_REGISTRY)")
    p.add_argument("--source", action="store_true", help="enable the source hook (else REMOTE_G2_SOURCE)")
    p.add_argument("--target", action="store_true", help="enable the target hook (else REMOTE_G2_TARGET)")
    p.add_argument("--transfer", default=None, help="target transfer adapter (default nixl)")
    p.add_argument("--target-timeout-ms", type=int, default=None)
    p.add_argument("--ipc-dir", default=None, help="private directory for the ranks' IPC sockets")
    p.add_argument("--mla", action="store_true", help="the MLA-like model (one replicated latent kv head)")
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--g1-blocks", type=int, default=512)
    p.add_argument("--g2-blocks", type=int, default=1024)
    p.add_argument("--landing-blocks", type=int, default=256)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--failed-source-cooldown-s", type=float, default=30.0,
                   help="after a load from a source failed, recompute what it holds for this long (0: off)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / TP size)")
    return p.parse_args(argv)


def _hook_configs(a: argparse.Namespace, fp: LayoutFingerprint) -> tuple[SourceConfig, TargetConfig]:
    """The environment's ``REMOTE_G2_*`` settings, with the command line's flags over them."""
    source = SourceConfig.from_env(fingerprint=fp)
    target = replace(TargetConfig.from_env(), fingerprint=fp)
    common = {"registry_endpoint": a.registry, "ipc_dir": a.ipc_dir}
    source = replace(source, **{k: v for k, v in {**common, "enabled": a.source or None}.items() if v})
    target = replace(target, **{k: v for k, v in {**common, "enabled": a.target or None, "transfer": a.transfer,
                                                   "transfer_timeout_ms": a.target_timeout_ms}.items() if v})
    return source, target


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    configure_logging()
    model = ModelConfig.mla_default() if a.mla else ModelConfig()
    cache = CacheConfig(tokens_per_block=a.tokens_per_block, g1_blocks=a.g1_blocks, g2_blocks=a.g2_blocks,
                        landing_blocks=a.landing_blocks)
    group = resolve_tp_group(None, None)
    source, target = _hook_configs(a, fingerprint(model, cache, group.size))
    cfg = EngineConfig(worker_id=a.worker_id, model=model, cache=cache, prefill_chunk=a.prefill_chunk,
                       failed_source_cooldown_s=a.failed_source_cooldown_s,
                       source=source, target=target, ipc_dir=a.ipc_dir)
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // group.size))
    ex = Executor(cfg, comm=group.comm)
    if ex.rank != 0:
        try:
            ex.follow()
        finally:
            ex.close()
        return 0
    server = EngineServer(ex, a.bind)
    signal.signal(signal.SIGTERM, lambda *_: server.stop.set())
    try:
        if a.ready_file:
            info = {"endpoint": server.endpoint, "worker_id": a.worker_id, "tp_size": ex.tp_size,
                    "source_endpoint": getattr(ex.source, "endpoint", None), "pid": os.getpid()}
            tmp = Path(a.ready_file + ".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(a.ready_file)
        server.serve()
    finally:
        server.close()
        ex.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # NIXL/UCX have been seen to crash in interpreter teardown; everything is shut down and flushed by now.
    os._exit(code)
