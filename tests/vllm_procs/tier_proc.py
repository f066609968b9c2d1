"""One vLLM tiering manager with remote-g2's tier, no engine: vLLM's real ``TieringOffloadingSpec`` builds the
shared primary region, its CPU primary tier and the tier (by ``module_path``, as an engine's connector does).

Run by tests/test_vllm_tier.py in a process of its own::

    python tier_proc.py CONFIG_JSON

and driven over stdin/stdout, one JSON object a line (answers start with ``@@ ``: NIXL logs to stdout). Commands:

* ``{"op": "store", "keys": [hex, ...], "seed": N}``: each chunk is written into the primary region with bytes
  drawn from ``seed`` and the key (what the engine's worker would copy from the GPU), then completed, which
  cascades it to the tier (published);
* ``{"op": "load", "keys": [...], "timeout_s": T}``: looks each key up, steps until each is in the primary tier
  or missed, and answers ``{"got": {key: sha256 of its row, or null}}``;
* ``{"op": "load_abort", "keys": [...]}``: a request looks the keys up (a promotion through the tier starts)
  and ends at once, its load in flight; once the tier has no pending work, ``load`` of the same keys (answered
  with ``first``, the first lookups' results, and ``settled``);
* ``{"op": "evict"}``: stores fresh chunks until every earlier one has left the primary (its LRU);
* ``{"op": "fetch_times"}``: the tier's last loads, ``(chunks, seconds from resolve to release)`` each;
* ``{"op": "raw_read", "endpoint": E, "keys": [...]}``: those chunks READ from holder ``E`` by a NIXL agent of
  this process's own into a scratch region shaped like the primary, timed from the post to ``done``
  (bench/vllm/bench_vllm_tier.py's baseline);
* ``{"op": "resolve_only", "endpoint": E, "keys": [...], "ttl_ms": T}``: a lease on those chunks at holder ``E``,
  not released (answers ``matched``, ``expires_in_ms``, ``lease_id``);
* ``{"op": "release", "endpoint": E, "lease_id": L, "other_connection": bool}``: its release (on the connection
  that took it, or a fresh one), answered ``{"released": bool}``;
* ``{"op": "stats"}``; ``{"op": "stop"}``.

Between commands the manager steps every 2 ms, as an engine's scheduler would (it serves peers then), unless
the config says ``"idle": true``: then it steps only while the tier says it has work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import sys
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from tiering_manager import build_manager, chunk_bytes  # (this file's folder: on sys.path when run as a script)

from remote_g2.adapters.vllm_tier.identity import TierIdentity
from remote_g2.protocol.messages import LayoutFingerprint

STEP = ScheduleEndContext((), ())


class RawReader:
    """A NIXL agent of its own over a scratch region shaped like the primary (faulted in): READs a holder's rows
    with no tier in the way (a bench's baseline; the resolve and release around it are not timed)."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        self.rows, self.row_bytes = rows, row_bytes
        self.buf: np.ndarray | None = None
        self.agent = None
        self.clients: dict = {}

    def read(self, endpoint: str, hashes: list[bytes]) -> float:
        from remote_g2.adapters.nixl_transfer import NixlTransfer
        from remote_g2.adapters.vllm_tier.fetching import coalesce
        from remote_g2.protocol.messages import Release, Resolve
        from remote_g2.rpc.client import RpcClient
        from remote_g2.memory.secondary_pool import MemoryRegion

        if self.agent is None:
            self.buf = np.ones((self.rows, self.row_bytes), np.uint8)  # (every page touched)
            self.agent = NixlTransfer(f"tier-bench-raw-{os.getpid()}")
            self.agent.register_local([MemoryRegion(self.buf.ctypes.data, self.buf.nbytes)])
        assert self.buf is not None
        client = self.clients.get(endpoint) or self.clients.setdefault(endpoint, RpcClient(endpoint))
        reply = client.call(Resolve(hashes, 10_000, "bench-raw"))
        assert reply.reason == "ok" and reply.matched == len(hashes), reply
        try:
            info = reply.metadata[0]
            if not self.agent.has_peer(info.agent_name):
                self.agent.add_peer(info.agent_name, info.agent_metadata)
            local, remote, nbytes = coalesce(list(range(len(hashes))), list(reply.ranks[0].block_ids),
                                             self.row_bytes, self.buf.ctypes.data, info.pool_base)
            t0 = time.perf_counter()
            handle = self.agent.start_read(info.agent_name, local, remote, nbytes)
            while (state := self.agent.poll(handle)) == "pending":
                pass
            seconds = time.perf_counter() - t0
            self.agent.release(handle)
            assert state == "done", state
            return seconds
        finally:
            client.call(Release(reply.lease_id))

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        if self.agent is not None:
            self.agent.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    cfg = json.loads(sys.argv[1])
    fp = LayoutFingerprint(**cfg["fingerprint"])
    tier = {"type": "RemoteG2Tier", "module_path": "remote_g2.adapters.vllm_tier.tier", "registry": cfg["registry"],
            "worker_id": cfg["worker_id"], "identity": TierIdentity(fp), **cfg.get("tier", {})}
    spec, manager, view = build_manager(cfg["block_bytes"], cfg["cpu_bytes"], tier, cfg.get("engine_id"),
                                        "remote-g2-test")
    rows, row_bytes = view.shape
    ours = manager.secondary_tiers[0]
    n_ctx = 0
    steps = 0

    def say(obj: dict) -> None:
        sys.stdout.write("@@ " + json.dumps(obj) + "\n")  # (NIXL logs to stdout too)
        sys.stdout.flush()

    def step() -> None:
        nonlocal steps
        manager.on_schedule_end(STEP)
        steps += 1

    def ctx() -> ReqContext:
        nonlocal n_ctx
        n_ctx += 1
        c = ReqContext(req_id=f"req-{n_ctx}")
        manager.on_new_request(c)
        return c

    def store(keys: list[bytes], seed: int) -> None:
        c = ctx()
        out = manager.prepare_store(keys, c)
        assert out is not None, "the primary tier refused the store"
        for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids):
            view[int(row)] = np.frombuffer(chunk_bytes(seed, key, row_bytes), np.uint8)
        manager.complete_store(out.keys_to_store, c, success=True)
        manager.on_request_finished(c)
        step()

    def load(keys: list[bytes], timeout_s: float) -> dict[str, str | None]:
        c = ctx()
        got: dict[str, str | None] = {}
        pending = list(keys)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for key in list(pending):
                r = manager.lookup(key, c)
                if r == LookupResult.HIT:
                    spec_ = manager.prepare_load([key], c)
                    got[key.hex()] = hashlib.sha256(view[int(spec_.chunk_ids[0])].tobytes()).hexdigest()
                    manager.complete_load([key], c)
                    pending.remove(key)
                elif r == LookupResult.MISS:
                    got[key.hex()] = None
                    pending.remove(key)
            step()
            time.sleep(0.002)
        for key in pending:
            got[key.hex()] = "timeout"
        manager.on_request_finished(c)
        return got

    asking: dict[str, Any] = {}  # holder endpoint -> the client resolve_only asks it on
    raw = RawReader(rows, row_bytes)
    say({"ready": True, "rows": rows, "row_bytes": row_bytes, "pid": os.getpid(),
         "sharing": ours.server is not None})
    idle = bool(cfg.get("idle"))
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.002)
        if not readable:
            if not idle or ours.has_pending_work():
                step()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "store":
            store([bytes.fromhex(k) for k in cmd["keys"]], int(cmd["seed"]))
            say({"stored": len(cmd["keys"])})
        elif op == "load":
            say({"got": load([bytes.fromhex(k) for k in cmd["keys"]], float(cmd.get("timeout_s", 10)))})
        elif op == "load_abort":  # a request aborted while its chunks are on their way from the holder
            c = ctx()
            ks = [bytes.fromhex(k) for k in cmd["keys"]]
            first = [manager.lookup(k, c).name for k in ks]  # HIT_PENDING: a promotion through the tier began
            step()  # (the manager submits the tier's load job at the end of the step)
            manager.on_request_finished(c)  # aborted now, its load still in flight
            deadline = time.monotonic() + 10
            while ours.has_pending_work() and time.monotonic() < deadline:
                step()
                time.sleep(0.002)
            step()
            say({"first": first, "settled": not ours.has_pending_work(),
                 "got": load(ks, float(cmd.get("timeout_s", 5)))})
        elif op == "evict":
            fresh = [os.urandom(32) + bytes(4) for _ in range(rows)]
            for i in range(0, len(fresh), 8):
                store(fresh[i:i + 8], 0)
            say({"evicted": True})
        elif op == "fetch_times":  # the tier's last loads: (chunks, seconds from resolve to release), then forgotten
            times = list(ours.fetcher.recent) if ours.fetcher else []
            if ours.fetcher:
                ours.fetcher.recent.clear()
            say({"fetches": times})
        elif op == "resolve_only":  # a reader that takes a lease and never gives it back (it died, say)
            from remote_g2.protocol.messages import Resolve
            from remote_g2.rpc.client import RpcClient

            client = asking.get(cmd["endpoint"]) or asking.setdefault(cmd["endpoint"], RpcClient(cmd["endpoint"]))
            reply = client.call(Resolve([bytes.fromhex(k)[:-4] for k in cmd["keys"]], int(cmd["ttl_ms"]), "gone"))
            say({"matched": reply.matched, "expires_in_ms": reply.expires_in_ms, "lease_id": reply.lease_id})
        elif op == "release":  # on resolve_only's connection to that holder (a lease is its connection's), or another
            from remote_g2.protocol.messages import Release
            from remote_g2.rpc.client import RpcClient

            if cmd.get("other_connection"):
                with RpcClient(cmd["endpoint"]) as other:
                    say({"released": other.call(Release(int(cmd["lease_id"]))).released})
            else:
                say({"released": asking[cmd["endpoint"]].call(Release(int(cmd["lease_id"]))).released})
        elif op == "raw_read":  # the bench's baseline: the same chunks by one raw NIXL READ into a scratch buffer
            say({"seconds": raw.read(cmd["endpoint"], [bytes.fromhex(k)[:-4] for k in cmd["keys"]])})
        elif op == "stats":
            server, fetcher = ours.server, ours.fetcher
            say({"steps": steps, "served": server.served if server else 0, "missed": server.missed if server else 0,
                 "lapsed": server.lapsed if server else 0, "open_leases": server.open_leases() if server else 0,
                 "read": fetcher.chunks_read if fetcher else 0, "failed": fetcher.chunks_failed if fetcher else 0,
                 "read_one_sided": fetcher.chunks_read_one_sided if fetcher else 0})
        elif op == "stop":
            break
    raw.close()
    for client in asking.values():
        client.close()
    del view  # (a view of the region left alive would keep vLLM from unmapping it)
    manager.shutdown()
    say({"stopped": True})


if __name__ == "__main__":
    main()
