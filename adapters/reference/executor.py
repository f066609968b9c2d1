"""The reference engine's executor: one per TP rank; start-up with the hooks, the step loop, shutdown.

Every rank builds its model shard and KV memory, then calls the hooks
exactly as an engine integration would::

    source = maybe_start_source_service(g2_pool, worker_id=..., comm=tp_comm, config=...)
    target = maybe_start_target_client(g2_pool, worker_id=..., comm=tp_comm, config=...)

(each a no-op returning None unless enabled by its config or by
``REMOTE_G2_SOURCE=1`` / ``REMOTE_G2_TARGET=1``). Both are collective over the
TP group, so every rank calls them in this order.

Rank 0 (the leader) runs the :class:`~.scheduler.Scheduler` and the request
API; each step it sends the plan (:class:`~.messages.EngineStep`) to every
other rank over a private IPC PUSH socket, then applies it itself. Ranks > 0
wait for the next step in ``zmq`` (sleeping, not spinning as an idle MPI
collective would) and apply each op to their own shard; the model's
allgathers inside a ``forward`` are the only MPI traffic after start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import zmq
from remote_g2.source import SourceConfig, maybe_start_source_service
from remote_g2.target import TargetConfig, maybe_start_target_client

from remote_g2.errors import ProtocolError
from remote_g2.rpc.ipc_paths import (
    claim_ipc_path,
    default_ipc_dir,
    ipc_endpoint,
    prepare_ipc_dir,
    release_ipc_path,
)
from remote_g2.tp.group import resolve_tp_group
from remote_g2.protocol.wire import decode_frame, decode_request_body, encode_request

from .kv_cache import CacheConfig, PagedKv, fingerprint
from .messages import EngineStep, StepOp
from .config import ModelConfig
from .model import ReferenceModel, SequenceCache
from .scheduler import Scheduler
from .tp import TpComm

__all__ = ["EngineConfig", "Executor"]

log = logging.getLogger("remote_g2.adapters.reference.executor")


@dataclass(frozen=True)
class EngineConfig:
    """One engine worker (every rank gets the same).

    ``source`` / ``target``: the hooks' configs; None reads them from the
    environment (``REMOTE_G2_SOURCE*`` / ``REMOTE_G2_TARGET*``). Either way
    the layout fingerprint is filled in from the model and cache here.
    """

    worker_id: str
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    prefill_chunk: int = 256
    failed_source_cooldown_s: float = 30.0  # after a load from a source failed, do not try it for this long
    source: SourceConfig | None = None
    target: TargetConfig | None = None
    ipc_dir: str | None = None


class Executor:
    """This rank's engine. Construct on every rank of the TP group (collective); then
    the leader calls :meth:`step` in its loop and the others :meth:`follow`."""

    def __init__(self, config: EngineConfig, *, comm: Any = None) -> None:
        self.config = config
        group = resolve_tp_group(None, None, comm)
        self.rank, self.tp_size = group.rank, group.size
        self.tp = TpComm(group.comm.Dup() if group.comm is not None else None)
        self.model = ReferenceModel(config.model, self.tp)
        self.kv = PagedKv(config.model, config.cache, self.model.local_kv_heads)
        self._seqs: dict[str, SequenceCache] = {}
        self._ctx = zmq.Context.instance()
        self._push: list[zmq.Socket] = []
        self._pull: zmq.Socket | None = None
        self._endpoint: str | None = None
        self._seq = 0
        self.source = self.target = None
        fp = fingerprint(config.model, config.cache, self.tp_size, kv_dtype=self.kv.g1.dtype)
        src_cfg = config.source or SourceConfig.from_env(fingerprint=fp)
        tgt_cfg = config.target or TargetConfig.from_env()
        try:
            self.source = maybe_start_source_service(
                self.kv.g2, worker_id=config.worker_id, comm=group.comm, tp_rank=self.rank, tp_size=self.tp_size,
                config=src_cfg.with_overrides(fingerprint=fp))
            self.target = maybe_start_target_client(
                self.kv.g2, worker_id=config.worker_id, comm=group.comm, tp_rank=self.rank, tp_size=self.tp_size,
                config=replace(tgt_cfg, fingerprint=fp))
            self._connect_ranks(group.comm)
        except BaseException:
            self.close()
            raise
        self.scheduler: Scheduler | None = None
        if self.rank == 0:
            self.scheduler = Scheduler(
                tokens_per_block=config.cache.tokens_per_block, g1_blocks=config.cache.g1_blocks,
                landing_slots=self.kv.landing_slot_ids(), block_bytes=self.kv.layout.block_bytes,
                tp_size=self.tp_size, target=self.target, g2_has=lambda h: self.kv.g2.lookup(h) is not None,
                prefill_chunk=config.prefill_chunk, failed_source_cooldown_s=config.failed_source_cooldown_s)
        log.info("engine %s rank %d/%d up (source %s, target %s)", config.worker_id, self.rank, self.tp_size,
                 "on" if self.source else "off", "on" if self.target else "off")

    # -- the step channel -------------------------------------------------------------------

    def _connect_ranks(self, comm: Any) -> None:
        """Ranks > 0 bind a PULL socket; after a barrier the leader connects a PUSH to each."""
        if self.tp_size == 1:
            return
        directory = prepare_ipc_dir(self.config.ipc_dir or default_ipc_dir())
        if self.rank > 0:
            self._endpoint = ipc_endpoint(directory, f"engine-{self.config.worker_id}", self.rank)
            claim_ipc_path(self._endpoint)
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.LINGER, 0)
            self._pull.bind(self._endpoint)
        comm.Barrier()
        if self.rank == 0:
            for r in range(1, self.tp_size):
                s = self._ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 1000)
                s.connect(ipc_endpoint(directory, f"engine-{self.config.worker_id}", r))
                self._push.append(s)

    def _broadcast(self, ops: list[StepOp]) -> None:
        self._seq += 1
        frame = encode_request(self._seq, EngineStep(self._seq, ops))
        for s in self._push:
            s.send(frame)

    # -- leader ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Plan one step, send it to every rank, apply it here; False when there was nothing to do."""
        assert self.scheduler is not None, "step() runs on the leader"
        ops = self.scheduler.plan()
        if not ops:
            return False
        self._run(ops)
        return True

    def _run(self, ops: list[StepOp]) -> None:
        sched = self.scheduler
        assert sched is not None
        while ops:
            self._broadcast(ops)
            later: list[StepOp] = []
            for op in ops:
                out = self._apply(op)
                if op.kind == "forward":
                    later += sched.forwarded(op, out)
                elif op.kind == "onboard":
                    sched.onboarded(op.request_id, out)
            ops = later  # write-through and finish go out right away, as their own step

    def evict(self, hashes: list[bytes]) -> int:
        """Drop ``hashes`` from G2 on every rank (leader); returns how many rank 0 dropped."""
        op = StepOp("evict", hashes=hashes)
        self._broadcast([op])
        return int(self._apply(op))  # HostPool.remove's own count

    # -- every rank ---------------------------------------------------------------------------

    def follow(self, poll_ms: int = 1000) -> None:
        """Rank > 0: apply the leader's steps until a ``stop`` op (or the leader's socket goes away)."""
        assert self._pull is not None
        expect = 1
        while True:
            if not self._pull.poll(poll_ms):
                continue
            data = self._pull.recv()
            try:
                step = decode_request_body(decode_frame(data))[1]
                if not isinstance(step, EngineStep):
                    raise ProtocolError(f"expected engine_step, got {type(step).__name__}")
            except Exception as e:  # never from our leader: log and drop
                log.error("rank %d dropped a bad step frame: %s", self.rank, e)
                continue
            if step.seq != expect:
                raise RuntimeError(f"rank {self.rank}: step {step.seq} arrived, {expect} expected")
            expect += 1
            for op in step.ops:
                if op.kind == "stop":
                    return
                self._apply(op)

    def _apply(self, op: StepOp) -> Any:
        kind = op.kind
        if kind == "forward":
            seq = self._seqs.get(op.request_id)
            if seq is None:
                seq = self.model.begin_sequence(op.capacity, self.kv.gather(op.blocks, op.start_pos))
                self._seqs[op.request_id] = seq
            if seq.length != op.start_pos:
                raise RuntimeError(f"{op.request_id}: forward at {op.start_pos}, the sequence holds {seq.length}")
            out = self.model.extend(seq, op.token_ids, chunk_tokens=self.kv.tpb)
            self.kv.scatter(op.blocks, op.start_pos, out.kv)
            return out.logits
        if kind == "onboard":
            got = self.kv.onboard_g2(op.hashes, op.blocks)
            return int(self.tp.allgather(torch.tensor([got], dtype=torch.int64)).min())
        if kind == "land":
            self.kv.land(op.slots, op.blocks)
            return None
        if kind == "store":
            try:
                self.kv.store_g2(op.hashes, op.blocks)
            except Exception as e:  # G2 full of pinned blocks: G1 still has them, this request is fine
                log.warning("rank %d: write-through to G2 failed: %s", self.rank, e)
            return None
        if kind == "evict":
            return self.kv.g2.remove(op.hashes)
        if kind == "gauges":
            mine = torch.tensor([int(self.kv.g2.stats()["pinned_blocks"])], dtype=torch.int64)
            return [int(x) for x in self.tp.allgather(mine).reshape(-1)]
        if kind == "finish":
            self._seqs.pop(op.request_id, None)
            return None
        raise ValueError(f"unknown step op {kind!r}")

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the ranks (leader), the hooks, and the step sockets. Idempotent."""
        if self.rank == 0 and self._push:
            try:
                self._broadcast([StepOp("stop")])
            except zmq.ZMQError:
                pass
        for hook in (self.target, self.source):
            if hook is not None:
                try:
                    hook.shutdown()
                except Exception:
                    log.exception("engine %s rank %d: hook shutdown failed", self.config.worker_id, self.rank)
        self.target = self.source = None
        for s in self._push:
            s.close()
        self._push = []
        if self._pull is not None:
            self._pull.close()
            self._pull = None
            if self._endpoint:
                release_ipc_path(self._endpoint)

    def stats(self) -> dict[str, Any]:
        """G2 gauges (leader; ``g2_pinned_per_rank`` asks every rank, a collective step)."""
        op = StepOp("gauges")
        self._broadcast([op])
        return {"g2_cached": len(self.kv.g2), "g2_pinned": int(self.kv.g2.stats()["pinned_blocks"]),
                "g2_pinned_per_rank": self._apply(op)}

