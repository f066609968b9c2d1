"""The reference engine end to end: real engines under ``mpiexec``, a real registry, real NIXL READs.

Every case starts a source engine (source hook on) and a target engine
(target hook on) as separate ``mpiexec`` jobs; the source serves a prompt,
the target serves it with every cache off (the recompute baseline) and with
remote reuse, and the test checks

* every generated token and every logit (float32 bits) is identical across
  the source's run, the target's recompute and the target's remote run;
* every reusable prompt block came from the remote source;
* every source rank's pins are back to zero, and the registry lists the
  source's blocks.

Plus: a source evicting blocks between the target's lookup and its load
(the target recomputes exactly those, output still identical), a target
with both hooks off (a plain engine: same bits as the in-process model), and
bad input on the engine's API (``ERR``, the engine keeps serving).
"""

from __future__ import annotations

import os
from pathlib import Path

import time

import pytest
import zmq
from conftest import engine_prompt, free_port
from remote_g2.adapters.reference import ModelConfig, ReferenceModel
from remote_g2.adapters.reference.launch import EngineProcess, mpiexec_path
from remote_g2.adapters.reference.messages import EngineStep
from remote_g2.registry import RegistryClient

from remote_g2.errors import RequestRejected
from remote_g2.identity.hashing import chain_block_hashes
from remote_g2.protocol.wire import decode_frame, encode_request

pytestmark = [pytest.mark.mpi, pytest.mark.nixl, pytest.mark.slow,
              pytest.mark.skipif(mpiexec_path() == "mpiexec", reason="mpiexec is not in the venv (pip install mpich)")]

TPB = 16


def _wait_registry_blocks(registry: str, worker_id: str, want: int) -> int:
    with RegistryClient(registry) as reg:
        return reg.wait_for_blocks(worker_id, want)


