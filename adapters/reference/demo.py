"""``remote-g2 demo``: two reference engines on one box, one reusing the other's KV over NIXL, checked bit for bit.

1. starts the registry (``remote-g2 serve``, embedded store; ``--redis-url`` for Redis);
2. starts a *source* engine (``--source-tp`` ranks under ``mpiexec``, source hook on)
   and a *target* engine (``--target-tp`` ranks, target hook on);
3. the source serves prompts that share a long prefix: their blocks land in
   its G2 pool and are published to the registry;
4. the target serves the same prompts twice: with every cache off (the
   recompute baseline) and with remote reuse (lookup → resolve → per-rank
   NIXL READ into its own G2 → onboard into G1 → prefill the rest);
5. prints what was reused, bytes and GB/s, time to first token both ways,
   and whether every generated token and every logit of the remote run
   equals the recompute run (and the source's own run) bit for bit.

With ``--netns`` (root only) the registry, the source and the target each
run on their own "host": a Linux network namespace on a private subnet
(:mod:`remote_g2.adapters.reference.netns`), the registry bound to ``0.0.0.0`` and the engines
given only its address, with ``UCX_TLS=tcp`` so the KV crosses the link
between the hosts (the namespaces share one kernel: UCX would otherwise use
shared memory). The report names the hosts' addresses and the bytes the
target's link received.

Every process it starts is stopped (by PID / process group) before it returns,
and every namespace it made is removed.
Exit code 0 only when blocks were reused remotely and all outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source-tp", type=int, default=2, help="TP size of the source engine (default 2)")
    p.add_argument("--target-tp", type=int, default=2, help="TP size of the target engine (default 2)")
    p.add_argument("--mla", action="store_true", help="the MLA-like model (one latent KV head on every rank)")
    p.add_argument("--redis-url", default=None, help="registry on this Redis instead of the embedded store")
    p.add_argument("--prompts", type=int, default=3, help="prompts sharing the prefix (default 3)")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="shared prefix length (default 1024)")
    p.add_argument("--suffix-tokens", type=int, default=64, help="each prompt's own tail (default 64)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per prompt (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--netns", action="store_true",
                   help="run the registry, the source and the target each in its own network namespace (a "
                        "'host' on a private subnet; UCX over TCP between them); needs root")


NETNS_REGISTRY_PORT = 7450  # the registry's host is a fresh namespace: the port is free there

# Run inside a host (only the namespaces reach the subnet): the count of a worker's blocks the registry lists,
# once it reaches ``blocks`` or 10 s passed.
_WAIT_BLOCKS = """
import sys
from remote_g2.registry import RegistryClient
with RegistryClient(sys.argv[1]) as reg:
    print(reg.wait_for_blocks(sys.argv[2], int(sys.argv[3])))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


def _start_registry(redis_url: str | None, host: Any = None) -> tuple[subprocess.Popen[str], str]:
    """``remote-g2 serve`` on loopback, or in ``host`` (a :class:`.netns.Host`) bound to the wildcard
    as an operator would; returns it and the endpoint the engines dial."""
    if host is None:
        endpoint = bind = f"tcp://127.0.0.1:{_free_port()}"
    else:
        bind, endpoint = f"tcp://0.0.0.0:{NETNS_REGISTRY_PORT}", f"tcp://{host.address}:{NETNS_REGISTRY_PORT}"
    exe = Path(sys.executable).parent / "remote-g2"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "remote_g2.cli"]
    cmd += ["serve", "--bind", bind, "--lease-ttl-s", "10"]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    if host is not None:
        cmd = host.command(cmd)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "REMOTE_G2_LOG_LEVEL": "WARNING"})
    assert proc.stdout is not None
    # Read the raw pipe (no buffered readline: select would miss lines already buffered) until the banner;
    # lines before it (a warning about its settings, say) are shown if it never comes.
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + 30
    while b"serving on" not in seen:
        left = deadline - time.monotonic()
        chunk = os.read(fd, 65536) if left > 0 and select.select([fd], [], [], left)[0] else b""
        if not chunk:
            _stop(proc)
            raise RuntimeError(f"the registry did not start: {seen.decode(errors='replace')[-2000:]!r}")
        seen += chunk
    return proc, endpoint


def _stop(proc: subprocess.Popen[Any]) -> None:
    from remote_g2.adapters.reference.launch import stop_group

    stop_group(proc)


def _distinct_blocks(prompts: list[list[int]]) -> set[bytes]:
    from remote_g2.identity.hashing import chain_block_hashes

    return {h for p in prompts for h in chain_block_hashes(p, 16)}


