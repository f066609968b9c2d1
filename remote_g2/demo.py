"""``make demo``: the registry round trip, end to end, on one box.

1. starts ``remote-g2 serve`` (embedded store) as its own process;
2. worker A fills its G2 pool index with the blocks of a prompt and publishes
   them through a :class:`~remote_g2.registry.SourcePublisher`;
3. worker B, whose prompt shares a prefix with A's, asks the registry who
   holds the longest prefix and is told A and how many blocks;
4. A pins exactly those blocks (atomic find-and-pin, as its source service
   does for a remote read) and unpins them;
5. the admin CLI shows the registry's view; the server is stopped.

Run: ``python -m remote_g2.demo`` (``--json`` for a machine-readable summary).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from remote_g2.cli import main as cli_main
from remote_g2.hashing import chain_block_hashes
from remote_g2.messages import LayoutFingerprint
from remote_g2.pool_index import PoolIndex
from remote_g2.registry import RegistryClient, SourcePublisher

TOKENS_PER_BLOCK = 16
FP = LayoutFingerprint(model_id="demo-llama-tiny", dtype="bf16", tokens_per_block=TOKENS_PER_BLOCK,
                       kv_layout="HND", num_layers=4, num_kv_heads=8, head_dim=64, tp_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_registry(port: int) -> subprocess.Popen[str]:
    exe = Path(sys.executable).parent / "remote-g2"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "remote_g2.cli"]
    proc = subprocess.Popen(cmd + ["serve", "--bind", f"tcp://127.0.0.1:{port}", "--lease-ttl-s", "5"],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "REMOTE_G2_LOG_LEVEL": os.environ.get("REMOTE_G2_LOG_LEVEL", "WARNING")})
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if "serving on" not in line:
        proc.kill()
        raise SystemExit(f"registry failed to start: {line!r}")
    print(f"[1/5] {line}  (pid {proc.pid})")
    return proc


def run(as_json: bool) -> dict[str, object]:
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = _start_registry(port)
    summary: dict[str, object] = {"registry": endpoint}
    try:
        rng = random.Random(7)
        system_prompt = [rng.randrange(32_000) for _ in range(800)]
        prompt_a = system_prompt + [rng.randrange(32_000) for _ in range(200)]
        prompt_b = system_prompt + [rng.randrange(32_000) for _ in range(300)]
        hashes_a = chain_block_hashes(prompt_a, TOKENS_PER_BLOCK)
        hashes_b = chain_block_hashes(prompt_b, TOKENS_PER_BLOCK)

        # Worker A: its G2 pool holds every full block of prompt A.
        pool = PoolIndex(4096)
        for block_id, h in enumerate(hashes_a):
            pool.insert(h, block_id)
        cached = set(hashes_a)
        publisher = SourcePublisher(RegistryClient(endpoint), worker_id="worker-a", endpoint="tcp://127.0.0.1:7460",
                                    fingerprint=FP, snapshot=lambda: sorted(cached), flush_interval_s=0.01).start()
        publisher.stored(hashes_a)
        if not publisher.flush(10):
            raise SystemExit("worker A could not publish its blocks to the registry")
        print(f"[2/5] worker-a cached {len(hashes_a)} blocks of a {len(prompt_a)}-token prompt and published them")

        # Worker B: who holds the longest prefix of prompt B?
        with RegistryClient(endpoint) as client:
            t0 = time.perf_counter()
            reply = client.lookup(hashes_b, requester="worker-b", compat_key=FP.compat_key())
            ms = (time.perf_counter() - t0) * 1e3
        assert reply.best is not None, reply.reason
        print(f"[3/5] worker-b asked for {len(hashes_b)} blocks: {reply.best.worker_id} at {reply.best.endpoint} "
              f"holds the first {reply.matched} ({reply.matched * TOKENS_PER_BLOCK} tokens of prefill saved), "
              f"lookup {ms:.2f} ms")

        # Worker A pins exactly those blocks for the read, then lets them go.
        ids = pool.find_and_pin(hashes_b[: reply.matched])
        pinned = sum(pool.pin_count(i) for i in ids)
        pool.unpin_blocks_by_id(ids)
        print(f"[4/5] worker-a pinned {len(ids)} blocks atomically (pins held: {pinned}), then released them "
              f"(pins now: {sum(pool.pin_count(i) for i in ids)})")

        print("[5/5] the registry's view (remote-g2 admin workers / prefix):")
        cli_main(["admin", "--registry", endpoint, "workers"])
        cli_main(["admin", "--registry", endpoint, "prefix", *(h.hex() for h in hashes_b[:4])])
        publisher.close()
        publisher.client.close()
        summary.update(blocks_published=len(hashes_a), asked=len(hashes_b), matched=reply.matched,
                       owner=reply.best.worker_id, lookup_ms=round(ms, 3), pinned=len(ids))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(10)
        print(f"registry stopped (exit {code})")
    if as_json:
        print(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote_g2.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    args = parser.parse_args(argv)
    summary = run(args.json)
    expected = 800 // TOKENS_PER_BLOCK
    if summary.get("matched") != expected:
        print(f"demo FAILED: expected {expected} matched blocks, got {summary.get('matched')}", file=sys.stderr)
        return 1
    print("demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
