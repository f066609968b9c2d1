"""The reference model's bit-exactness contract, with real tensor parallelism over ``mpiexec``.

Every comparison is ``torch.equal`` on the raw tensors — bit equality, never closeness.

In this process (TP=1, torch's default threads): (a) the same prompt gives
the same bits from fresh models and under 1 or 2 torch threads; (b) the
logits and KV of a prompt are the same for one whole-prompt forward,
block-aligned 16-token chunks, ragged chunks and token by token, also when
each chunk's past KV is fed back from a different forward; a generation
whose prompt-prefix KV comes from elsewhere matches the recompute. Config
and shard errors.

Under ``mpiexec -n {1,2,4}`` (``tests/reference_procs/model_rank.py``, one
torch thread per rank; four ranks over-subscribe two cores, which is fine),
for GQA and MLA: (c) every rank's logits equal the TP=1 logits computed here;
rank r's KV is exactly heads ``kv_head_range`` of the TP=1 KV (MLA: the whole
latent, on every rank); a TP=n target that reads the TP=1 prefix KV
generates exactly the recompute's tokens and logits, and so does a TP=1
target that reads a TP=n source's prefix KV (its ranks' heads put together).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.common import signal_group
from remote_g2.adapters.reference import ModelConfig, ReferenceModel, TpComm, concat_kv, shard_for, slice_kv
from remote_g2.adapters.reference.config import PROB_BITS, W_FRAC_BITS
from remote_g2.adapters.reference.model import _exp_on_prob_grid, _linear, _to_act_grid
from remote_g2.adapters.reference.weights import weights_model_id
from remote_g2.errors import ConfigError

MPIEXEC = Path(sys.executable).parent / "mpiexec"
RANK_SCRIPT = Path(__file__).resolve().parent / "reference_procs" / "model_rank.py"
MODES = {"gqa": ModelConfig(), "mla": ModelConfig.mla_default()}
PROMPT_LEN = 80  # five 16-token blocks
PREFIX_LEN = 48  # three blocks "read from another worker"
NEW_TOKENS = 6
TP_SIZES = (1, 2, 4)
RUN_TIMEOUT_S = 60  # one job takes ~5-10 s here

mpi = [pytest.mark.mpi,
       pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec is not in the venv (pip install mpich)")]


def prompt_for(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, ModelConfig().vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def assert_kv_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(a, b)):
        assert ka.dtype == kb.dtype == va.dtype == vb.dtype == torch.float32, layer
        assert torch.equal(ka, kb), f"K of layer {layer} differs"
        assert torch.equal(va, vb), f"V of layer {layer} differs"


@pytest.fixture(scope="module")
def models() -> dict[str, ReferenceModel]:
    return {mode: ReferenceModel(cfg) for mode, cfg in MODES.items()}


@pytest.fixture(scope="module")
def reference(models: dict[str, ReferenceModel]) -> dict[str, dict[str, Any]]:
    """TP=1 in this process: the prompt's 16-chunk prefill and its greedy generation, per mode."""
    prompt = prompt_for(PROMPT_LEN)
    out = {}
    for mode, model in models.items():
        pre = model.prefill(prompt, chunk_tokens=16)
        gen = model.generate_greedy(prompt, NEW_TOKENS)
        out[mode] = {"prompt": prompt, "logits": pre.logits, "kv": pre.kv, "gen": gen}
    return out


# -- (a) run to run -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_same_prompt_gives_same_bits_on_fresh_models_and_any_thread_count(mode: str, reference: dict) -> None:
    ref = reference[mode]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = ReferenceModel(MODES[mode]).prefill(ref["prompt"], chunk_tokens=16)
            assert torch.equal(out.logits, ref["logits"]), f"{n} threads"
            assert_kv_equal(out.kv, ref["kv"])
    finally:
        torch.set_num_threads(threads)
    assert ref["logits"].dtype == torch.float32 and ref["logits"].shape == (PROMPT_LEN, 1024)


# -- (b) chunking and fed-back KV --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_any_chunking_gives_the_same_logits_and_kv(mode: str, models: dict) -> None:
    model = models[mode]
    prompt = prompt_for(200, seed=2)  # one 200-row forward vs 16-row ones: different BLAS blocking
    whole = model.forward_chunk(prompt)
    for chunk in (16, 7, 64, 1):
        out = model.prefill(prompt, chunk_tokens=chunk)
        assert torch.equal(out.logits, whole.logits), f"chunks of {chunk}"
        assert_kv_equal(out.kv, whole.kv)


