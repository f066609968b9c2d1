"""Faults with whole reference engines: processes killed with SIGKILL at the worst moment, a source restarted.

Real engines under ``mpiexec``, a real registry, real NIXL. The window
between a target's resolve and its READ is opened by
``fault_procs/slow_transfer.py`` (the real NIXL adapter with a sleep before
each READ is posted — a stand-in for a slow fabric; loopback READs finish in
microseconds, too fast to kill anything in between).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import engine_prompt
from remote_g2.adapters.reference.launch import EngineProcess, mpiexec_path
from remote_g2.registry import RegistryClient

from remote_g2.identity.hashing import chain_block_hashes

pytestmark = [pytest.mark.mpi, pytest.mark.nixl, pytest.mark.slow, pytest.mark.registry_lease_ms(3000),
              pytest.mark.skipif(mpiexec_path() == "mpiexec", reason="mpiexec is not in the venv (pip install mpich)")]

TPB = 16
TESTS = str(Path(__file__).resolve().parent)
SLOW = "fault_procs.slow_transfer:SlowNixlTransfer"


def _wait(cond, timeout_s: float, what: str, step: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step)


def _published(registry: str, worker: str, n: int) -> None:
    with RegistryClient(registry) as reg:
        assert reg.wait_for_blocks(worker, n, timeout_s=15) >= n, f"{worker}'s blocks never reached the registry"


def _slow_target(registry: str, tmp_path: Path, delay_s: float, *, lease_ms: int = 10_000,
                 timeout_ms: int = 5000) -> tuple[EngineProcess, Path]:
    marker = tmp_path / "reading"
    target = EngineProcess("tgt", tp=2, args=["--target", "--registry", registry, "--transfer", SLOW,
                                              "--target-timeout-ms", str(timeout_ms)],
                           env={"PYTHONPATH": TESTS, "REMOTE_G2_TEST_READING_FILE": str(marker),
                                "REMOTE_G2_TEST_READ_DELAY_S": str(delay_s),
                                "REMOTE_G2_TARGET_LEASE_TTL_MS": str(lease_ms)})
    return target, marker


def test_target_killed_after_resolve_leaves_no_pins_on_any_source_rank(registry: str, tmp_path: Path) -> None:
    prompt = engine_prompt(200, 1)
    source = EngineProcess("src", tp=2, args=["--source", "--registry", registry])
    target = None
    try:
        source.client.generate("p", prompt, 2, cache="local")
        _published(registry, "src", len(prompt) // TPB)
        target, marker = _slow_target(registry, tmp_path, delay_s=60, lease_ms=2000)
        target.client.submit("r", prompt, 2, cache="all")
        _wait(marker.exists, 30, "the target's READ to be about to start (lease resolved)")
        pins = source.client.stats().g2_pinned_per_rank
        assert all(p == (len(prompt) - 1) // TPB for p in pins), pins  # pinned on every source rank
        target.kill()  # SIGKILL: no release will ever come
        t0 = time.monotonic()
        _wait(lambda: source.client.stats().g2_pinned_per_rank == [0, 0], 15, "the pins to drop")
        took = time.monotonic() - t0
        assert took < 2.0 + 3.0, f"pins outlived the 2 s lease by {took - 2.0:.1f} s"
        # The source is unharmed: it serves the same blocks to the next reader.
        assert source.client.stats().g2_cached >= len(prompt) // TPB
    finally:
        if target is not None:
            target.stop()
        source.stop()


def test_source_killed_mid_load_target_recomputes_identically_and_registry_forgets_it(registry: str,
                                                                                      tmp_path: Path) -> None:
    prompt = engine_prompt(200, 2)
    hashes = chain_block_hashes(prompt, TPB)
    source = EngineProcess("src", tp=2, args=["--source", "--registry", registry])
    target = None
    try:
        src = source.client.generate("p", prompt, 4, cache="local")
        _published(registry, "src", len(hashes))
        target, marker = _slow_target(registry, tmp_path, delay_s=1.5, timeout_ms=5000)
        t0 = time.monotonic()
        target.client.submit("r", prompt, 4, cache="all")
        _wait(marker.exists, 30, "the lease to be resolved")
        source.kill()  # both source ranks and mpiexec, SIGKILL, with our lease open and our READ about to go
        result = target.client.wait(["r"], timeout_s=30)["r"]
        took = time.monotonic() - t0
        assert result.ok and result.blocks_remote == 0
        assert result.blocks_remote_failed == (len(prompt) - 1) // TPB and result.blocks_computed == len(hashes)
        assert result.remote_error and result.remote_reason == "ok"  # matched, then failed: it says why
        assert (result.tokens, result.logits) == (src.tokens, src.logits)  # recomputed, bit for bit
        assert took < 5.0 + 10.0, f"the failed load took {took:.1f} s"
        with RegistryClient(registry) as reg:  # the dead worker's 3 s lease lapses; then nobody is offered it
            _wait(lambda: reg.lookup(hashes, requester="tgt").reason == "no_candidate", 10,
                  "the registry to stop returning the dead source")
    finally:
        if target is not None:
            target.stop()
        source.stop()


def test_source_restarted_with_the_same_id_replaces_its_old_epoch(registry: str) -> None:
    old_prompt, new_prompt = engine_prompt(200, 3), engine_prompt(200, 4)
    reusable = (200 - 1) // TPB
    target = EngineProcess("tgt", tp=2, args=["--target", "--registry", registry])
    source = EngineProcess("src", tp=2, args=["--source", "--registry", registry])
    try:
        source.client.generate("p", old_prompt, 3, cache="local")
        _published(registry, "src", 200 // TPB)
        first = target.client.generate("old-1", old_prompt, 3, cache="all")
        assert first.blocks_remote == reusable  # the target now holds the old epoch's NIXL metadata
        source.kill()
        source = EngineProcess("src", tp=2, args=["--source", "--registry", registry])  # same id, new epoch
        src_new = source.client.generate("p", new_prompt, 3, cache="local")
        _published(registry, "src", 200 // TPB)
        with RegistryClient(registry) as reg:
            assert reg.lookup(chain_block_hashes(old_prompt, TPB), requester="x").reason == "no_candidate"
        base = target.client.generate("new-base", new_prompt, 3, cache="none")
        new = target.client.generate("new", new_prompt, 3, cache="all")
        # Read from the new epoch's memory (metadata reloaded), never the old agent's: identical bits.
        assert new.ok and new.blocks_remote == reusable
        assert (new.tokens, new.logits) == (base.tokens, base.logits) == (src_new.tokens, src_new.logits)
    finally:
        source.stop()
        target.stop()


@pytest.mark.parametrize("transport", ["stream", "zmq"])
def test_a_source_restarted_on_its_fixed_port_is_resolved_again_and_read(registry: str, transport: str) -> None:
    # The target knows the source's old epoch and reads with peer resolve. The source restarts behind the
    # same worker endpoint (a fixed port), with new peer endpoints. The next load finds the old peers gone
    # (stream: the lanes refuse at once; zmq: rank 0 answers with the new epoch, rank 1's old port times
    # out) and is resolved again through rank 0: read remotely from the new epoch, not recomputed.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"REMOTE_G2_SOURCE_BIND": f"tcp://127.0.0.1:{port}", "REMOTE_G2_SOURCE_PEER_TRANSPORT": transport}
    warm, peer, after = (engine_prompt(200, k) for k in (5, 6, 7))
    reusable = (200 - 1) // TPB
    target = EngineProcess("tgt", tp=2, args=["--target", "--registry", registry])
    source = EngineProcess("src", tp=2, args=["--source", "--registry", registry], env=env)
    try:
        assert source.endpoint and source.client.generate("w", warm, 3, cache="local").ok
        assert source.client.generate("p", peer, 3, cache="local").ok
        _published(registry, "src", 2 * (200 // TPB))
        assert target.client.generate("t-warm", warm, 3, cache="all").blocks_remote == reusable  # metadata
        assert target.client.generate("t-peer", peer, 3, cache="all").blocks_remote == reusable  # peer resolve
        source.kill()
        source = EngineProcess("src", tp=2, args=["--source", "--registry", registry], env=env)
        src_after = source.client.generate("a", after, 3, cache="local")
        with RegistryClient(registry) as reg:  # the new epoch's blocks, not the old record's count
            _wait(lambda: reg.lookup(chain_block_hashes(after, TPB), requester="x").matched >= reusable, 15,
                  "the restarted source's blocks in the registry")
        base = target.client.generate("t-base", after, 3, cache="none")
        t0 = time.monotonic()
        got = target.client.generate("t-after", after, 3, cache="all")
        took = time.monotonic() - t0
        assert got.ok and got.blocks_remote == reusable, got
        assert (got.tokens, got.logits) == (base.tokens, base.logits) == (src_after.tokens, src_after.logits)
        assert took < 2.0 + 10.0, f"the load after the restart took {took:.1f} s"  # at most one RPC timeout more
    finally:
        source.stop()
        target.stop()
