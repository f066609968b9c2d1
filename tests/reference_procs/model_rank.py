"""One TP rank of the reference model under mpiexec: run the bit-exactness scenarios, save this rank's tensors.

Run every rank with ``mpiexec -n TP python tests/reference_procs/model_rank.py --ref R --out O``.
For each mode named in ``R/modes.json`` the test wrote ``R/{mode}.pt``: the
config, the prompt, the prefix length and the TP=1 KV of the prompt. Every
rank (``torch`` on one thread, as an engine rank on a shared box would be):

* prefills the prompt in 16-token chunks, twice (``prefill_logits``,
  ``prefill_logits_again``, ``kv`` = this rank's KV);
* greedily generates from the prompt, recomputing everything (``gen_*``);
* greedily generates with the TP=1 KV of the prefix, sliced to this rank's
  kv heads, as its past — a TP=1 source read by this TP=``size`` target
  (``reuse_*``);
* records its shard (``kv_heads``, ``shard_shapes``) and one allgather of a
  numpy and a torch array (``allgather_np``/``allgather_torch``);

and saves ``O/{mode}-rank{r}.pt``. Any exception aborts the whole job
(``MPI.Abort``) so no sibling is left spinning in a collective.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from remote_g2.adapters.reference import ModelConfig, ReferenceModel, TpComm, slice_kv


def run_mode(ref: dict, tp: TpComm) -> dict:
    config = ModelConfig(**ref["config"])
    model = ReferenceModel(config, tp)
    prompt, prefix = ref["prompt"], ref["prefix_len"]
    heads = slice(model.kv_head_range.start, model.kv_head_range.stop)
    first = model.prefill(prompt, chunk_tokens=16)
    again = model.prefill(prompt, chunk_tokens=16)
    gen = model.generate_greedy(prompt, ref["new_tokens"])
    reused_kv = slice_kv(ref["kv"], tokens=slice(0, prefix), heads=heads)
    reuse = model.generate_greedy(prompt, ref["new_tokens"], past_kv=reused_kv)
    return {
        "rank": tp.rank, "size": tp.size,
        "kv_heads": [model.kv_head_range.start, model.kv_head_range.stop],
        "shard_shapes": model.shard_shapes(),
        "prefill_logits": first.logits, "prefill_logits_again": again.logits, "kv": first.kv,
        "gen_tokens": gen.tokens, "gen_logits": gen.logits, "gen_kv": gen.kv,
        "reuse_tokens": reuse.tokens, "reuse_logits": reuse.logits, "reuse_kv": reuse.kv,
        "allgather_np": tp.allgather(np.array([tp.rank, tp.rank + 0.5])),
        "allgather_torch": tp.allgather(torch.full((2, 3), float(tp.rank), dtype=torch.float32)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tp = TpComm.world()
    for mode in json.loads((args.ref / "modes.json").read_text()):
        ref = torch.load(args.ref / f"{mode}.pt", weights_only=False)
        torch.save(run_mode(ref, tp), args.out / f"{mode}-rank{tp.rank}.pt")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