def _wait_published(registry: str, worker_id: str, blocks: int, host: Any = None) -> int:
    """Wait (10 s at most) until the registry lists ``blocks`` blocks of ``worker_id``; the count it lists.
    With ``host``, asks from inside that host (this process cannot reach the namespaces' subnet)."""
    if host is not None:
        res = subprocess.run(host.command([sys.executable, "-c", _WAIT_BLOCKS, registry, worker_id, str(blocks)]),
                             capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"asking the registry from {host.name} failed: {res.stderr.strip()[-1000:]}")
        return int(res.stdout.strip())
    from remote_g2.registry import RegistryClient

    with RegistryClient(registry) as reg:
        return reg.wait_for_blocks(worker_id, blocks)


def run(args: argparse.Namespace) -> int:
    hosts = None
    if getattr(args, "netns", False):
        from remote_g2.adapters.reference.netns import Hosts, netns_unavailable_reason

        why = netns_unavailable_reason()
        if why is None and args.redis_url:
            why = "--redis-url: the namespaces have no route out of their private subnet"
        if why is not None:
            print(f"remote-g2 demo --netns: {why}", file=sys.stderr)
            return 2
        hosts = Hosts(["registry", "source", "target"])
    try:
        return _run(args, hosts)
    finally:
        if hosts is not None:
            hosts.close()