@pytest.mark.parametrize("mode", MODES)
def test_chunks_fed_back_past_kv_equal_the_same_forward(mode: str, models: dict, reference: dict) -> None:
    """Each 16-token chunk run alone on past KV handed back as tensors (the cached/remote-prefix path)."""
    model, ref = models[mode], reference[mode]
    whole = model.forward_chunk(ref["prompt"])  # the past KV comes from this other forward
    logits, kvs = [], []
    for start in range(0, PROMPT_LEN, 16):
        past = slice_kv(whole.kv, tokens=slice(0, start)) if start else None
        out = model.forward_chunk(ref["prompt"][start:start + 16], start, past)
        logits.append(out.logits)
        kvs.append(out.kv)
    assert torch.equal(torch.cat(logits), ref["logits"])
    assert torch.equal(torch.cat(logits), whole.logits)
    assert_kv_equal(concat_kv(kvs), ref["kv"])


@pytest.mark.parametrize("mode", MODES)
def test_generation_on_a_prefix_kv_from_elsewhere_matches_the_recompute(mode: str, reference: dict) -> None:
    ref = reference[mode]
    other = ReferenceModel(MODES[mode])  # another "worker" computed the prefix blocks
    prefix_kv = other.prefill(ref["prompt"][:PREFIX_LEN]).kv
    gen = ReferenceModel(MODES[mode]).generate_greedy(ref["prompt"], NEW_TOKENS, past_kv=prefix_kv)
    assert gen.tokens == ref["gen"].tokens
    assert torch.equal(gen.logits, ref["gen"].logits)
    assert_kv_equal(gen.kv, ref["gen"].kv)
    # the generation's prompt KV is the prefill's, and greedy means argmax of the last prompt logits
    assert_kv_equal(slice_kv(gen.kv, tokens=slice(0, PROMPT_LEN)), ref["kv"])
    assert gen.tokens[0] == int(torch.argmax(ref["logits"][-1]))


def test_linear_is_exact_however_the_reduction_is_split_or_batched() -> None:
    """The designed property behind (b) and (c), on inputs whose float64 sums would otherwise depend on order."""
    gen = torch.Generator().manual_seed(3)
    scales = 2.0 ** torch.randint(-14, 6, (37, 512), generator=gen)  # wide dynamic range
    x = torch.randn(37, 512, generator=gen, dtype=torch.float64) * scales
    w = torch.round(torch.randn(512, 96, generator=gen, dtype=torch.float64) * 2.0**W_FRAC_BITS / 23) / 2.0**W_FRAC_BITS
    full = _linear(x, w)
    for parts in (2, 4, 8):  # row-parallel shards of TP=parts, added in reverse rank order
        k = 512 // parts
        partials = [_linear(x[:, r * k:(r + 1) * k], w[r * k:(r + 1) * k]) for r in range(parts)]
        assert torch.equal(sum(reversed(partials[1:]), partials[0]), full), parts
    assert torch.equal(torch.cat([_linear(x[i:i + 1], w) for i in range(37)]), full)  # one row at a time
    assert torch.equal(torch.cat([_linear(x[:5], w), _linear(x[5:], w)]), full)
    xq = _to_act_grid(x)
    assert torch.equal((xq.unsqueeze(2) * w.unsqueeze(0)).flip(1).sum(1), full)  # no BLAS, another order


def test_exp_lands_on_the_probability_grid() -> None:
    x = torch.tensor([0.0, -1e-9, -0.5, -3.0, -13.0, -15.0, -100.0, -float("inf")], dtype=torch.float32)
    p = _exp_on_prob_grid(x.clone())
    assert p[0].item() == 2.0**PROB_BITS  # a row's max has probability exactly 1
    assert p[-3:].tolist() == [0.0, 0.0, 0.0]  # below the grid, and masked keys
    assert torch.equal(p, torch.round(p))
    want = torch.round(torch.exp(x.double()) * 2.0**PROB_BITS)
    assert (p.double() - want).abs().max().item() <= 3  # an exp, within a few grid units


# -- configs and shards ------------------------------------------------------------------------


