"""A stock vLLM (no connector) publishing its KV events over ZMQ: generate for the prompts, write vLLM's hashes, wait.

``python tests/vllm_procs/stock_instance.py --model DIR --prompts P.json --out O.json --kv-events ENDPOINT
[--hold-file F]``. vLLM's publisher connects to ``ENDPOINT`` when it is a
non-wildcard ``tcp://`` one (the registry binds it: ``--vllm-kv-events @ENDPOINT=…``).
Prompts are token-id lists (JSON). ``O.json`` holds, per prompt, the generated
token ids and the block hashes vLLM's engine itself gave the request
(``request.block_hashes``, hex), read from the engine's own ``Request`` objects;
that is why the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set here). The caller sets the environment that decides the hashes' form:
``PYTHONHASHSEED`` and ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``. With
``--hold-file`` the instance stays up (its event stream too) until that file exists.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from outputs import write_and_hold


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kv-events", required=True, help="vLLM's KVEventsConfig.endpoint")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--hold-file")
    p.add_argument("--hold-s", type=float, default=300)
    a = p.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its requests are readable
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core import EngineCore

    # vLLM's own block hashes of each request, as its scheduler (and a connector) sees them. The list is
    # vLLM's, kept by reference: it grows in place as the request's blocks fill.
    hashes_of: dict[str, list[bytes]] = {}
    add_request = EngineCore.add_request

    def recording_add_request(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        hashes_of[request.request_id] = request.block_hashes
        return add_request(self, request, *args, **kwargs)

    EngineCore.add_request = recording_add_request  # type: ignore[method-assign]

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=a.kv_events)
    llm = LLM(model=a.model, tokenizer=a.model, dtype="float32", block_size=32, enforce_eager=True,
              max_model_len=1024, max_num_seqs=8, kv_events_config=events, seed=0)
    prompts = json.loads(Path(a.prompts).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    results = []
    for ids in prompts:
        before = set(hashes_of)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        (request_id,) = set(hashes_of) - before
        results.append({"tokens": list(out.outputs[0].token_ids),
                        "block_hashes": [bytes(h).hex() for h in hashes_of[request_id]]})
    write_and_hold(a.out, results, a.hold_file, a.hold_s)
    del llm
    os._exit(0)  # do not wait for interpreter teardown (vLLM's threads)


if __name__ == "__main__":
    main()