def _run(args: argparse.Namespace, hosts: Any) -> int:
    """The demo; with ``hosts`` (:class:`remote_g2.adapters.reference.netns.Hosts`), each part on its own host."""
    from remote_g2.adapters.reference.launch import EngineProcess

    quiet = bool(args.json)
    t_start = time.perf_counter()
    rng = random.Random(2026)
    shared = [rng.randrange(1024) for _ in range(args.prefix_tokens)]
    prompts = [shared + [rng.randrange(1024) for _ in range(args.suffix_tokens)] for _ in range(args.prompts)]
    model = ["--mla"] if args.mla else []
    started: list[Any] = []
    registry_proc = None
    # --netns: each part on its own host; UCX over TCP, so the KV crosses the link between the hosts.
    on = (lambda name: hosts[name]) if hosts is not None else (lambda name: None)
    engine_env = {"UCX_TLS": "tcp"} if hosts is not None else None
    try:
        registry_proc, registry = _start_registry(args.redis_url, on("registry"))
        store = f"redis {args.redis_url}" if args.redis_url else "embedded store"
        where = ""
        if hosts is not None:
            where = " on host 'registry' (bound to 0.0.0.0)"
            _say(quiet, "[0/5] hosts (network namespaces on a private subnet; UCX_TLS=tcp between them): " +
                 ", ".join(f"{h.name} {h.address} ({h.netns})" for h in hosts))
        _say(quiet, f"[1/5] registry serving on {registry}{where} ({store}, pid {registry_proc.pid})")
        t0 = time.perf_counter()
        source = EngineProcess("demo-source", tp=args.source_tp, args=["--source", "--registry", registry, *model],
                               env=engine_env, netns=on("source"))
        started.append(source)
        target = EngineProcess("demo-target", tp=args.target_tp, args=["--target", "--registry", registry, *model],
                               env=engine_env, netns=on("target"))
        started.append(target)
        _say(quiet, f"[2/5] source engine (TP={args.source_tp}) and target engine (TP={args.target_tp}) up in "
                    f"{time.perf_counter() - t0:.1f} s ({'MLA' if args.mla else 'GQA'} reference model)"
                    + (f"; the source serves on {source.info.get('source_endpoint')}" if hosts is not None else ""))
        # Warm-up, kept out of the timings: the first forwards pay one-off costs, and the target's first
        # load from a source fetches its NIXL metadata and connects (once per source and epoch).
        warm = [rng.randrange(1024) for _ in range(40)]
        source.client.generate("warm-up", warm, 2, cache="local")
        _wait_published(registry, "demo-source", 2, on("target"))
        first = target.client.generate("warm-up", warm, 2, cache="all")

        src = [source.client.generate(f"src-{i}", p, args.new_tokens, cache="local") for i, p in enumerate(prompts)]
        held = _wait_published(registry, "demo-source", 2 + len(_distinct_blocks(prompts)), on("target"))
        _say(quiet, f"[3/5] source served {len(prompts)} prompts of {len(prompts[0])} tokens "
                    f"({args.prefix_tokens} shared); the registry shows {held} of its blocks")

        base = [target.client.generate(f"base-{i}", p, args.new_tokens, cache="none") for i, p in enumerate(prompts)]
        _say(quiet, f"[4/5] target recomputed them (caches off): TTFT {base[0].ttft_s * 1e3:.0f} ms for the first")
        if hosts is not None:
            rx_before = hosts["target"].interface_bytes()[0]
        remote = [target.client.generate(f"remote-{i}", p, args.new_tokens, cache="all") for i, p in enumerate(prompts)]
        rx_bytes = hosts["target"].interface_bytes()[0] - rx_before if hosts is not None else 0
        _say(quiet, "[5/5] target served them again with remote reuse")

        identical = all(r.tokens == b.tokens == s.tokens and r.logits == b.logits == s.logits
                        for r, b, s in zip(remote, base, src))
        bytes_read = sum(r.bytes_remote for r in remote)
        load_s = sum(r.load_s for r in remote)
        blocks = sum(r.blocks_remote for r in remote)
        summary = {
            "source_tp": args.source_tp, "target_tp": args.target_tp, "model": "mla" if args.mla else "gqa",
            "registry": registry, "store": "redis" if args.redis_url else "embedded",
            "prompts": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": args.new_tokens,
            "registry_blocks_of_source": held,
            "blocks_reused_remote": blocks, "blocks_remote_failed": sum(r.blocks_remote_failed for r in remote),
            "bytes_read": bytes_read, "read_gbps": round(bytes_read / load_s / 1e9, 3) if load_s else 0.0,
            "ttft_remote_s": round(remote[0].ttft_s, 4), "ttft_recompute_s": round(base[0].ttft_s, 4),
            "ttft_speedup": round(base[0].ttft_s / remote[0].ttft_s, 2) if remote[0].ttft_s else 0.0,
            "outputs_identical": identical,
            "first_contact_load_s": round(first.load_s, 4), "first_contact_blocks": first.blocks_remote,
            "per_prompt": [{"prompt": i, "blocks": r.prompt_blocks, "remote": r.blocks_remote,
                            "local": r.blocks_g1 + r.blocks_g2, "computed": r.blocks_computed,
                            "ttft_recompute_s": round(b.ttft_s, 4), "ttft_remote_s": round(r.ttft_s, 4),
                            "load_s": round(r.load_s, 4), "bytes_read": r.bytes_remote,
                            "identical": r.tokens == b.tokens == s.tokens and r.logits == b.logits == s.logits}
                           for i, (r, b, s) in enumerate(zip(remote, base, src))],
            "netns": hosts is not None,
        }
        if hosts is not None:
            summary.update({
                "hosts": {h.name: {"netns": h.netns, "address": h.address, "interface": h.interface} for h in hosts},
                "transport": "UCX_TLS=tcp", "source_endpoint": source.info.get("source_endpoint"),
                "target_link_rx_bytes": rx_bytes,
            })
    finally:
        for eng in reversed(started):
            eng.stop()
        if registry_proc is not None:
            _stop(registry_proc)
    left = [e.worker_id for e in started if e.leftover()]
    for eng in started:
        if eng.leftover():
            eng.kill()
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    summary["leftover_processes"] = left
    ok = identical and blocks > 0 and not left
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        from remote_g2.cli import print_table

        print()
        print_table(["prompt", "blocks", "remote", "local", "computed", "load_ms", "ttft_recompute_ms",
                     "ttft_remote_ms", "identical"],
                    [[p["prompt"], p["blocks"], p["remote"], p["local"], p["computed"], round(p["load_s"] * 1e3, 1),
                      round(p["ttft_recompute_s"] * 1e3, 1), round(p["ttft_remote_s"] * 1e3, 1),
                      "yes" if p["identical"] else "NO"] for p in summary["per_prompt"]])
        print()
        print(f"reused remotely: {blocks} blocks, {bytes_read / 1e6:.2f} MB read at {summary['read_gbps']} GB/s "
              f"(TP {args.source_tp} → {args.target_tp})")
        print(f"time to first token: {summary['ttft_remote_s'] * 1e3:.1f} ms with remote reuse vs "
              f"{summary['ttft_recompute_s'] * 1e3:.1f} ms recomputing ({summary['ttft_speedup']}×)")
        print(f"(the target's first load from this source, which fetched its metadata and connected: "
              f"{summary['first_contact_load_s'] * 1e3:.1f} ms for {summary['first_contact_blocks']} blocks)")
        if hosts is not None:
            print(f"across hosts: registry {summary['hosts']['registry']['address']}, source "
                  f"{summary['hosts']['source']['address']} (serving on {summary['source_endpoint']}), target "
                  f"{summary['hosts']['target']['address']}; the target's link received {rx_bytes / 1e6:.2f} MB "
                  f"during the remote run (UCX over TCP)")
        print(f"every token and logit identical to the recompute run: {'yes' if identical else 'NO'}")
        gone = "every process it started has exited" if not left else f"had to kill leftover processes of {left}"
        print(f"demo {'OK' if ok else 'FAILED'} in {summary['wall_s']} s; {gone}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote_g2.adapters.reference.demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