class _StubComm:
    """Just enough of an mpi4py communicator for a constructor that must fail before any collective."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def Get_rank(self) -> int:  # mpi4py's name
        return self._rank

    def Get_size(self) -> int:
        return self._size


def test_kv_heads_not_divisible_by_tp_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"num_kv_heads=4 is not divisible by tp_size=3: each TP rank must own "
                                          r"whole kv heads"):
        ReferenceModel(ModelConfig(), TpComm(_StubComm(0, 3)))
    with pytest.raises(ConfigError, match=r"num_kv_heads=4 is not divisible by tp_size=8"):
        shard_for(ModelConfig(num_q_heads=16), 0, 8)
    # MLA replicates its one latent head, so only the query heads must divide
    assert shard_for(ModelConfig.mla_default(), 7, 8).kv_heads == range(1)
    with pytest.raises(ConfigError, match=r"num_q_heads=8 is not divisible by tp_size=3"):
        shard_for(ModelConfig.mla_default(), 0, 3)


def test_shards_follow_the_head_ranges() -> None:
    s = shard_for(ModelConfig(), 1, 2)
    assert (s.q_heads, s.kv_heads, s.mlp, s.vocab) == (range(4, 8), range(2, 4), range(256, 512), range(512, 1024))
    s = shard_for(ModelConfig(), 3, 4)
    assert (s.q_heads, s.kv_heads) == (range(6, 8), range(3, 4))


def test_configs_that_would_break_exactness_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_positions=8192"):
        ModelConfig(max_positions=8192)
    with pytest.raises(ConfigError, match="mlp_hidden=4096"):
        ModelConfig(mlp_hidden=4096)
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        ModelConfig(mla=True)
    with pytest.raises(ConfigError, match="num_q_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig(num_q_heads=6)
    assert weights_model_id(ModelConfig()) != weights_model_id(ModelConfig(seed=1))


def test_the_model_id_is_the_digest_of_every_weight_element_and_not_of_the_rank() -> None:
    """The reference engine's weights are its checkpoint: one element of one tensor changes its identity."""
    from remote_g2.adapters.reference.weights import full_weights, weights_digest
    from remote_g2.identity.model_identity import identity_of, model_id_for

    c = ModelConfig(num_layers=2, vocab_size=256, max_positions=512)
    full = full_weights(c)
    assert weights_model_id(c) == model_id_for("reference-gqa", weights_digest(full), dataclasses.asdict(c))
    assert weights_model_id(c).startswith("reference-gqa#w-")
    base = weights_digest(full)
    for name, index in (("layers.1.wk", (3, 5)), ("tok_emb", (0, 0)), ("final_norm", (c.hidden - 1,))):
        t = full[name].clone()
        t[index] = torch.nextafter(t[index], torch.tensor(math.inf, dtype=t.dtype))  # one ulp, one element
        assert weights_digest({**full, name: t}) != base, name
    # shards of the same full tensors on every rank: the identity does not depend on the TP layout
    assert weights_model_id(ReferenceModel(c).config) == weights_model_id(c)
    assert identity_of(weights_model_id(ModelConfig(num_layers=2, vocab_size=256, max_positions=512, rms_eps=1e-6))) \
        != identity_of(weights_model_id(c))  # no weight changed, but K and V do


def test_past_kv_of_the_wrong_shape_is_refused(models: dict, reference: dict) -> None:
    kv = slice_kv(reference["gqa"]["kv"], tokens=slice(0, 16))
    with pytest.raises(ValueError, match=r"\(4, 16, 32\)"):
        models["gqa"].forward_chunk([1], 16, slice_kv(kv, heads=slice(0, 2)))  # a TP=2 rank's slice
    with pytest.raises(ValueError, match="start_pos"):
        models["gqa"].forward_chunk([1], 17, kv)
    with pytest.raises(ValueError, match="float32"):
        models["gqa"].forward_chunk([1], 16, [(k.double(), v) for k, v in kv])


# -- (c) across TP sizes, real ranks -----------------------------------------------------------


