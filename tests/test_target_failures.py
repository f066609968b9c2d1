"""The target client's failure paths in real processes: mpiexec sources and targets, real NIXL.

Every test starts a target (``tests/source_procs/target_rank.py`` under
``mpiexec``) against a synthetic source (``source_rank.py``), breaks something
on the way, and checks what the engine would see: the request is in
``failed`` (never ``done``), every destination block it asked for is in
``invalid_block_ids``, the failure arrives within the configured timeouts
plus a small margin (measured by the leader from ``start_load``), no target
rank wrote a byte outside the destination blocks, and — where the source is
still alive — every source rank's pin count returns to zero.

Faults:

* the source answers ERR on resolve (a sibling rank's ``find_and_pin`` is made
  slower than its sibling timeout);
* the source does not answer resolve (its rank 0 is SIGSTOPped);
* the source dies between resolve and READ (the target's READs are delayed by
  the test-only ``--delay-read-s`` adapter; the source is killed in the gap);
* the lease expires on the source mid-load (the target leader is SIGSTOPped
  for longer than the lease TTL while its READ is delayed);
* nothing to load: hashes nobody holds, and a TP pairing the layout cannot
  serve (target TP=3 against 4 kv heads);
* a gathered part half staged (the source's gather thread stalled by the
  test-only ``stall-gather`` file of ``source_rank.py``): its lease expires
  (the leader SIGSTOPped past the TTL), or the source is killed.

One source (TP=2) and one registry serve every test but the one that kills
its source, which gets its own of both (a killed source stays "live" in its
registry until the liveness TTL lapses, and later lookups could pick it). The
registry's liveness TTL is long (60 s) so a frozen source stays a candidate.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench.common import kill_group
from source_procs.harness import MPIEXEC, SourceWorker, have_mpiexec

from remote_g2.registry import MemoryStore, RegistryServer

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.nixl,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not in the venv (pip install mpich)"),
]

REPO = Path(__file__).resolve().parents[1]
TARGET_SCRIPT = REPO / "tests" / "source_procs" / "target_rank.py"
MARGIN_S = 3.0  # on top of the configured timeouts: process scheduling on a busy 2-core box
HASHES = 8


@contextlib.contextmanager
def _registry() -> Iterator[str]:
    server = RegistryServer(MemoryStore(lease_ttl_ms=60_000), bind="tcp://127.0.0.1:0")
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    with _registry() as endpoint:
        yield endpoint


def _start_source(directory: Path, registry: str, name: str, args: list[str] | None = None) -> SourceWorker:
    """A TP-2 source registered with all 32 blocks; ``args``: its settings (default: short sibling timeouts)."""
    worker = SourceWorker(directory, f"{name}-{os.getpid()}", np=2,
                          args=["--registry", registry,
                                *(args if args is not None else ["--sibling-timeout-ms", "500",
                                                                 "--sibling-retry-after-ms", "300"])])
    try:
        worker.wait_registered(registry, 32)
    except BaseException:
        worker.kill()
        raise
    return worker


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, registry: str) -> Iterator[SourceWorker]:
    worker = _start_source(tmp_path_factory.mktemp("src-shared"), registry, "fail-src")
    try:
        yield worker
    finally:
        worker.set_pin_delay(1, 0)
        report = worker.stop()
        assert all(d["total_pins"] == 0 for d in report["done"].values()), report


class Target:
    """One ``mpiexec -n tp target_rank.py`` run, started in its own session; stopped by its process group."""

    def __init__(self, tmp_path: Path, registry: str, name: str, *, tp: int, timeout_ms: int = 3000,
                 rpc_timeout_ms: int = 1000, extra: list[str] | None = None, wait_s: float = 20.0) -> None:
        self.dir = tmp_path / f"tgt-{name}"
        self.dir.mkdir()
        self.tp, self.wait_s = tp, wait_s
        self.timeout_s, self.rpc_timeout_s = timeout_ms / 1000.0, rpc_timeout_ms / 1000.0
        self.ipc = tempfile.mkdtemp(prefix="rg2t-")  # pytest's tmp paths are too long for a unix socket path
        cmd = [str(MPIEXEC), "-n", str(tp), sys.executable, str(TARGET_SCRIPT), "--dir", str(self.dir),
               "--registry", registry, "--hashes", str(HASHES), "--source-tp", "2", "--total-heads", "4",
               "--timeout-ms", str(timeout_ms), "--rpc-timeout-ms", str(rpc_timeout_ms),
               "--wait-s", str(wait_s), "--ipc-dir", self.ipc, *(extra or [])]
        self._log = open(self.dir / "mpiexec.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=REPO, env={**os.environ, "UCX_LOG_LEVEL": "fatal"})

    def log(self) -> str:
        return (self.dir / "mpiexec.log").read_text(errors="replace")[-5000:]

    def wait_file(self, name: str, timeout_s: float = 40.0) -> Path:
        path = self.dir / name
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"target never wrote {name} (rc={self.proc.poll()})\n{self.log()}")
            time.sleep(0.005)
        return path

    def pid(self, rank: int) -> int:
        return int(self.wait_file(f"pid-{rank}").read_text())

    def result(self) -> tuple[dict, list[dict]]:
        """Wait for the run to end; the leader's outcome and each rank's verification."""
        try:
            self.proc.wait(self.wait_s + 60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the target did not finish\n{self.log()}") from None
        # NIXL has been seen to crash at interpreter exit; the results are written before that.
        assert (self.dir / "leader.json").exists(), self.log()
        leader = json.loads((self.dir / "leader.json").read_text())
        assert "error" not in leader, leader["error"]
        verify = []
        for r in range(self.tp):
            path = self.dir / f"verify-{r}.json"
            assert path.exists(), f"rank {r} wrote no verification\n{self.log()}"
            verify.append(json.loads(path.read_text()))
        return leader, verify

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)
        self._log.close()


@pytest.fixture
def targets() -> Iterator[list[Target]]:
    started: list[Target] = []
    try:
        yield started
    finally:
        for t in started:
            t.kill()


def run_target(targets: list[Target], *args, **kw) -> Target:
    t = Target(*args, **kw)
    targets.append(t)
    return t


def assert_failed(leader: dict, verify: list[dict], *, within_s: float, done_before: int = 0) -> str:
    """The request failed the way the engine must see it; returns the failure log of every rank.

    ``done_before``: loads the run finished before ``req-1`` (``--warm-load``: 1).
    """
    dst = leader["dst"]
    assert dst, leader
    assert leader["done"] == [] and leader["failed"] == ["req-1"], leader
    assert leader["invalid"] == sorted(dst), leader
    assert leader["seconds"] < within_s, (leader["seconds"], within_s, leader)
    assert leader["stats"]["failed"] == 1 and leader["stats"]["done"] == done_before, leader
    for r, v in enumerate(verify):
        assert v["untouched_written"] == [], (r, v)
    return "\n".join([*leader["log"], *(line for v in verify for line in v["log"])])


def _fresh_stats(source: SourceWorker, rank: int) -> dict:
    return source.wait_state(rank, lambda s: True)["service"]


# -- a. the source answers ERR --------------------------------------------------------------------


def test_resolve_answered_with_err_fails_the_request(tmp_path: Path, registry: str, source: SourceWorker,
                                                     targets: list[Target]) -> None:
    # Source rank 1 takes 1.5 s to pin; rank 0 waits 500 ms for it, undoes the lease and answers ERR.
    source.set_pin_delay(1, 1.5)
    try:
        t = run_target(targets, tmp_path, registry, "err", tp=1, rpc_timeout_ms=2000)
        leader, verify = t.result()
    finally:
        source.set_pin_delay(1, 0)
    assert leader["match"] == {"matched": HASHES, "reason": "ok", "worker_id": source.worker_id}
    why = assert_failed(leader, verify, within_s=t.rpc_timeout_s + MARGIN_S)
    # The source's own answer (ERR SourceError naming the slow sibling), not the target's RPC timing out.
    assert f"resolve on {source.worker_id}: SourceError: resolve failed, lease undone on every rank" in why, why
    assert "TP rank 1" in why and "calling resolve" not in why, why
    assert all(v["dst_written"] == [] for v in verify), verify  # nothing was read
    for r in range(2):  # the late pin on rank 1 is refused or released; nothing leaks
        source.wait_pins(r, 0, timeout_s=10)


@pytest.mark.parametrize("tp", [2, 1])
def test_a_peer_share_left_unanswered_fails_the_request_and_stops_peer_resolve(
        tmp_path: Path, registry: str, source: SourceWorker, targets: list[Target], tp: int) -> None:
    # After a first (classic) load, each target rank asks the source ranks it reads for its share itself
    # (peer_resolve): at TP 2 target rank 1 asks source rank 1; at TP 1 the leader asks both, and source
    # rank 0's share, pinned, must be handed back. Source rank 1 takes 1.5 s to pin, past the target's 1 s
    # RPC timeout.
    t = run_target(targets, tmp_path, registry, f"peer-slow{tp}", tp=tp, rpc_timeout_ms=1000,
                   extra=["--warm-load", "--wait-go"])
    t.wait_file("warm-done")
    source.set_pin_delay(1, 1.5)
    try:
        (t.dir / "go").write_text("go")
        leader, verify = t.result()
    finally:
        source.set_pin_delay(1, 0)
    assert leader["warm"] == {"done": ["req-warm"], "failed": [], "peer_loads": 0}, leader
    assert leader["stats"]["peer_loads"] == 1, leader["stats"]
    why = assert_failed(leader, verify, within_s=t.rpc_timeout_s + MARGIN_S, done_before=1)
    assert f"peer_resolve on {source.worker_id} rank 1: RpcTimeout" in why, why
    assert "its loads go through rank 0's resolve from now on" in why, why
    for r in range(2):  # rank 0's share is released by the leader; rank 1's late pin is refused or expires
        source.wait_pins(r, 0, timeout_s=15)


# -- b. the source does not answer ----------------------------------------------------------------


def test_resolve_timeout_fails_the_request(tmp_path: Path, registry: str, source: SourceWorker,
                                           targets: list[Target]) -> None:
    pid0 = source.pid(0)
    os.kill(pid0, signal.SIGSTOP)
    try:
        t = run_target(targets, tmp_path, registry, "frozen-src", tp=1, rpc_timeout_ms=500,
                       extra=["--lease-ttl-ms", "500"])
        leader, verify = t.result()
    finally:
        os.kill(pid0, signal.SIGCONT)
    assert leader["match"] == {"matched": HASHES, "reason": "ok", "worker_id": source.worker_id}
    why = assert_failed(leader, verify, within_s=t.rpc_timeout_s + MARGIN_S)
    assert f"resolve on {source.worker_id}: RpcTimeout: calling resolve" in why, why
    assert "no reply within 500 ms" in why, why
    assert all(v["dst_written"] == [] for v in verify), verify
    # Thawed, the source may still serve the stale resolve; nobody releases that lease, so it expires.
    for r in range(2):
        source.wait_pins(r, 0, timeout_s=10)


# -- c. the source dies between resolve and READ --------------------------------------------------------


def test_source_killed_between_resolve_and_read_fails_the_request(tmp_path: Path, targets: list[Target]) -> None:
    delay_s = 2.0
    with _registry() as registry:
        source = _start_source(tmp_path / "src-doomed", registry, "doomed-src")
        try:
            t = run_target(targets, tmp_path, registry, "dead-src", tp=2, extra=["--delay-read-s", str(delay_s)])
            # Both ranks resolved and are about to post their READs: kill every source rank now.
            first = min(float(t.wait_file(f"reading-{r}").read_text() or "0") for r in range(2))
            source.kill()
            killed_after = time.time() - first
        finally:
            source.kill()
        if killed_after >= delay_s:
            pytest.fail(f"the source was killed {killed_after:.2f} s after the READ window opened "
                        f"(> {delay_s} s): the box was too slow to produce the fault")
        leader, verify = t.result()
    assert leader["match"] == {"matched": HASHES, "reason": "ok", "worker_id": source.worker_id}
    why = assert_failed(leader, verify, within_s=t.timeout_s + t.rpc_timeout_s + MARGIN_S)
    # Each rank's READ could not start (TransferError) or ended in ERR; never "done".
    assert "TransferError" in why or "transfer state ERR" in why, why
    assert "did not answer in time" not in why, why  # every rank reported its failure itself
    # ...and told its own engine: each rank's share of req-1 failed, every destination block of it invalid.
    assert all(v["shares_failed"] == ["req-1"] and v["shares_done"] == [] for v in verify), verify
    assert all(v["share_invalid"] == leader["dst"] for v in verify), verify


# -- d. the lease expires on the source mid-load -------------------------------------------------------


def test_lease_expired_on_the_source_fails_the_request(tmp_path: Path, registry: str, source: SourceWorker,
                                                       targets: list[Target]) -> None:
    delay_s, freeze_s, ttl_ms = 1.0, 1.5, 300
    expired_before = _fresh_stats(source, 0)["leases_expired"]
    t = run_target(targets, tmp_path, registry, "frozen-leader", tp=2, timeout_ms=4000,
                   extra=["--delay-read-s", str(delay_s), "--lease-ttl-ms", str(ttl_ms)])
    leader_pid = t.pid(0)
    opened = float(t.wait_file("reading-0").read_text() or "0")
    # Freeze the leader (its coordinator cannot renew) for 5x the lease TTL while its READ waits.
    os.kill(leader_pid, signal.SIGSTOP)
    try:
        frozen_after = time.time() - opened
        time.sleep(freeze_s)
    finally:
        os.kill(leader_pid, signal.SIGCONT)
    if frozen_after >= delay_s:
        pytest.fail(f"the leader was frozen {frozen_after:.2f} s after its READ window opened (> {delay_s} s): "
                    "the box was too slow to produce the fault")
    leader, verify = t.result()
    assert leader["match"] == {"matched": HASHES, "reason": "ok", "worker_id": source.worker_id}
    why = assert_failed(leader, verify, within_s=t.timeout_s + t.rpc_timeout_s + MARGIN_S)
    # Either the renewal after the thaw or the final release finds the lease gone (which one runs
    # first after SIGCONT is up to the scheduler); both fail the request.
    assert "the source dropped the lease" in why or "the lease expired on the source" in why, why
    for r in range(2):
        source.wait_pins(r, 0, timeout_s=10)
    assert _fresh_stats(source, 0)["leases_expired"] >= expired_before + 1  # the source really expired it


# -- f. a gathered part half staged -------------------------------------------------------------------


def _gathering_source(directory: Path, registry: str, name: str) -> SourceWorker:
    """A source that stages every part (even one descriptor's worth), its gather threads stalled."""
    directory.mkdir(parents=True)
    for r in range(2):
        (directory / f"stall-gather-{r}").touch()  # before start-up: the first gather finds it
    return _start_source(directory, registry, name, ["--gather-min-descriptors", "1", "--gather-max-piece-kib", "1024"])


def _staging_taken(source: SourceWorker) -> None:
    for r in range(2):
        source.wait_state(r, lambda s: s["service"]["staging_in_use"] > 0, timeout_s=20, what="a part staging")


def test_a_gather_whose_lease_expires_mid_load_fails_the_load_and_frees_its_staging(
        tmp_path: Path, targets: list[Target]) -> None:
    ttl_ms, freeze_s = 300, 1.5
    with _registry() as registry:
        source = _gathering_source(tmp_path / "src-stalled", registry, "stalled-src")
        try:
            t = run_target(targets, tmp_path, registry, "stalled", tp=2, timeout_ms=4000,
                           extra=["--lease-ttl-ms", str(ttl_ms)])
            _staging_taken(source)  # resolved: each source rank took a range and is stuck packing it
            leader_pid = t.pid(0)
            os.kill(leader_pid, signal.SIGSTOP)  # no renewal: the lease expires on the source mid-gather
            try:
                time.sleep(freeze_s)
            finally:
                os.kill(leader_pid, signal.SIGCONT)
            leader, verify = t.result()
            why = assert_failed(leader, verify, within_s=t.timeout_s + t.rpc_timeout_s + MARGIN_S)
            assert "lease" in why or "staged" in why, why
            for r in range(2):
                (source.dir / f"stall-gather-{r}").unlink()
            for r in range(2):  # the packing stopped at its next chunk and its range went with the lease
                state = source.wait_state(r, lambda s: s["service"]["staging_in_use"] == 0 and s["total_pins"] == 0,
                                          timeout_s=10, what="staging and pins freed")
                assert state["service"]["gathers"]["lease_gone"] >= 1, state["service"]
                assert state["service"]["gathers"]["staged"] == 0, state["service"]
            assert _fresh_stats(source, 0)["leases_expired"] >= 1
        finally:
            report = source.stop()
    assert all(d["total_pins"] == 0 for d in report["done"].values()), report


def test_a_source_killed_mid_gather_fails_the_load_within_its_timeout(tmp_path: Path, targets: list[Target]) -> None:
    with _registry() as registry:
        source = _gathering_source(tmp_path / "src-killed", registry, "killed-src")
        try:
            t = run_target(targets, tmp_path, registry, "killed-mid-gather", tp=2, timeout_ms=2000)
            _staging_taken(source)
            source.kill()  # every source rank, its staged parts half packed
        finally:
            source.kill()
        leader, verify = t.result()
    why = assert_failed(leader, verify, within_s=t.timeout_s + t.rpc_timeout_s + MARGIN_S)
    # Nothing past the counter was read: the counter never moved, so no data READ was posted at all.
    assert all(v["untouched_written"] == [] for v in verify), verify
    # The load ends on the counter: never staged, or its READ failed (the source's side of UCX gone: a disconnect).
    assert ("staged 0 of" in why or "TransferError" in why or "transfer state ERR" in why
            or re.search(r"NIXL READ from \S+ failed: nixlRemoteDisconnectError", why)), why


# -- e. nothing to load -----------------------------------------------------------------------------------


def test_hashes_nobody_holds_match_nothing_and_a_forced_load_fails(tmp_path: Path, registry: str,
                                                                    source: SourceWorker,
                                                                    targets: list[Target]) -> None:
    t = run_target(targets, tmp_path, registry, "unknown", tp=1, extra=["--hash-offset", "1000", "--force-load"])
    leader, verify = t.result()
    assert leader["match"] == {"matched": 0, "reason": "no_candidate", "worker_id": None}, leader
    why = assert_failed(leader, verify, within_s=t.rpc_timeout_s + MARGIN_S)
    assert "lookup: no_candidate" in why, why
    assert all(v["dst_written"] == [] for v in verify), verify
    assert leader["stats"]["bytes"] == 0


def test_incompatible_tp_ratio_is_refused_at_lookup(tmp_path: Path, registry: str, source: SourceWorker,
                                                    targets: list[Target]) -> None:
    # 4 kv heads (the source's 2 x 2) cannot be split over target TP=3.
    t = run_target(targets, tmp_path, registry, "tp3", tp=3, extra=["--force-load"])
    leader, verify = t.result()
    match = leader["match"]
    assert match["matched"] == 0 and match["reason"].startswith("incompatible_layout"), match
    assert "4 kv heads do not split evenly over TP 3" in match["reason"], match
    assert match["worker_id"] == source.worker_id  # it says whom it refused
    why = assert_failed(leader, verify, within_s=t.rpc_timeout_s + MARGIN_S)
    assert "lookup: incompatible_layout" in why, why
    assert all(v["dst_written"] == [] for v in verify), verify
    assert leader["stats"]["bytes"] == 0
    for r in range(2):  # nothing was resolved
        assert source.wait_pins(r, 0)["service"]["leases_open"] == 0


# -- a rank that would post its READ after the leader gave up ------------------------------------------


def test_a_read_posted_after_the_leader_gave_up_never_lands(tmp_path: Path, registry: str, source: SourceWorker,
                                                             targets: list[Target]) -> None:
    # The READs wait 2.5 s to be posted; the leader gives up after 1 s + 0.5 s.
    t = run_target(targets, tmp_path, registry, "late-read", tp=2, timeout_ms=1000, rpc_timeout_ms=500,
                   extra=["--delay-read-s", "2.5", "--linger-s", "2.5"])
    leader, verify = t.result()
    why = assert_failed(leader, verify, within_s=t.timeout_s + t.rpc_timeout_s + MARGIN_S)
    assert "did not answer in time" in why, why
    assert all(v["dst_written_at_outcome"] == [] for v in verify), verify  # nothing had landed yet
    for r in range(2):
        source.wait_pins(r, 0, timeout_s=10)
    # The READs reached the adapter 2.5 s late, past the ranks' deadline: it refused to post them.
    assert all(v["dst_written"] == [] for v in verify), verify
    lines = [line for v in verify for line in v["log"]]
    for r in range(2):  # each rank's adapter refused its READ
        assert any(line.startswith(f"target rank {r}: load") and "not posted: its deadline passed" in line
                   for line in lines), lines


# -- a target rank whose client stopped ------------------------------------------------------------------


def test_a_target_rank_that_is_gone_fails_the_load_at_once(tmp_path: Path, registry: str, source: SourceWorker,
                                                          targets: list[Target]) -> None:
    # Rank 1's client shuts down before the leader looks up: its link closes, and the leader must
    # fail the load as soon as it hands the share out, not after the transfer and rpc timeouts.
    t = run_target(targets, tmp_path, registry, "rank-gone", tp=2, rpc_timeout_ms=2000, extra=["--rank-gone", "1"])
    leader, verify = t.result()
    assert leader["match"] == {"matched": HASHES, "reason": "ok", "worker_id": source.worker_id}
    why = assert_failed(leader, verify, within_s=1.5)  # well inside the 2 s rpc / 5 s transfer timeouts
    assert "target rank 1 is gone" in why, why
    assert all(v["dst_written"] == [] for v in verify[1:]), verify  # rank 1 never read anything
    for r in range(2):  # rank 0 may have read its share; either way the lease is released
        source.wait_pins(r, 0, timeout_s=10)
