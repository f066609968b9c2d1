"""The target client in real processes: a ``mpiexec -n S`` source, a ``mpiexec -n T`` target, real NIXL READs.

A registry (memory store, in this process) tracks the synthetic source
(``tests/source_procs/source_rank.py``: 2 kv heads per source rank, hashes
``hash_of(0..31)``). The target ranks (``tests/source_procs/target_rank.py``)
look up, load into destination blocks 5.. with their own NIXL agents, and
check every byte of every destination block against the source ranks'
patterns mapped through the TP head slices; blocks outside the load must stay
untouched. Afterwards the source's pin counts are back to zero.

The MLA tests run the source with ``--mla`` (one latent kv head per rank, the
same bytes on every rank) and the target with ``--mla``; each target rank
reads whole blocks from one source rank while the lease pins every source
rank and is released once. Failure paths are in ``test_target_failures.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from source_procs.harness import MPIEXEC, SourceWorker, have_mpiexec
from source_procs.pattern import make_layout

from remote_g2.tp.head_slices import source_ranks_for


pytestmark = [
    pytest.mark.mpi,
    pytest.mark.nixl,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not in the venv (pip install mpich)"),
]

TARGET_SCRIPT = Path(__file__).resolve().parent / "source_procs" / "target_rank.py"


def _source(tmp_path: Path, registry: str, source_tp: int, name: str, extra: list[str] | None = None
            ) -> SourceWorker:
    worker = SourceWorker(tmp_path / f"src-{name}", f"src-{name}-{os.getpid()}", np=source_tp,
                          args=["--registry", registry, *(extra or [])])
    try:
        worker.wait_registered(registry, 32)
    except BaseException:
        worker.stop()
        raise
    return worker


@contextmanager
def _source_released_every_pin(tmp_path: Path, registry: str, source_tp: int, name: str,
                               extra: list[str] | None = None) -> Iterator[SourceWorker]:
    """A source for the ``with`` block's loads; after them, every rank's pins must be back to zero, to its stop."""
    source = _source(tmp_path, registry, source_tp, name, extra)
    try:
        yield source
        for r in range(source_tp):
            source.wait_pins(r, 0)
    finally:
        report = source.stop()
    assert all(d["total_pins"] == 0 for d in report["done"].values()), report


def _run_target(tmp_path: Path, registry: str, *, tp: int, source_tp: int, hashes: int = 16,
                timeout_ms: int = 5000, wait_s: float = 30.0, extra: list[str] | None = None
                ) -> tuple[dict, list[dict]]:
    d = tmp_path / f"tgt-{tp}"
    d.mkdir()
    ipc = tempfile.mkdtemp(prefix="rg2t-")  # pytest's tmp paths are too long for a unix socket path
    cmd = [str(MPIEXEC), "-n", str(tp), sys.executable, str(TARGET_SCRIPT), "--dir", str(d), "--registry", registry,
           "--hashes", str(hashes), "--source-tp", str(source_tp), "--total-heads", str(2 * source_tp),
           "--timeout-ms", str(timeout_ms), "--wait-s", str(wait_s), "--ipc-dir", ipc, *(extra or [])]
    env = {**os.environ, "UCX_LOG_LEVEL": "fatal"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=wait_s + 60, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    # NIXL has been seen to crash at interpreter exit; results are written before that.
    assert (d / "leader.json").exists(), log
    leader = json.loads((d / "leader.json").read_text())
    assert "error" not in leader, leader["error"]
    verify = []
    for r in range(tp):
        path = d / f"verify-{r}.json"
        assert path.exists(), f"rank {r} wrote no verification\n{log}"
        verify.append(json.loads(path.read_text()))
    return leader, verify


def _assert_landed(verify: list[dict], *, untouched_clean: bool = False) -> None:
    """Every target rank found all 16 destination blocks byte-exact (and, asked, wrote no other block)."""
    for r, v in enumerate(verify):
        assert v["checked"] == 16 and v["mismatches"] == [], (r, v)
        if untouched_clean:
            assert v["untouched_written"] == [], (r, v)


def _reads_rank0_past_the_leader(source_tp: int, target_tp: int, mla: bool) -> bool:
    """Whether a target rank > 0 reads source rank 0, the one rank that may have no peer endpoint."""
    # The leader's MLA offset is crc32(worker id) % source_tp: any rank may be rank 0's peer; assume so.
    return any(0 in source_ranks_for(r, source_tp=source_tp, target_tp=target_tp, is_mla=False)
               for r in range(1, target_tp)) or (mla and target_tp > 1)


PEER_CASES = [(2, 2, True, "stream", False, False), (2, 2, True, "zmq", False, False),
              (2, 2, False, "stream", False, False), (1, 2, True, "stream", True, False),
              (2, 4, True, "stream", True, False), (2, 4, True, "stream", False, False),
              (2, 4, True, "zmq", False, False), (2, 1, True, "stream", True, False),
              (2, 1, True, "zmq", True, False), (2, 2, True, "stream", False, True), (2, 1, True, "stream", True, True)]


@pytest.mark.parametrize(("source_tp", "target_tp", "peer", "transport", "gather", "mla"), PEER_CASES,
                         ids=[f"{'mla-' if c[5] else ''}{c[0]}to{c[1]}-{c[3]}{'' if c[2] else '-off'}"
                              f"{'-gather' if c[4] else ''}" for c in PEER_CASES])
def test_a_second_load_resolves_each_share_with_the_source_ranks_it_reads(
        tmp_path: Path, registry: str, source_tp: int, target_tp: int, peer: bool, transport: str,
        gather: bool, mla: bool) -> None:
    """The first load from a source goes through rank 0's resolve (it brings every rank the metadata); the
    next one has each target rank ask the source ranks it reads for its own share (peer_resolve), over the
    source's stream lanes (rank 0's included) or, with ``zmq``, ZMQ — where source rank 0 has no lane of
    its own, so a target rank > 0 that reads it cannot ask it and the load goes through rank 0's resolve.
    With ``gather``, every source rank stages what each target rank reads (only the asking rank's part on
    a peer share)."""
    rule = ["--gather-min-descriptors", "1", "--gather-max-piece-kib", "1024"] if gather else []
    mla_args = ["--mla"] if mla else []
    with _source_released_every_pin(tmp_path, registry, source_tp,
                                    f"peer{source_tp}to{target_tp}{peer}{transport}{gather}{mla}",
                                    ["--peer-transport", transport, *rule, *mla_args]) as source:
        lanes = [source.state(r)["service"]["peer_endpoint"] for r in range(source_tp)]
        if transport == "stream":
            assert all(e.startswith("tcp+stream://") for e in lanes), lanes
        else:
            assert lanes[0] is None and all(e.startswith("tcp://") for e in lanes[1:]), lanes
        leader, verify = _run_target(tmp_path, registry, tp=target_tp, source_tp=source_tp,
                                     extra=["--warm-load", "--peer-resolve", str(int(peer)), "--gather",
                                            str(int(gather)), *mla_args])
        assert leader["warm"] == {"done": ["req-warm"], "failed": [], "peer_loads": 0}
        assert leader["done"] == ["req-1"] and leader["failed"] == [] and leader["invalid"] == [], leader["log"]
        expect_peer = peer and (transport == "stream" or not _reads_rank0_past_the_leader(source_tp, target_tp, mla))
        assert leader["stats"]["peer_loads"] == (1 if expect_peer else 0), leader["stats"]
        assert leader["stats"]["done"] == 2, leader["stats"]
        _assert_landed(verify, untouched_clean=True)
        # Every rank learned how its own share of each load ended, by the engine's request id.
        assert all(v["shares_done"] == ["req-1", "req-warm"] and v["shares_failed"] == [] for v in verify), verify
        gathers = [source.state(r)["service"]["gathers"] for r in range(source_tp)]
        # Per load, one part per (source rank, target rank reading it) — a peer share stages the asking rank's
        # part alone, so the count is the same either way — save MLA's classic resolve, where target ranks
        # reading one source rank share its one part.
        parts = 2 * max(source_tp, target_tp) if not mla else target_tp + (target_tp if expect_peer else 1)
        assert sum(g["staged"] for g in gathers) == (parts if gather else 0), gathers
        for r in range(source_tp):  # staging went with the leases
            source.wait_state(r, lambda s: s["service"]["staging_in_use"] == 0, what="staging freed")


@pytest.mark.parametrize("transport", ["stream", "zmq"])
def test_loads_that_outlive_their_lease_ttl_renew_every_share_and_land(tmp_path: Path, registry: str,
                                                                        transport: str) -> None:
    """READs held back for 2.5x the lease TTL: the classic load's lease is renewed on every source rank by
    the leader; the peer load's shares each by the target rank that pinned it (only it may) — none expires."""
    with _source_released_every_pin(tmp_path, registry, 2, f"renew-{transport}",
                                    ["--peer-transport", transport]) as source:
        leader, verify = _run_target(tmp_path, registry, tp=2, source_tp=2,
                                     extra=["--warm-load", "--lease-ttl-ms", "600", "--late-read-s", "1.5"])
        assert leader["warm"] == {"done": ["req-warm"], "failed": [], "peer_loads": 0}, leader["log"]
        assert leader["done"] == ["req-1"] and leader["failed"] == [], leader["log"]
        assert leader["stats"]["peer_loads"] == 1, leader["stats"]
        _assert_landed(verify, untouched_clean=True)
        for r in range(2):
            source.wait_pins(r, 0)
            stats = source.wait_state(r, lambda s: True)["service"]
            assert stats["leases_expired"] == 0 and stats["leases_released"] >= 1, (r, stats)


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "in-place"])
@pytest.mark.parametrize(("source_tp", "target_tp"), [(2, 2), (1, 2), (2, 1), (2, 4)])
def test_load_is_byte_exact_on_every_rank_and_pins_return_to_zero(tmp_path: Path, registry: str,
                                                                  source_tp: int, target_tp: int, gather: bool) -> None:
    # Same TP: 16 consecutive source blocks are one 16 KiB descriptor, read in place by the default rule;
    # with any count and size let through, the source stages every pairing's bytes, so they all go
    # through a staged run once.
    with _source_released_every_pin(tmp_path, registry, source_tp, f"{source_tp}to{target_tp}",
                                    ["--gather-min-descriptors", "1", "--gather-max-piece-kib", "1024"]) as source:
        leader, verify = _run_target(tmp_path, registry, tp=target_tp, source_tp=source_tp,
                                     extra=["--gather", str(int(gather))])
        assert leader["match"] == {"matched": 16, "reason": "ok", "worker_id": source.worker_id}
        assert leader["done"] == ["req-1"] and leader["failed"] == [] and leader["invalid"] == []
        # remote_g2_target_load_phase_seconds: each step of the one load, once, inside its total time
        phases = leader["phases"]
        assert [phases[p][0] for p in ("to_resolve", "resolve", "reads")] == [1, 1, 1], phases
        assert 0 < sum(s for _, s in phases.values()) <= leader["seconds"], phases
        # finished_fd: readable exactly while an outcome waits for get_finished (the leader slept on it)
        assert leader["fd_ready_before_outcome"] is True and leader["fd_ready_after_outcome"] is False, leader
        _assert_landed(verify, untouched_clean=True)
        staged = [source.state(r)["service"]["gathers"]["staged"] for r in range(source_tp)]
        assert (sum(staged) > 0) == gather, staged
        # At TP 2 -> 1 each source block lands as one small piece per slab: read into the bounce region
        # in one run (staged or in place) and scattered there (target/bounce.py); nowhere else.
        assert [v["bounced_reads"] > 0 for v in verify] == [source_tp > target_tp] * target_tp, verify
        for r in range(source_tp):  # staging went with the lease
            source.wait_state(r, lambda s: s["service"]["staging_in_use"] == 0, what="staging freed")


