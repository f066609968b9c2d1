"""One vLLM tiering manager whose secondary tier is vLLM's own ``p2p`` tier, no engine: vLLM's real
``TieringOffloadingSpec`` builds the shared primary region, its CPU primary tier and ``P2PSecondaryTierManager``
(``{"type": "p2p", "host": ..., "port": ...}`` in ``secondary_tiers``), as an engine's connector would.
bench/bench_vllm_p2p.py runs two of these (a producer and a consumer) to time p2p's chunk fetch the way
bench/vllm/bench_vllm_tier.py part 1 times remote-g2's tier.

    python p2p_proc.py CONFIG_JSON

CONFIG_JSON: ``block_bytes``, ``cpu_bytes``, ``engine_id``, ``port`` (0: a free one), ``step_s`` (the idle step
interval, as an engine's scheduler steps; 0.002 as tests/vllm_procs/tier_proc.py), optional ``tier`` (more keys
for the p2p tier's config, e.g. ``num_threads``).

Driven over stdin/stdout, one JSON object a line (answers start with ``@@ ``: NIXL and UCX may log to stdout):

* ``{"op": "store", "keys": [hex, ...], "seed": N, "kv_request_id": K or null}``: each chunk's row in the primary
  region gets bytes drawn from ``seed`` and the key (what the worker would copy from the GPU), then
  ``complete_store`` (vLLM cascades it to the p2p tier). Without ``kv_request_id`` the p2p tier just acknowledges
  the cascade and the chunk sits in the primary tier, where a symmetric-P2P consumer's LookupMsg finds it. With
  one, the request carries ``kv_transfer_params = {"remote_decoder": {"kv_request_id": K}}`` (PD: vLLM parks the
  chunks pinned under K until a consumer's FetchMsg for K binds them). Answers ``{"stored": n, "sha": {key:
  sha256 of the row as written}}``.
* ``{"op": "load", "keys": [...], "host": H, "port": P, "kv_request_id": K, "mode": "symmetric"|"pd",
  "timeout_s": T}``: a request whose ``kv_transfer_params`` names the producer (``remote_kv_source`` for
  symmetric, ``remote_prefiller`` for PD) looks each key up, steps until each is in the primary tier (promoted
  by the p2p tier) or missed; answers ``{"got": {key: sha256 of its row, or null, or "timeout"}, "jobs":
  [[chunks, seconds, success], ...], "load_s": seconds}``. ``jobs``: the p2p tier's promotion jobs of this load,
  timed from ``submit_load`` (the FetchMsg) to the step whose ``get_finished_jobs`` returned it (p2p's
  ``JobResult`` carries no ``transfer_time`` of its own); ``load_s``: the request's first lookup to its last key
  HIT (adds the LookupMsg round trip in symmetric mode).
* ``{"op": "writes"}``: the producer's NIXL WRITEs since the last call, ``[blocks, seconds]`` each, from
  ``write_blocks`` to the poll that saw it done (its data plane alone; polled once per step).
* ``{"op": "stats"}``; ``{"op": "stop"}``.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import os
import select
import signal
import socket
import sys
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from tiering_manager import build_manager, chunk_bytes  # (this file's folder: on sys.path when run as a script)

STEP = ScheduleEndContext((), ())
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # (the bench asks for a stack when an answer is late)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    cfg = json.loads(sys.argv[1])
    from remote_g2.ucx_modules import keep_one_verbs_stack

    keep_one_verbs_stack()  # (vLLM's p2p tier makes its own NIXL agent: see remote_g2.ucx_modules)
    port = int(cfg.get("port") or 0) or free_port()
    step_s = float(cfg.get("step_s", 0.002))
    tier = {"type": "p2p", "host": HOST, "port": port, **cfg.get("tier", {})}
    spec, manager, view = build_manager(cfg["block_bytes"], cfg["cpu_bytes"], tier, cfg.get("engine_id"),
                                        "p2p-bench")
    rows, row_bytes = view.shape
    p2p = manager.secondary_tiers[0]
    assert type(p2p).__name__ == "P2PSecondaryTierManager", type(p2p)
    data = p2p._data  # its NixlTransport (shared by every peer session)
    if not data.available:
        raise SystemExit("p2p: NixlTransport has no NIXL agent (vllm.distributed.nixl_utils.NixlWrapper is None)")

    # Timing hooks (instance attributes over vLLM's methods; the calls and their results are vLLM's own).
    job_t0: dict[int, tuple[float, int]] = {}
    jobs_done: list[list] = []
    orig_submit_load, orig_finished = p2p.submit_load, p2p.get_finished_jobs

    def submit_load(job: Any) -> None:
        job_t0[job.job_id] = (time.perf_counter(), len(job.keys))
        orig_submit_load(job)

    def get_finished_jobs() -> list:
        out = list(orig_finished())
        now = time.perf_counter()
        for r in out:
            t = job_t0.pop(r.job_id, None)
            if t is not None:
                jobs_done.append([t[1], now - t[0], bool(r.success)])
        return out

    p2p.submit_load, p2p.get_finished_jobs = submit_load, get_finished_jobs

    write_t0: dict[int, tuple[float, int]] = {}
    writes: list[list] = []
    orig_write, orig_poll = data.write_blocks, data.poll

    def write_blocks(peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        t0 = time.perf_counter()
        tid = orig_write(peer_id, local_idxs, remote_idxs)
        if tid is not None:
            write_t0[tid] = (t0, len(local_idxs))
        return tid

    def poll(peer_id: str | None = None) -> Any:
        res = orig_poll(peer_id)
        now = time.perf_counter()
        for tid in res.done:
            t = write_t0.pop(tid, None)
            if t is not None:
                writes.append([t[1], now - t[0]])
        for tid in res.failed:
            write_t0.pop(tid, None)
        return res

    data.write_blocks, data.poll = write_blocks, poll

    n_ctx = 0
    steps = 0

    def say(obj: dict) -> None:
        sys.stdout.write("@@ " + json.dumps(obj) + "\n")
        sys.stdout.flush()

    def step() -> None:
        nonlocal steps
        manager.on_schedule_end(STEP)
        steps += 1

    def ctx(params: dict | None) -> ReqContext:
        nonlocal n_ctx
        n_ctx += 1
        c = ReqContext(req_id=f"req-{os.getpid()}-{n_ctx}", kv_transfer_params=params)
        manager.on_new_request(c)
        return c

    def store(keys: list[bytes], seed: int, kv_request_id: str | None) -> dict[str, str]:
        c = ctx({"remote_decoder": {"kv_request_id": kv_request_id}} if kv_request_id else None)
        out = manager.prepare_store(keys, c)
        assert out is not None, "the primary tier refused the store"
        assert len(out.keys_to_store) == len(keys), "some keys were already in the primary tier"
        sha = {}
        for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids):
            view[int(row)] = np.frombuffer(chunk_bytes(seed, key, row_bytes), np.uint8)
            sha[key.hex()] = hashlib.sha256(view[int(row)].tobytes()).hexdigest()
        manager.complete_store(out.keys_to_store, c, success=True)
        manager.on_request_finished(c)
        step()
        return sha

    def load(keys: list[bytes], params: dict, timeout_s: float) -> dict:
        del jobs_done[:]
        t0 = time.perf_counter()
        c = ctx(params)
        got: dict[str, str | None] = {}
        held: list[tuple[bytes, int]] = []  # HIT keys, read (pinned by prepare_load) only once the load is timed
        pending = list(keys)
        deadline = time.monotonic() + timeout_s
        t_last = t0
        while pending and time.monotonic() < deadline:
            for key in list(pending):
                r = manager.lookup(key, c)
                if r == LookupResult.HIT:
                    held.append((key, int(manager.prepare_load([key], c).chunk_ids[0])))
                    pending.remove(key)
                    t_last = time.perf_counter()
                elif r == LookupResult.MISS:
                    got[key.hex()] = None
                    pending.remove(key)
            if pending:
                step()
                time.sleep(step_s)
        for key, row in held:
            got[key.hex()] = hashlib.sha256(view[row].tobytes()).hexdigest()
            manager.complete_load([key], c)
        for key in pending:
            got[key.hex()] = "timeout"
        manager.on_request_finished(c)
        step()
        return {"got": got, "jobs": list(jobs_done), "load_s": t_last - t0, "unfinished_jobs": len(job_t0)}

    say({"ready": True, "rows": rows, "row_bytes": row_bytes, "pid": os.getpid(), "host": HOST, "port": port,
         "tier": {k: v for k, v in tier.items()}})
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], step_s)
        if not readable:
            step()  # (p2p's has_pending_work() is always True: an engine keeps ticking for it)
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "store":
            sha = store([bytes.fromhex(k) for k in cmd["keys"]], int(cmd["seed"]), cmd.get("kv_request_id"))
            say({"stored": len(sha), "sha": sha})
        elif op == "load":
            role = "remote_kv_source" if cmd.get("mode", "symmetric") == "symmetric" else "remote_prefiller"
            params = {role: {"kv_request_id": cmd["kv_request_id"], "remote_host": cmd["host"],
                             "remote_port": int(cmd["port"])}}
            say(load([bytes.fromhex(k) for k in cmd["keys"]], params, float(cmd.get("timeout_s", 10))))
        elif op == "writes":
            say({"writes": list(writes)})
            del writes[:]
        elif op == "stats":
            sessions = {pid: {"ready": s.ready, "alive": s.alive} for pid, s in p2p._sessions.items()}
            say({"steps": steps, "sessions": sessions, "unbound_stores": len(p2p._unbound_stores),
                 "failed_req_ids": len(p2p._failed_req_ids), "jobs_in_flight": len(manager._jobs)})
        elif op == "stop":
            break
    del view  # (a view of the region left alive would keep vLLM from unmapping it)
    manager.shutdown()
    say({"stopped": True})


if __name__ == "__main__":
    main()