def _wait_pins_zero(engine: EngineProcess, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        pins = list(engine.client.stats().g2_pinned_per_rank)
        if not any(pins) or time.monotonic() > deadline:
            return pins
        time.sleep(0.05)


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    return a.tokens == b.tokens and a.logits == b.logits


def _engines(registry: str, source_tp: int, target_tp: int, mla: bool, *, via_env: bool = False,
             target_env: dict[str, str] | None = None) -> tuple[EngineProcess, EngineProcess]:
    """A source and a target engine; ``via_env`` enables the hooks by REMOTE_G2_* variables instead of flags."""
    model = ["--mla"] if mla else []
    if via_env:
        src_args, tgt_args = model, model
        src_env = {"REMOTE_G2_SOURCE": "1", "REMOTE_G2_REGISTRY": registry}
        tgt_env = {"REMOTE_G2_TARGET": "1", "REMOTE_G2_REGISTRY": registry}
    else:
        src_args, tgt_args = ["--source", "--registry", registry, *model], ["--target", "--registry", registry, *model]
        src_env = tgt_env = {}
    source = EngineProcess("src", tp=source_tp, args=src_args, env=src_env)
    try:
        target = EngineProcess("tgt", tp=target_tp, args=tgt_args, env={**tgt_env, **(target_env or {})})
    except BaseException:
        source.stop()
        raise
    return source, target


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize(("source_tp", "target_tp"), [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4)])
def test_remote_reuse_is_bit_identical_to_recompute(registry: str, source_tp: int, target_tp: int, mla: bool) -> None:
    prompt = engine_prompt(200, seed=source_tp * 10 + target_tp)
    reusable = (len(prompt) - 1) // TPB
    source, target = _engines(registry, source_tp, target_tp, mla, via_env=source_tp == target_tp == 1)
    try:
        src = source.client.generate("p", prompt, 4, cache="local")
        assert _wait_registry_blocks(registry, "src", len(prompt) // TPB) >= len(prompt) // TPB
        base = target.client.generate("base", prompt, 4, cache="none")
        remote = target.client.generate("remote", prompt, 4, cache="all")
        assert remote.ok and base.ok and src.ok, (remote.error, base.error, src.error)
        assert remote.remote_reason == "ok"
        assert (remote.blocks_remote, remote.blocks_remote_failed, remote.blocks_computed) == \
            (reusable, 0, len(prompt) // TPB - reusable)
        assert base.blocks_remote == base.blocks_g1 == base.blocks_g2 == 0
        assert len(remote.logits) == 4 * 1024 * 4
        assert _same(remote, base) and _same(base, src)
        assert _wait_pins_zero(source) == [0] * source_tp
        # The loaded blocks are now in the target's own G2 (it could serve them in turn).
        assert target.client.stats().g2_cached >= reusable
    finally:
        target.stop()
        source.stop()


def test_blocks_evicted_between_lookup_and_load_are_recomputed(registry: str) -> None:
    prompt = engine_prompt(200, seed=99)
    hashes = chain_block_hashes(prompt, TPB)
    reusable = (len(prompt) - 1) // TPB
    keep = 5
    source, target = _engines(registry, 2, 2, mla=False)
    try:
        src = source.client.generate("p", prompt, 4, cache="local")
        assert _wait_registry_blocks(registry, "src", len(hashes)) >= len(hashes)
        base = target.client.generate("base", prompt, 4, cache="none")
        # The target looks up (the registry promises every block), then holds the request for 8 s ...
        target.client.submit("remote", prompt, 4, cache="all", pause_after_lookup_ms=8_000)
        deadline = time.monotonic() + 15
        while "remote" not in target.client.paused():
            assert time.monotonic() < deadline, "the target never reached its lookup"
            time.sleep(0.02)
        # ... while the source evicts the tail of the prefix on every rank.
        assert source.client.evict(hashes[keep:]) == len(hashes) - keep
        remote = target.client.wait(["remote"], timeout_s=40)["remote"]
        assert remote.ok, remote.error
        assert remote.blocks_remote == keep
        assert remote.blocks_computed == len(hashes) - keep
        assert remote.blocks_remote + remote.blocks_computed == len(hashes) and reusable <= len(hashes)
        assert _same(remote, base) and _same(base, src)
        assert _wait_pins_zero(source) == [0, 0]
    finally:
        target.stop()
        source.stop()


def test_engine_with_hooks_off_is_a_plain_engine(registry: str) -> None:
    prompt = engine_prompt(120, seed=5)
    engine = EngineProcess("plain", tp=2)
    try:
        stats = engine.client.stats()
        assert not stats.source_enabled and not stats.target_enabled and stats.source_endpoint == ""
        first = engine.client.generate("a", prompt, 5, cache="all")
        again = engine.client.generate("b", prompt, 5, cache="all")
        stats = engine.client.stats()
    finally:
        engine.stop()
    assert first.remote_reason == "target_disabled" and first.blocks_remote == 0
    assert stats.remote_lookups == 0 and stats.blocks_remote == 0
    assert again.blocks_g1 == (len(prompt) - 1) // TPB  # its own prefix cache still works
    assert "NIXL" not in engine.log_tail(100_000)  # no agent was ever created
    assert not Path(engine._tmp).exists()  # its temporary directory went with it (the log's end is kept)
    plain = ReferenceModel(ModelConfig()).generate_greedy(prompt, 5)
    assert first.tokens == again.tokens == plain.tokens
    assert first.logits == again.logits == plain.logits.numpy().astype("<f4").tobytes()


def test_engine_api_answers_bad_input_with_err_and_keeps_serving() -> None:
    engine = EngineProcess("api", tp=1)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(engine.endpoint)
        # Garbage, an envelope without an id, and a real message this endpoint does not serve.
        for junk in (b"\xff\x00garbage", b"\x93\x80\xa4nope\x80", encode_request(7, EngineStep(1, []))):
            sock.send(junk)
            assert sock.poll(5000), f"no reply to {junk!r}"
            reply = decode_frame(sock.recv())
            assert reply.type == "ERR", reply
        with pytest.raises(RequestRejected, match="token ids"):
            engine.client.submit("bad-token", [1, 2, 5000], 2)
        with pytest.raises(RequestRejected, match="positions"):
            engine.client.submit("too-long", [1] * 4000, 200)
        engine.client.submit("dup", [1, 2, 3], 1)
        with pytest.raises(RequestRejected, match="already in use"):
            engine.client.submit("dup", [1, 2, 3], 1)
        ok = engine.client.generate("fine", [4, 5, 6, 7], 2)
        assert ok.ok and len(ok.tokens) == 2
    finally:
        sock.close()
        engine.stop()


@pytest.mark.registry_lease_ms(120_000)  # the registry keeps naming the dead source: the cooldown must decide
def test_source_killed_after_lookup_means_recompute_not_a_hang(registry: str) -> None:
    prompt, other = engine_prompt(200, seed=123), engine_prompt(200, seed=124)
    full = len(prompt) // TPB
    source, target = _engines(registry, 2, 2, mla=False)
    try:
        src = source.client.generate("p", prompt, 4, cache="local")
        src_other = source.client.generate("o", other, 4, cache="local")
        assert _wait_registry_blocks(registry, "src", 2 * full) >= 2 * full
        target.client.submit("remote", prompt, 4, cache="all", pause_after_lookup_ms=1500)
        deadline = time.monotonic() + 15
        while "remote" not in target.client.paused():
            assert time.monotonic() < deadline, "the target never reached its lookup"
            time.sleep(0.02)
        source.kill()  # SIGKILL to mpiexec and both source ranks, while the target holds the registry's answer
        t0 = time.monotonic()
        remote = target.client.wait(["remote"], timeout_s=30)["remote"]
        waited = time.monotonic() - t0
        assert remote.ok, remote.error
        assert remote.blocks_remote == 0 and remote.blocks_remote_failed == (len(prompt) - 1) // TPB
        assert remote.blocks_computed == full
        assert _same(remote, src)
        assert waited < 15, f"the failed load took {waited:.1f} s to be noticed"
        # The engine is unharmed: the next request (now served from its own G1) is right too.
        again = target.client.generate("again", prompt, 4, cache="all")
        assert _same(again, src) and again.blocks_g1 == (len(prompt) - 1) // TPB
        # Blocks only the dead source holds: the registry still names it, but its load just failed, so the
        # engine recomputes at once instead of waiting out another timeout against it.
        t0 = time.monotonic()
        cooled = target.client.generate("other", other, 4, cache="all")
        assert cooled.remote_reason == "source_cooling_down" and cooled.blocks_remote_failed == 0
        assert _same(cooled, src_other)
        assert time.monotonic() - t0 < 10, "the cooled-down source was tried anyway"
    finally:
        target.stop()
        source.stop()


def test_demo_command_reports_remote_reuse_and_identical_outputs_as_json() -> None:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "remote_g2.cli", "demo", "--json", "--source-tp", "2", "--target-tp", "1",
           "--prompts", "2", "--prefix-tokens", "256", "--suffix-tokens", "32", "--new-tokens", "3"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert (out["source_tp"], out["target_tp"]) == (2, 1)
    assert out["outputs_identical"] is True and out["leftover_processes"] == []
    # Prompt 0 reads its whole reusable prefix remotely; prompt 1 has the shared part locally by then
    # and reads only its own reusable tail.
    reusable, shared = (256 + 32 - 1) // TPB, 256 // TPB
    assert [p["remote"] for p in out["per_prompt"]] == [reusable, reusable - shared]
    assert [p["local"] for p in out["per_prompt"]] == [0, shared]
    assert out["blocks_reused_remote"] == 2 * reusable - shared
    assert out["bytes_read"] > 0 and out["read_gbps"] > 0
    assert 0 < out["ttft_remote_s"] and 0 < out["ttft_recompute_s"]
    assert out["registry_blocks_of_source"] >= (256 + 32) // TPB
    assert took < 60, f"the demo took {took:.0f} s"


def test_concurrent_requests_interleave_loads_prefills_and_decodes(registry: str) -> None:
    shared = engine_prompt(160, seed=7)
    prompts = [shared + engine_prompt(40, seed=100 + i) for i in range(3)]
    port = free_port()
    source, target = _engines(registry, 2, 2, mla=False, target_env={"REMOTE_G2_TARGET_METRICS_PORT": str(port)})
    try:
        src = [source.client.generate(f"p{i}", p, 6, cache="local") for i, p in enumerate(prompts)]
        want = len({h for p in prompts for h in chain_block_hashes(p, TPB)})
        assert _wait_registry_blocks(registry, "src", want) >= want
        # All at once: remote loads, a recompute and decodes share the engine's steps.
        for i, p in enumerate(prompts):
            target.client.submit(f"remote-{i}", p, 6, cache="all")
        target.client.submit("recompute-0", prompts[0], 6, cache="none")
        got = target.client.wait([f"remote-{i}" for i in range(3)] + ["recompute-0"], timeout_s=60)
        for i in range(3):
            r = got[f"remote-{i}"]
            assert r.ok and _same(r, src[i]), i
            assert r.blocks_remote + r.blocks_g1 + r.blocks_g2 == (len(prompts[i]) - 1) // TPB
        assert _same(got["recompute-0"], src[0]) and got["recompute-0"].blocks_remote == 0
        assert sum(got[f"remote-{i}"].blocks_remote for i in range(3)) >= (len(prompts[0]) - 1) // TPB
        assert _wait_pins_zero(source) == [0, 0]
        assert target.client.stats().running == 0
        # The target's leader exports what happened, for dashboards.
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        loaded = sum(got[f"remote-{i}"].blocks_remote for i in range(3))
        loads = float(sum(1 for i in range(3) if got[f"remote-{i}"].blocks_remote))
        assert f'remote_g2_target_loads_total{{outcome="done"}} {loads}' in text
        assert f"remote_g2_target_blocks_loaded_total {float(loaded)}" in text
        assert 'remote_g2_target_lookups_total{reason="ok"}' in text
    finally:
        target.stop()
        source.stop()


def test_stale_mpich_segments_are_swept_but_mapped_or_fresh_ones_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A SIGKILLed rank leaves its MPICH segments in /dev/shm (RAM): swept once nobody maps them."""
    import mmap

    from remote_g2.adapters.reference.launch import sweep_stale_mpi_shm

    old = time.time() - 3600
    for name in ("mpich_shm_dead", "mpich_shm_mapped", "mpich_shm_fresh", "other_dead"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
        if name != "mpich_shm_fresh":
            os.utime(tmp_path / name, (old, old))
    with open(tmp_path / "mpich_shm_mapped", "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert sweep_stale_mpi_shm(60, directory=str(tmp_path)) == ["mpich_shm_dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_fresh", "mpich_shm_mapped", "other_dead"]
