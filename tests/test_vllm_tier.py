"""remote-g2's secondary tier inside vLLM's real tiering manager, with no engine: two processes, a real registry
(its server and change feed, the tier's in-process mirror), real NIXL agents, vLLM's own shared primary region.

Each process is tests/vllm_procs/tier_proc.py: vLLM's ``TieringOffloadingSpec`` builds its CPU primary tier and
the tier by ``module_path``. Holder A stores chunks (bytes drawn from a seed), which the tier publishes; reader
B looks them up, vLLM promotes them through the tier (resolve at A, NIXL READ into B's primary rows, release),
and B's rows are compared with the bytes A wrote. Failures must end as misses, never as other bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from tests.vllm_harness import AnswerLines  # noqa: E402  (also imported by bench.vllm.bench_vllm_tier)

PROC = Path(__file__).parent / "vllm_procs" / "tier_proc.py"
BLOCK_BYTES = 8192  # one block's KV on one worker: a row of 8 KiB
FP = {"model_id": "tiny#w-" + "a" * 32, "dtype": "bfloat16", "tokens_per_block": 16, "num_layers": 2,
      "num_kv_heads": 2, "head_dim": 64, "tp_size": 1, "hash_scheme": "vllm/sha256/test",
      "kv_layout": f"tier/tp1/default/r{BLOCK_BYTES}"}


class Side:
    """One tier_proc.py process, spoken to a JSON line at a time."""

    def __init__(self, registry: str, worker_id: str, *, fp: dict | None = None, idle: bool = False,
                 tier: dict | None = None, block_bytes: int = BLOCK_BYTES, rows: int = 64, quiet: bool = False) -> None:
        self.engine_id = f"remote-g2-test-{os.urandom(6).hex()}"
        cfg = {"registry": registry, "worker_id": worker_id, "fingerprint": fp or FP, "block_bytes": block_bytes,
               "cpu_bytes": rows * block_bytes, "idle": idle, "tier": tier or {}, "engine_id": self.engine_id}
        self.proc = subprocess.Popen([sys.executable, str(PROC), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env={**os.environ, "UCX_LOG_LEVEL": "error"},
                                     stderr=subprocess.DEVNULL if quiet else None)
        self._answers = AnswerLines(self.proc.stdout)
        self.info = self.read(60)
        assert self.info.get("ready"), self.info

    def read(self, timeout_s: float) -> dict:
        """The next answer line (:class:`vllm_harness.AnswerLines`)."""
        deadline = time.monotonic() + timeout_s
        while (answer := self._answers.pop()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no answer from the tier process within {timeout_s} s")
            if select.select([self._answers], [], [], min(left, 0.1))[0]:
                assert self._answers.feed(), f"the tier process exited ({self.proc.poll()})"
        return answer

    def ask(self, timeout_s: float = 30, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(op="stop", timeout_s=30)
            except (AssertionError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def keys(n: int, tag: str) -> list[str]:
    return [(hashlib.sha256(f"{tag}-{i}".encode()).digest() + bytes(4)).hex() for i in range(n)]


def expected(seed: int, key_hex: str, row_bytes: int) -> str:
    out = bytearray()
    block = hashlib.sha256(seed.to_bytes(8, "big") + bytes.fromhex(key_hex)).digest()
    while len(out) < row_bytes:
        out += block
        block = hashlib.sha256(block).digest()
    return hashlib.sha256(bytes(out[:row_bytes])).hexdigest()


def load_until(side: Side, wanted: list[str], *, hits: int, timeout_s: float = 20) -> dict:
    """Load ``wanted`` until at least ``hits`` of them land (the holder's publishing reaches the mirror in ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = side.ask(op="load", keys=wanted, timeout_s=5)["got"]
        if sum(v is not None and v != "timeout" for v in got.values()) >= hits or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


@pytest.fixture(scope="module")
def registry_url():
    from remote_g2.registry import MemoryStore, RegistryServer

    server = RegistryServer(MemoryStore(lease_ttl_ms=5000), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0")
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def pair(registry_url):
    """Holder A (stepping only while its tier has work, as an idle engine; validated leases) and reader B, shared
    by the tests below (each with keys of its own): starting a process with vLLM costs seconds."""
    a = Side(registry_url, "a", idle=True)
    b = Side(registry_url, "b", tier={"fetch_timeout_s": 2.0})
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def pinning(registry_url):
    """Holder P: idle like A, but its leases pin chunks through vLLM's manager at its next step."""
    p = Side(registry_url, "p", idle=True, tier={"pin_leases": True})
    yield p
    p.stop()


def test_a_chunk_stored_by_one_instance_is_read_byte_exact_by_another(pair):
    a, b = pair
    assert a.info["sharing"] and b.info["sharing"]
    ks = keys(6, "prefix")
    served = a.ask(op="stats")["served"]
    assert a.ask(op="store", keys=ks, seed=7) == {"stored": 6}
    got = load_until(b, ks, hits=6)
    row = b.info["row_bytes"]
    assert got == {k: expected(7, k, row) for k in ks}
    stats = a.ask(op="stats")
    assert stats["served"] > served and stats["open_leases"] == 0 and stats["lapsed"] == 0  # released, unpinned
    # now in B's own primary tier: a second load takes nothing from A
    assert b.ask(op="load", keys=ks, timeout_s=5)["got"] == got
    assert a.ask(op="stats")["served"] == stats["served"]


def test_the_test_sees_other_bytes_negative_control(pair):
    """The comparison is real: bytes written under another seed do not pass it."""
    a, b = pair
    ks = keys(2, "control")
    a.ask(op="store", keys=ks, seed=8)
    got = load_until(b, ks, hits=2)
    assert all(v is not None for v in got.values())
    assert got != {k: expected(7, k, b.info["row_bytes"]) for k in ks}
    assert got == {k: expected(8, k, b.info["row_bytes"]) for k in ks}


def test_an_idle_holder_serves_a_peer_without_a_step(pair):
    """Validated leases are answered by the holder's RPC thread: an idle engine is not stepped, not even woken."""
    a, b = pair
    ks = keys(2, "idle")
    a.ask(op="store", keys=ks, seed=9)
    time.sleep(0.3)  # (the store's job result is collected by a step or two)
    before, read_before = a.ask(op="stats"), b.ask(op="stats")["read"]
    time.sleep(1.0)
    assert a.ask(op="stats")["steps"] == before["steps"]  # nothing asked: not one step in a second
    got = load_until(b, ks, hits=2)
    assert got == {k: expected(9, k, b.info["row_bytes"]) for k in ks}
    after = a.ask(op="stats")
    assert b.ask(op="stats")["read"] == read_before + 2 and after["open_leases"] == 0
    assert after["steps"] == before["steps"]  # served with no step


def test_a_reader_past_its_first_lease_finds_rows_in_the_holders_chunk_table(pair):
    """Once B has released a lease at A (its READs past UCX's wire-up; on one host they are cma, one-sided), A
    grants B its chunk table: B finds the rows with one-sided READs, and A answers no RPC for them."""
    a, b = pair
    first = keys(1, "table-first")
    a.ask(op="store", keys=first, seed=12)
    load_until(b, first, hits=1)  # (a lease released here, if none was before: the table is asked for then)
    ks = keys(4, "table")
    a.ask(op="store", keys=ks, seed=13)
    served, one_sided = a.ask(op="stats")["served"], b.ask(op="stats")["read_one_sided"]
    got = load_until(b, ks, hits=4)
    assert got == {k: expected(13, k, b.info["row_bytes"]) for k in ks}
    assert b.ask(op="stats")["read_one_sided"] == one_sided + 4
    assert a.ask(op="stats")["served"] == served  # no resolve reached A for them


def test_a_pinning_holder_steps_only_while_asked(pinning, pair):
    """Pinned leases: the tier has work only while an ask waits or a lease is open, and an ask wakes the engine."""
    p, b = pinning, pair[1]
    ks = keys(2, "pinned-idle")
    p.ask(op="store", keys=ks, seed=10)
    time.sleep(0.3)
    before = p.ask(op="stats")["steps"]
    time.sleep(1.0)
    assert p.ask(op="stats")["steps"] == before
    got = load_until(b, ks, hits=2)
    assert got == {k: expected(10, k, b.info["row_bytes"]) for k in ks}
    after = p.ask(op="stats")
    assert after["open_leases"] == 0
    assert 0 < after["steps"] - before < 200  # it stepped while asked, then went idle again


def test_a_validated_lease_fails_once_its_chunk_is_evicted(pair, registry_url):
    """The holder answers from the rows it stored; an eviction moves the row's generation, and the release of a
    lease taken before it answers ``released: false`` (the reader discards what it read)."""
    from remote_g2.registry import RegistryClient

    a, b = pair
    ks = keys(2, "validated")
    a.ask(op="store", keys=ks, seed=11)
    with RegistryClient(registry_url) as reg:
        (endpoint,) = [w.endpoint for w in reg.list_workers() if w.worker_id == "a"]
    kept = b.ask(op="resolve_only", endpoint=endpoint, keys=ks, ttl_ms=10_000)
    assert kept["matched"] == 2
    # a lease is its connection's: another one cannot end it (nor learn whether it stands)
    assert b.ask(op="release", endpoint=endpoint, lease_id=kept["lease_id"], other_connection=True) == \
        {"released": False}
    assert b.ask(op="release", endpoint=endpoint, lease_id=kept["lease_id"]) == {"released": True}
    doomed = b.ask(op="resolve_only", endpoint=endpoint, keys=ks, ttl_ms=10_000)
    assert doomed["matched"] == 2
    assert a.ask(op="evict", timeout_s=60) == {"evicted": True}  # (nothing pins them: the primary evicts at will)
    assert b.ask(op="release", endpoint=endpoint, lease_id=doomed["lease_id"]) == {"released": False}
    assert b.ask(op="resolve_only", endpoint=endpoint, keys=ks, ttl_ms=10_000)["matched"] == 0  # gone: a miss


def test_other_fingerprints_never_share(pair, registry_url):
    a, _ = pair
    other = Side(registry_url, "c", fp={**FP, "dtype": "float16"})
    try:
        ks = keys(3, "fp")
        served = a.ask(op="stats")["served"]
        a.ask(op="store", keys=ks, seed=1)
        time.sleep(1.0)  # A's chunks are in the registry by now (a same-fingerprint reader sees them: above)
        assert other.ask(op="load", keys=ks, timeout_s=5)["got"] == {k: None for k in ks}
        assert a.ask(op="stats")["served"] == served and other.ask(op="stats")["read"] == 0
    finally:
        other.stop()
    chunked = {**FP, "tokens_per_block": 32}
    from remote_g2.protocol.messages import LayoutFingerprint

    assert LayoutFingerprint(**chunked).compat_key() != LayoutFingerprint(**FP).compat_key()  # another chunk size


def _holders(registry_url: str, ks: list[str]) -> dict[str, set[str]]:
    """Who the registry says holds each key's chunk."""
    from remote_g2.registry import RegistryClient

    with RegistryClient(registry_url) as c:
        return {k: {h.worker_id for h in c.lookup([bytes.fromhex(k)[:-4]], want_all_holders=True).holders}
                for k in ks}


def test_a_chunk_evicted_from_the_primary_is_unpublished_and_never_read(pair, registry_url):
    a, b = pair
    ks = keys(4, "evict")
    a.ask(op="store", keys=ks, seed=3)
    assert sum(v is not None for v in load_until(b, ks[:1], hits=1).values()) == 1  # B's mirror has them
    assert all("a" in h for h in _holders(registry_url, ks).values())
    assert a.ask(op="evict", timeout_s=60) == {"evicted": True}
    deadline = time.monotonic() + 5  # the tier hears of each eviction from the primary's cache policy
    while any("a" in h for h in _holders(registry_url, ks).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any("a" in h for h in _holders(registry_url, ks).values())
    got = b.ask(op="load", keys=ks[1:], timeout_s=10)["got"]
    assert got == {k: None for k in ks[1:]}  # missed (recomputed), never other bytes
    assert a.ask(op="stats")["open_leases"] == 0


def test_a_holder_killed_is_a_miss_not_a_hang(pair, registry_url):
    _, b = pair
    doomed = Side(registry_url, "doomed")
    ks = keys(3, "killed")
    doomed.ask(op="store", keys=ks, seed=5)
    assert load_until(b, ks[:1], hits=1) == {ks[0]: expected(5, ks[0], b.info["row_bytes"])}
    os.kill(doomed.proc.pid, signal.SIGKILL)
    doomed.proc.wait(10)
    shm = Path(f"/dev/shm/vllm_offload_{doomed.engine_id}.mmap")
    shm.unlink(missing_ok=True)  # (vLLM unlinks its region only on an orderly shutdown)
    t0 = time.monotonic()
    got = b.ask(op="load", keys=ks[1:], timeout_s=20)["got"]
    assert got == {k: None for k in ks[1:]}  # B's mirror may still name it: the load fails, and is a miss
    assert time.monotonic() - t0 < 10


def _spec(**extra: object):
    """vLLM's real TieringOffloadingSpec over an OffloadingConfig as an engine would build it (32-token blocks)."""
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    groups = extra.pop("groups", (OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"),
                                                        group_id=0),))
    config = OffloadingConfig(
        groups=groups, worker_kv_bytes_per_block=BLOCK_BYTES, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 64 * BLOCK_BYTES}, engine_id="unused",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=int(extra.pop("tokens_per_hash", 32)), blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(rank=0, world_size=int(extra.pop("world_size", 1)), tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
        **extra)
    return TieringOffloadingSpec(config)


def test_the_tier_fingerprint_holds_what_must_match(model_dir: Path) -> None:
    """tier_identity: the connector's model identity, the chunk's tokens, the hash unit, the row; none with LoRA,
    several KV-cache groups or generated weights."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    from remote_g2.adapters.vllm import block_identity
    from remote_g2.adapters.vllm_tier.identity import tier_identity
    from remote_g2.identity.load_snapshot import MARGIN_NS, StartMark

    def config(**kw: object):
        return EngineArgs(model=str(model_dir), tokenizer=str(model_dir), dtype="float32", block_size=32,
                          enforce_eager=True, max_model_len=1024, **kw).create_engine_config()

    vc = config()
    mark = StartMark(time.time_ns() + 2 * MARGIN_NS, "the test's engine started")  # (the model is fresh: see harness)
    ident = block_identity.model_identity(vc.model_config, vc.load_config, vc.cache_config, digest_cache=None,
                                          mark=mark)
    assert ident.model_id is not None, ident.why_not
    fp = tier_identity(_spec(), 4096, vc, identity=ident).fingerprint
    assert fp is not None and fp.model_id == ident.model_id and fp.dtype == "float32"
    assert fp.tokens_per_block == 64 and fp.kv_layout == "tier/tp1/default/r4096"  # two 32-token blocks a chunk
    assert fp.hash_scheme.endswith("/u32") and fp.hash_scheme.startswith("vllm/sha256/")  # keyed by each chunk's last
    assert tier_identity(_spec(world_size=2), 4096, vc, identity=ident).fingerprint.kv_layout.startswith("tier/tp2/")
    canonical = tier_identity(_spec(canonical_layout=True), 4096, vc, identity=ident).fingerprint
    assert canonical.kv_layout.startswith("tier/canonical/") and canonical.compat_key() != fp.compat_key()
    assert tier_identity(_spec(tokens_per_hash=16), 4096, vc, identity=ident).fingerprint.compat_key() != \
        fp.compat_key()  # another hash unit: other keys for the same chunks

    two_groups = (OffloadingGroupConfig(32, ("l0",), 0), OffloadingGroupConfig(32, ("l1",), 1))
    assert tier_identity(_spec(groups=two_groups), 4096, vc, identity=ident).kind == "kv_cache_groups"
    assert tier_identity(_spec(), 4096, config(enable_lora=True), identity=ident).kind == "lora"
    dummy = config(load_format="dummy")
    assert tier_identity(_spec(), 4096, dummy).kind == "generated"
    assert tier_identity(_spec(), 4096, None).kind == "unreadable"


@pytest.mark.parametrize("holder", ["validated", "pinned"])
def test_a_lease_never_released_lapses(holder, pair, pinning, registry_url):
    """A reader that resolved and then vanished: its lease lapses after its TTL. A pinned lease's job is then
    reported finished, so vLLM unpins the chunks (they could not be evicted meanwhile); a validated one is dropped
    with no step."""
    from remote_g2.registry import RegistryClient

    a = pair[0] if holder == "validated" else pinning
    b = pair[1]
    ks = keys(2, f"lapse-{holder}")
    a.ask(op="store", keys=ks, seed=4)
    name = "a" if holder == "validated" else "p"
    with RegistryClient(registry_url) as reg:
        (endpoint,) = [w.endpoint for w in reg.list_workers() if w.worker_id == name]
    lapsed = a.ask(op="stats")["lapsed"]
    got = b.ask(op="resolve_only", endpoint=endpoint, keys=ks, ttl_ms=300)
    assert (got["matched"], got["expires_in_ms"]) == (2, 300)
    assert a.ask(op="stats")["open_leases"] == 1
    deadline = time.monotonic() + 5
    while a.ask(op="stats")["open_leases"] and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = a.ask(op="stats")
    assert stats["open_leases"] == 0 and stats["lapsed"] == lapsed + 1
    assert b.ask(op="release", endpoint=endpoint, lease_id=got["lease_id"]) == {"released": False}
    assert a.ask(op="evict", timeout_s=60) == {"evicted": True}  # unpinned: the primary could evict them all


def test_a_registry_that_dies_turns_lookups_into_misses_not_hangs(tmp_path):
    """With the registry gone, the reader's mirror loses its copy: lookups miss (and vLLM recomputes) at once."""
    from remote_g2.registry import MemoryStore, RegistryServer

    server = RegistryServer(MemoryStore(lease_ttl_ms=5000), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0")
    url = server.start()
    a = b = None
    try:
        a, b = Side(url, "ra"), Side(url, "rb")
        ks = keys(3, "registry-down")
        a.ask(op="store", keys=ks, seed=6)
        assert load_until(b, ks[:1], hits=1) == {ks[0]: expected(6, ks[0], b.info["row_bytes"])}
        server.close()
        time.sleep(3.0)  # the mirror's heartbeat sees its feed gone (1 s), and drops its copy
        t0 = time.monotonic()
        got = b.ask(op="load", keys=ks[1:], timeout_s=10)["got"]
        assert got == {k: None for k in ks[1:]}  # (A still holds them: without a registry B cannot know)
        assert time.monotonic() - t0 < 5
    finally:
        for side in (b, a):
            if side is not None:
                side.stop()
        server.close()


def test_vllms_plugin_takes_the_load_snapshot_for_the_tier_too() -> None:
    """The snapshot the identity checks against (remote_g2/identity/load_snapshot.py) is taken for the tier's configs as
    for the connector's: the model's path as it was before vLLM read it."""
    from vllm.config import KVTransferConfig

    from remote_g2.adapters.vllm.plugin import uses_remote_g2, uses_remote_g2_tier

    def config(tiers: list) -> KVTransferConfig:
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30, "secondary_tiers": tiers})

    ours = config([{"type": "RemoteG2Tier", "module_path": "remote_g2.adapters.vllm_tier.tier"}])
    assert uses_remote_g2_tier(ours) and not uses_remote_g2(ours)
    assert not uses_remote_g2_tier(config([{"type": "p2p"}])) and not uses_remote_g2_tier(config([]))
    assert not uses_remote_g2_tier(None)


def test_a_chunk_with_no_known_holder_is_reported_failed_never_loaded(registry: str) -> None:
    """Never a job reported whole when one of its keys was not READ: a key vLLM asks the tier to load whose holder
    the tier does not know (its lookup answer was dropped) fails, so vLLM frees its row instead of serving
    whatever bytes the row held. The tier's stats carry what changed, and nothing on a step where nothing did."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from remote_g2.adapters.vllm_tier.identity import TierIdentity
    from remote_g2.adapters.vllm_tier.tier import RemoteG2Tier
    from remote_g2.protocol.messages import LayoutFingerprint

    rows = np.zeros((4, 4096), np.uint8)
    tier = RemoteG2Tier(_spec(), memoryview(rows), registry=registry, worker_id="lonely",
                        identity=TierIdentity(LayoutFingerprint(**{**FP, "kv_layout": "tier/tp1/default/r4096"})))
    try:
        assert tier.get_stats().reduce() == {"vllm:remote_g2_tier_open_leases": 0,
                                             "vllm:remote_g2_tier_published_chunks": 0}  # (the gauges, once)
        assert tier.get_stats() is None  # nothing changed: vLLM's step passes nothing on
        key = bytes(32) + bytes(4)
        tier.submit_load(TransferJob(job_id=7, keys=[key], chunk_ids=np.array([0], np.int32), is_promotion=True,
                                     req_context=ReqContext(req_id="r")))
        tier.drain_jobs()
        (result,) = [r for r in tier.get_finished_jobs() if r.job_id == 7]
        assert (result.success, list(result.successful_keys)) == (False, [])
        assert key in tier._failed  # and it is not tried again at once (a MISS for failed_ttl_s)
        assert tier.lookup(key, ReqContext(req_id="r2")).name == "MISS"
        stats = tier.get_stats().reduce()  # the failure, and the job's time; the gauges did not move
        assert stats["vllm:remote_g2_tier_chunks_failed"] == 1 and "vllm:remote_g2_tier_open_leases" not in stats
        assert stats["vllm:remote_g2_tier_fetch_seconds_count"] == 1, stats
        assert tier.get_stats() is None
    finally:
        tier.shutdown()


@pytest.mark.parametrize("path", ["leased", "one_sided"])
@pytest.mark.parametrize("evicted_mid_read", [False, True])
def test_a_chunk_evicted_during_its_read_is_discarded(evicted_mid_read: bool, path: str) -> None:
    """The fetch thread's own paths against a validated holder, in one process: resolve, NIXL READ, release
    (``leased``: the reader's first fetch from a holder); or, once the holder granted its chunk table, bucket
    READ, row READ, slot READ (``one_sided``). A chunk the holder lets go of while its row's READ is in flight
    (injected: no real part evicts on cue inside a millisecond) is never reported read, so vLLM frees its row
    rather than keep bytes that may be another chunk's: the leased path fails the whole run (one release
    answers for it), the one-sided one keeps the chunks before it (each slot answers for its own)."""
    import numpy as np

    from remote_g2.adapters.vllm_tier.fetching import ChunkFetcher, LoadRun
    from remote_g2.adapters.vllm_tier.serving import ChunkServer

    row = 4096
    src = np.random.default_rng(5).integers(0, 256, (8, row), dtype=np.uint8)
    dst = np.zeros((8, row), np.uint8)
    server = ChunkServer("held", src.ctypes.data, row, 8, bind="tcp://127.0.0.1:0", validated=True)
    fetcher = ChunkFetcher("reader", dst.ctypes.data, row, 8, timeout_s=5.0)
    try:
        if path == "one_sided":  # a first fetch, over RPC: the table is granted after it
            server.held([b"w" * 32], [7])
            fetcher.submit(0, [LoadRun(server.endpoint, [b"w" * 36], [b"w" * 32], [7])])
            assert fetcher.drain(20) and fetcher.results()[0].success
            deadline = time.monotonic() + 10
            while not fetcher._tables and time.monotonic() < deadline:  # (asked for after the job's result)
                time.sleep(0.01)
            assert fetcher._tables, "the holder granted no chunk table"
        hashes = [bytes([i]) * 32 for i in range(3)]
        server.held(hashes, [2, 0, 3])
        served = server.served
        if evicted_mid_read:
            start_read = fetcher.transfer.start_read

            def evict_then_read(agent: str, local: object, remote: object, nbytes: "np.ndarray",
                                **kw: object) -> object:
                handle = start_read(agent, local, remote, nbytes, **kw)
                if int(nbytes.sum()) >= row:  # the rows' READ (not a table bucket's or slot's)
                    server.let_go([hashes[1]])  # the primary evicts one of them while the bytes are on their way
                return handle

            fetcher.transfer.start_read = evict_then_read  # type: ignore[method-assign]
        keys = [h + bytes(4) for h in hashes]
        fetcher.submit(1, [LoadRun(server.endpoint, keys, hashes, [0, 1, 2])])
        assert fetcher.drain(20)
        (result,) = fetcher.results()
        if not evicted_mid_read:
            assert result.success and np.array_equal(dst[:3], src[[2, 0, 3]])
        elif path == "leased":
            assert (result.success, list(result.successful_keys)) == (False, [])
        else:
            assert (result.success, list(result.successful_keys)) == (False, keys[:1])
            assert np.array_equal(dst[0], src[2])
        assert server.open_leases() == 0
        assert (server.served == served) == (path == "one_sided")  # the one-sided path asks the holder nothing
        assert fetcher.chunks_read_one_sided == (0 if path == "leased" else 1 if evicted_mid_read else 3)
    finally:
        fetcher.close()
        server.close()


def test_a_reader_whose_own_transports_are_not_one_sided_asks_for_no_chunk_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder grants its table by its own ``UCX_TLS``; a reader restricted to TCP (its READs emulated: they
    need the holder's progress, which only a lease drives) does not ask, and keeps reading over RPC leases."""
    import numpy as np

    from remote_g2.adapters.vllm_tier.fetching import ChunkFetcher, LoadRun
    from remote_g2.adapters.vllm_tier.serving import ChunkServer

    row = 4096
    src = np.random.default_rng(6).integers(0, 256, (4, row), dtype=np.uint8)
    dst = np.zeros((4, row), np.uint8)
    server = ChunkServer("held-tcp", src.ctypes.data, row, 4, bind="tcp://127.0.0.1:0", validated=True)
    monkeypatch.setenv("UCX_TLS", "tcp")  # (the reader's agent and its judgement; the holder was made before)
    fetcher = ChunkFetcher("reader-tcp", dst.ctypes.data, row, 4, timeout_s=10.0)
    try:
        hashes = [bytes([i + 1]) * 32 for i in range(2)]
        server.held(hashes, [3, 1])
        for job in (1, 2):
            fetcher.submit(job, [LoadRun(server.endpoint, [h + bytes(4) for h in hashes], hashes, [0, 2])])
            assert fetcher.drain(30) and fetcher.results()[0].success
            time.sleep(0.3)  # (a table would be asked for after the job's result)
        assert np.array_equal(dst[[0, 2]], src[[3, 1]])
        assert not fetcher._tables and fetcher.chunks_read_one_sided == 0 and server.served == 2
    finally:
        fetcher.close()
        server.close()


def test_a_request_aborted_while_its_chunks_load_leaves_them_whole(pair):
    """vLLM ends a request while the tier's READ for it runs: the job still ends (reported, its rows released by
    vLLM's manager), and the chunks it brought are the holder's bytes, never half-written ones."""
    a, b = pair
    ks = keys(4, "abort")
    a.ask(op="store", keys=ks, seed=12)
    load_until(b, ks[:1], hits=1)  # (B's mirror has A's chunks)
    out = b.ask(op="load_abort", keys=ks[1:])
    assert out["first"] == ["HIT_PENDING"] * 3 and out["settled"], out
    assert out["got"] == {k: expected(12, k, b.info["row_bytes"]) for k in ks[1:]}
    assert a.ask(op="stats")["open_leases"] == 0