def test_a_lookup_answered_by_the_registry_mirror_loads_the_same_bytes(tmp_path: Path, registry: str) -> None:
    source = _source(tmp_path, registry, 2, "mirror")
    try:
        leader, verify = _run_target(tmp_path, registry, tp=2, source_tp=2, extra=["--registry-mirror"])
        assert leader["match"] == {"matched": 16, "reason": "ok", "worker_id": source.worker_id}
        assert leader["stats"]["mirror_lookups"] == 1  # no round trip to the server
        assert leader["done"] == ["req-1"] and leader["invalid"] == []
        _assert_landed(verify)
        for r in range(2):
            source.wait_pins(r, 0)
    finally:
        source.stop()


@pytest.mark.parametrize("target_tp", [1, 2])
def test_the_leader_serves_other_loads_while_its_own_read_runs(tmp_path: Path, registry: str,
                                                                target_tp: int) -> None:
    # Every READ post takes 2 s (test-only adapter: a stand-in for a copy that long). Once rank 0's
    # post has begun, a second load of hashes nobody holds must fail after one registry lookup — the
    # coordinator keeps going while rank 0's share thread is inside its post — and the first load
    # still lands whole.
    source = _source(tmp_path, registry, 2, f"busy{target_tp}")
    try:
        leader, verify = _run_target(tmp_path, registry, tp=target_tp, source_tp=2,
                                     extra=["--delay-read-s", "2.0", "--second-miss"])
        assert leader["req1_open_at_miss"] is True, leader
        assert leader["miss_failed_after_s"] - leader["miss_started_after_s"] < 1.0, leader  # not after the post
        assert leader["done"] == ["req-1"] and leader["failed"] == [] and leader["invalid"] == []
        assert leader["seconds"] >= 2.0
        _assert_landed(verify)
        for r in range(2):
            source.wait_pins(r, 0)
    finally:
        source.stop()


