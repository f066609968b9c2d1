"""One vLLM instance for the connector tests: generate greedily for the prompts, write the outputs, then wait.

``python tests/vllm_procs/instance.py --model DIR --prompts P.json --out O.json [--registry E --worker-id W]
[--hold-file F]``. With ``--registry`` the RemoteG2Connector is enabled
(source and target); without it this is plain vLLM. Prompts are token-id
lists (JSON). ``O.json`` holds, per prompt, the generated token ids and
vLLM's ``num_cached_tokens``. With ``--hold-file`` the instance stays up
(its G2 pool keeps serving) until that file exists.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--registry")
    p.add_argument("--worker-id", default="vllm-test")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--hold-file")
    p.add_argument("--hold-s", type=float, default=300)
    a = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if a.registry:
        kv = KVTransferConfig(kv_connector="RemoteG2Connector", kv_connector_module_path="remote_g2.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"registry": a.registry, "worker_id": a.worker_id,
                                                         "g2_blocks": 256, "landing_blocks": 64,
                                                         "transfer_timeout_ms": 10000})
    llm = LLM(model=a.model, tokenizer=a.model, dtype="float32", block_size=32, enforce_eager=True,
              max_model_len=1024, max_num_seqs=8, kv_transfer_config=kv, seed=0)
    prompts = json.loads(Path(a.prompts).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    results = []
    # One prompt at a time, in order: the first one fetches the shared prefix, the later ones find it cached.
    for ids in prompts:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens or 0})
    tmp = Path(a.out + ".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(a.out)
    if a.hold_file:
        deadline = time.monotonic() + a.hold_s
        while not os.path.exists(a.hold_file) and time.monotonic() < deadline:
            time.sleep(0.1)
    del llm
    os._exit(0)  # vLLM's engine-core child and NIXL threads: do not wait for interpreter teardown


if __name__ == "__main__":
    main()
