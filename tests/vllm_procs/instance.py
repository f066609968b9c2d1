"""One vLLM instance for the connector tests: generate greedily for the prompts, write the outputs, then wait.

``python tests/vllm_procs/instance.py --model DIR --prompts P.json --out O.json [--registry E --worker-id W]
[--hold-file F] [--dtype D] [--lora DIR] [--hf-overrides JSON] [--load-format F] [--batch] [--abort-first MARKER]
[--transfer T] [--load async|sync] [--registry-mirror on|off] [--tp N] [--dump-g2 PREFIX] [--kv-blocks N]
[--save-delay-s S --save-marker F] [--go-file F]``.

With ``--registry`` the RemoteG2Connector is enabled (source and target);
without it this is plain vLLM. Each prompt is a token-id list, or an object
``{"ids": [...], "salt": "tenant-a", "lora": true}`` (``cache_salt``; the
``--lora`` adapter). ``O.json`` holds, per prompt, the generated token ids
and vLLM's ``num_cached_tokens``.

* one prompt at a time, in order (default), or ``--batch``: all in one
  ``generate`` call (one scheduler step sees them together);
* ``--abort-first MARKER``: the first prompt is submitted alone, aborted as
  soon as MARKER exists (the slowed transfer of ``--transfer`` touches it
  when its READ is about to be posted), then the others run; its output is
  ``{"aborted": true}``. ``MARKER`` may also be ``--save-marker``'s file:
  the victim is then aborted while its blocks' copy into G2 runs.

``--save-delay-s S --save-marker F`` (vLLM's engine core in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the saver's copy hook is set here):
each G2 save job, once its blocks are gathered, appends a line to ``F``
(``{"start": t, "hashes": [hex...]}``, ``t`` in ``time.time()``), sleeps
``S`` seconds, then stores — a slowed copy on purpose. ``--kv-blocks N``:
vLLM's KV cache holds N blocks (``num_gpu_blocks_override``), to force
preemptions.

With ``--dump-g2 PREFIX``, once the prompts ran every TP rank writes its G2
pool (block hash hex → the block as ``[layers, 2, rank's kv heads,
block_size, head_dim]``) to ``PREFIX.rank{R}.pt`` (torch.save), read in the
worker process through vLLM's ``collective_rpc``.

With ``--go-file F`` (one prompt at a time) the instance runs its first
prompt, creates ``F.ready`` and waits until ``F`` exists before the others:
a test can change the world (kill a registry server) between them.

With ``--hold-file`` the instance stays up (its G2 pool keeps serving) until
that file exists.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from outputs import write_and_hold


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--registry")
    p.add_argument("--worker-id", default="vllm-test")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lora")
    p.add_argument("--batch", action="store_true")
    p.add_argument("--abort-first")
    p.add_argument("--transfer", default="nixl")
    p.add_argument("--load", default="async", help="the connector's load setting (async or sync)")
    p.add_argument("--registry-mirror", default="on", choices=("on", "off"),
                   help="the connector's registry_mirror setting (default on, as the connector's)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hf-overrides", help="JSON object: vLLM's hf_overrides (e.g. another RoPE base)")
    p.add_argument("--load-format", help="vLLM's load_format (e.g. dummy: generated weights)")
    p.add_argument("--dump-g2")
    p.add_argument("--dump-g2-late", help="as --dump-g2, but after the outputs are written (saves may still run)")
    p.add_argument("--kv-blocks", type=int, help="vLLM's num_gpu_blocks_override")
    p.add_argument("--save-delay-s", type=float, default=0.0)
    p.add_argument("--save-marker")
    p.add_argument("--go-file")
    p.add_argument("--hold-file")
    p.add_argument("--hold-s", type=float, default=300)
    a = p.parse_args()

    if a.dump_g2 or a.dump_g2_late:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function (this test's own)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    if a.save_marker:
        slow_saves(a.save_marker, a.save_delay_s)

    kv = None
    if a.registry:
        kv = KVTransferConfig(kv_connector="RemoteG2Connector", kv_connector_module_path="remote_g2.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"registry": a.registry, "worker_id": a.worker_id,
                                                         "g2_blocks": 256, "landing_blocks": 64,
                                                         "transfer": a.transfer,
                                                         "load": a.load, "registry_mirror": a.registry_mirror == "on"})
    engine_kw = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1} if a.lora else {}
    if a.hf_overrides:
        engine_kw["hf_overrides"] = json.loads(a.hf_overrides)
    if a.load_format:
        engine_kw["load_format"] = a.load_format
    if a.kv_blocks:
        engine_kw["num_gpu_blocks_override"] = a.kv_blocks
    llm = LLM(model=a.model, tokenizer=a.model, dtype=a.dtype, block_size=32, enforce_eager=True,
              max_model_len=1024, max_num_seqs=8, kv_transfer_config=kv, seed=0, tensor_parallel_size=a.tp,
              **engine_kw)
    lora = LoRARequest("tiny-adapter", 1, a.lora) if a.lora else None
    entries = [e if isinstance(e, dict) else {"ids": e} for e in json.loads(Path(a.prompts).read_text())]

    def prompt(e: dict) -> Any:
        kw = {"cache_salt": e["salt"]} if e.get("salt") else {}
        return TokensPrompt(prompt_token_ids=e["ids"], **kw)

    def lora_of(e: dict) -> Any:
        return lora if e.get("lora") else None

    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    results: list[dict] = []

    def record(out: Any) -> dict:
        return {"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens or 0}

    if a.abort_first:
        engine = llm.llm_engine
        first, rest = entries[0], entries[1:]
        engine.add_request("victim", prompt(first), params, lora_request=lora_of(first))
        # The engine core runs in its own process and schedules the victim by itself; step() would block
        # here until the victim produced a token, i.e. until its load ended.
        # In this process's engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) nothing runs unless stepped.
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        deadline = time.monotonic() + 60
        while not os.path.exists(a.abort_first) and time.monotonic() < deadline:
            if in_process:
                engine.step()
            else:
                time.sleep(0.01)
        if not os.path.exists(a.abort_first):
            raise SystemExit("the victim's remote load never started")
        engine.abort_request(["victim"])
        results.append({"aborted": True})
        for i, e in enumerate(rest):
            engine.add_request(f"after-{i}", prompt(e), params, lora_request=lora_of(e))
        done: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            for out in engine.step():
                if out.finished and out.request_id.startswith("after-"):
                    done[out.request_id] = out
        results += [record(done[f"after-{i}"]) for i in range(len(rest))]
        del engine  # it holds the engine core client: `del llm` below must drop the last reference
    elif a.batch:
        outs = llm.generate([prompt(e) for e in entries], params, use_tqdm=False,
                            lora_request=[lora_of(e) for e in entries] if a.lora else None)
        results = [record(o) for o in outs]
    else:
        # One prompt at a time, in order: the first one fetches a shared prefix, the later ones find it cached.
        for i, e in enumerate(entries):
            if i == 1 and a.go_file:
                Path(a.go_file + ".ready").touch()
                deadline = time.monotonic() + a.hold_s
                while not os.path.exists(a.go_file) and time.monotonic() < deadline:
                    time.sleep(0.01)
            out = llm.generate([prompt(e)], params, use_tqdm=False, lora_request=lora_of(e))[0]
            results.append(record(out))
    if a.dump_g2:
        llm.collective_rpc(dump_g2, args=(a.dump_g2,))
    if a.dump_g2_late:
        write_and_hold(a.out, results, None, 0)
        llm.collective_rpc(dump_g2, args=(a.dump_g2_late,))
    write_and_hold(a.out, results, a.hold_file, a.hold_s)
    del llm
    os._exit(0)  # vLLM's engine-core child and NIXL threads: do not wait for interpreter teardown


def slow_saves(marker: str, delay_s: float) -> None:
    """Make every G2 save job of this process log itself to ``marker`` and take ``delay_s`` longer."""
    from remote_g2.adapters.vllm import worker_side

    def hook(job: Any) -> None:
        with open(marker, "a") as f:
            f.write(json.dumps({"start": time.time(), "hashes": [h.hex() for h in job.hashes]}) + "\n")
        time.sleep(delay_s)

    worker_side.SAVE_COPY_HOOK = hook


def dump_g2(worker: Any, prefix: str) -> int:
    """In a vLLM worker: write this rank's G2 pool to ``PREFIX.rank{R}.pt`` once its saves ended; how many
    blocks it holds."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tp_group

    worker = get_kv_transfer_group().worker
    deadline = time.monotonic() + 60
    while worker.saver is not None and not worker.saver.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    pool, rows = worker.pool, worker.pool_rows
    blocks = {h.hex(): rows[pool.lookup(h)].clone() for h in pool.block_hashes()}
    path = f"{prefix}.rank{get_tp_group().rank_in_group}.pt"
    torch.save(blocks, path + ".tmp")
    os.replace(path + ".tmp", path)  # a test waiting for the file never reads half of it
    return len(blocks)


if __name__ == "__main__":
    main()