@pytest.mark.parametrize(("source_tp", "target_tp"), [(2, 1), (2, 2)])
def test_mla_load_reads_replicated_blocks_pins_every_source_rank_and_releases_once(
        tmp_path: Path, registry: str, source_tp: int, target_tp: int) -> None:
    source = _source(tmp_path, registry, source_tp, f"mla{source_tp}to{target_tp}", extra=["--mla"])
    try:
        # The READs wait 1.5 s before they are posted (test-only adapter): time to see every source rank pinned.
        d = tmp_path / f"tgt-{target_tp}"
        pinned: dict[int, int] = {}

        def watch() -> None:
            deadline = time.monotonic() + 40
            while not (d / "reading-0").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            for r in range(source_tp):
                try:
                    pinned[r] = source.wait_pins(r, 16, timeout_s=3.0)["total_pins"]
                except AssertionError:
                    pinned[r] = -1

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        leader, verify = _run_target(tmp_path, registry, tp=target_tp, source_tp=source_tp,
                                     extra=["--mla", "--delay-read-s", "1.5"])
        watcher.join(10)
        assert leader["match"] == {"matched": 16, "reason": "ok", "worker_id": source.worker_id}
        assert leader["done"] == ["req-1"] and leader["failed"] == [] and leader["invalid"] == []
        assert leader["stats"]["bytes"] == 16 * make_layout(num_kv_heads=1).block_bytes * target_tp  # whole blocks
        _assert_landed(verify, untouched_clean=True)
        # every source rank held the lease's 16 pins while the READs were open ...
        assert pinned == {r: 16 for r in range(source_tp)}, pinned
        # ... and every rank dropped them on the one release (not by expiry: the lease TTL is 10 s)
        states = [source.wait_pins(r, 0) for r in range(source_tp)]
        assert states[0]["service"]["leases_released"] == 1, states[0]
        assert all(st["service"]["leases_expired"] == 0 and st["service"]["leases_open"] == 0 for st in states), \
            states
    finally:
        report = source.stop()
    assert all(d["total_pins"] == 0 for d in report["done"].values()), report