@pytest.fixture(scope="module")
def tp_runs(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[dict]]]:
    """``{tp: {mode: [rank 0's results, rank 1's, ...]}}`` from one ``mpiexec -n tp`` job per TP size."""
    if not MPIEXEC.exists():
        pytest.skip("mpiexec is not in the venv (pip install mpich)")
    ref_dir = tmp_path_factory.mktemp("ref")
    (ref_dir / "modes.json").write_text(json.dumps(list(MODES)))
    for mode, ref in reference.items():
        torch.save({"config": dataclasses.asdict(MODES[mode]), "prompt": ref["prompt"], "prefix_len": PREFIX_LEN,
                    "new_tokens": NEW_TOKENS, "kv": ref["kv"]}, ref_dir / f"{mode}.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs: dict[int, dict[str, list[dict]]] = {}
    for tp in TP_SIZES:
        out = tmp_path_factory.mktemp(f"tp{tp}")
        cmd = [str(MPIEXEC), "-n", str(tp), sys.executable, str(RANK_SCRIPT), "--ref", str(ref_dir), "--out", str(out)]
        run_ranks(cmd, env)
        runs[tp] = {mode: [torch.load(out / f"{mode}-rank{r}.pt", weights_only=False) for r in range(tp)]
                    for mode in MODES}
    return runs


def run_ranks(cmd: list[str], env: dict[str, str]) -> None:
    """Run an mpiexec job in its own session; on timeout kill the whole group (mpiexec, proxies, ranks)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:3])} did not finish within {RUN_TIMEOUT_S} s:\n{log[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd[:3])} failed (rc={proc.returncode}):\n{log[-3000:]}"


def tp_params() -> list:
    return [pytest.param(tp, mode, id=f"tp{tp}-{mode}", marks=mpi) for tp in TP_SIZES for mode in MODES]


@pytest.mark.parametrize(("tp", "mode"), tp_params())
def test_tp_shards_and_kv_shapes(tp: int, mode: str, tp_runs: dict) -> None:
    cfg = MODES[mode]
    d, kvh = cfg.head_dim, cfg.num_kv_heads
    lq, lkv = cfg.num_q_heads // tp, (1 if cfg.mla else kvh // tp)
    for r, rank in enumerate(tp_runs[tp][mode]):
        assert (rank["rank"], rank["size"]) == (r, tp)
        assert rank["kv_heads"] == ([0, 1] if cfg.mla else [r * lkv, (r + 1) * lkv])
        assert rank["shard_shapes"] == {
            "wqkv": [cfg.hidden, (lq + 2 * lkv) * d], "wo": [lq * d, cfg.hidden],
            "w_up": [cfg.hidden, cfg.mlp_hidden // tp], "w_down": [cfg.mlp_hidden // tp, cfg.hidden],
            "lm_head": [cfg.hidden, cfg.vocab_size // tp]}
        for k, v in rank["kv"]:
            assert k.shape == v.shape == (lkv, PROMPT_LEN, d) and k.is_contiguous() and v.is_contiguous()
        assert np.array_equal(rank["allgather_np"], np.array([[q, q + 0.5] for q in range(tp)]))
        assert torch.equal(rank["allgather_torch"],
                           torch.arange(tp, dtype=torch.float32).reshape(tp, 1, 1).expand(tp, 2, 3))


@pytest.mark.parametrize(("tp", "mode"), tp_params())
def test_tp_logits_equal_tp1_logits_on_every_rank(tp: int, mode: str, tp_runs: dict, reference: dict) -> None:
    ref = reference[mode]
    for rank in tp_runs[tp][mode]:
        assert torch.equal(rank["prefill_logits"], ref["logits"]), f"rank {rank['rank']}"
        assert torch.equal(rank["prefill_logits_again"], ref["logits"]), f"rank {rank['rank']}, second run"
        assert rank["gen_tokens"] == ref["gen"].tokens
        assert torch.equal(rank["gen_logits"], ref["gen"].logits)


@pytest.mark.parametrize(("tp", "mode"), tp_params())
def test_tp_rank_kv_is_exactly_its_heads_of_the_tp1_kv(tp: int, mode: str, tp_runs: dict, reference: dict) -> None:
    ref = reference[mode]
    for rank in tp_runs[tp][mode]:
        heads = slice(*rank["kv_heads"])
        assert_kv_equal(rank["kv"], slice_kv(ref["kv"], heads=heads))
        assert_kv_equal(rank["gen_kv"], slice_kv(ref["gen"].kv, heads=heads))


@pytest.mark.parametrize(("tp", "mode"), tp_params())
def test_tp_target_reading_tp1_prefix_kv_matches_recompute(tp: int, mode: str, tp_runs: dict,
                                                           reference: dict) -> None:
    ref = reference[mode]
    for rank in tp_runs[tp][mode]:
        assert rank["reuse_tokens"] == ref["gen"].tokens, f"rank {rank['rank']}"
        assert torch.equal(rank["reuse_logits"], ref["gen"].logits)
        assert_kv_equal(rank["reuse_kv"], slice_kv(ref["gen"].kv, heads=slice(*rank["kv_heads"])))


@pytest.mark.parametrize(("tp", "mode"), tp_params())
def test_tp1_target_reading_a_tp_n_source_prefix_kv_matches_recompute(tp: int, mode: str, tp_runs: dict,
                                                                      reference: dict, models: dict) -> None:
    ranks = tp_runs[tp][mode]
    if MODES[mode].mla:  # replicated: read every block from one source rank (here the last)
        source_kv = ranks[-1]["kv"]
    else:  # each source rank holds a head range; a TP=1 target puts them side by side
        source_kv = [(torch.cat([r["kv"][i][0] for r in ranks]), torch.cat([r["kv"][i][1] for r in ranks]))
                     for i in range(MODES[mode].num_layers)]
    gen = models[mode].generate_greedy(reference[mode]["prompt"], NEW_TOKENS,
                                       past_kv=slice_kv(source_kv, tokens=slice(0, PREFIX_LEN)))
    assert gen.tokens == reference[mode]["gen"].tokens
    assert torch.equal(gen.logits, reference[mode]["gen"].logits)
    assert_kv_equal(gen.kv, reference[mode]["gen"].kv)
