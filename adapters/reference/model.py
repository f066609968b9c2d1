"""A tiny decoder-only transformer with real tensor parallelism and bit-exact, TP-invariant KV and logits.

The reference engine needs a model whose KV is worth moving: a TP=1 target
that reads prefix KV computed by a TP=2 source must produce exactly the bits
a TP=1 recompute would. This module is that model (random weights from a
seed, torch on CPU, sharded over an mpi4py communicator by :mod:`.tp`).

Architecture
------------
Token + learned position embeddings; ``num_layers`` pre-norm blocks of
RMSNorm → causal self-attention (GQA: ``num_q_heads`` query heads share
``num_kv_heads`` kv heads) → RMSNorm → MLP (up, ReLU, down); final RMSNorm;
LM head. ``mla=True`` is the MLA-like mode: one latent kv "head"
(``num_kv_heads == 1``) shared by every query head and *replicated* on every
TP rank, which is the cache property that matters to transfer planning
(every rank holds the same bytes for a block).

Tensor parallelism (rank ``r`` of ``tp``)
-----------------------------------------
Every rank builds the full weights from the seed and keeps its shard:
q/k/v projections column-parallel by heads (rank ``r`` owns kv heads
``[r*kvh/tp, (r+1)*kvh/tp)`` and the query heads that attend to them; in MLA
mode the latent k/v projections are replicated and every rank computes the
latent KV in full), the attention output projection and the MLP
down-projection row-parallel, the MLP up-projection column-parallel, the LM
head split by vocabulary (logits are gathered, so every rank returns the
full vocabulary). The embeddings and norms are replicated.

The bit-exactness contract
--------------------------
For a fixed :class:`ModelConfig`, the logits of token ``i`` and the K/V of
token ``i`` in kv head ``h`` are a function of ``token_ids[:i+1]`` only.
They are bit-identical

(a) on every run and in every process, with any torch thread count (no
    result depends on the BLAS kernel, the SIMD width or the threading),
(b) however the prompt is cut into chunks — one chunk, block-aligned chunks
    of 16, ragged chunks, token by token — and whether the earlier tokens'
    KV was computed by this forward or fed back in as ``past_kv`` (from this
    rank's cache, or read from another worker),
(c) for every TP size that divides the heads: rank ``r``'s KV is exactly
    heads ``kv_head_range`` of the TP=1 KV, and the logits are the same on
    every rank and for every TP size.

So an engine may prefill in any chunking; prefilling in chunks aligned to
its block boundaries (as the reference engine does) is not required for
exactness. KV must be stored and handed back as the float32 bits returned
(every K/V value is exactly representable in float32, see below).

How it is made exact (designed in, not hoped for)
-------------------------------------------------
Float addition is not associative, and every place where the *order* of a
sum could depend on TP size (row-parallel partial sums), on the number of
rows in the batch (BLAS blocking, threads splitting a reduction) or on the
number of keys (chunked vs. whole attention) is made order-free:

1. **Every matmul is exact.** Its inputs are snapped to fixed-point grids
   before it: activations to multiples of ``2**-ACT_FRAC_BITS`` with
   ``|x| < 2**(ACT_INT_BITS - ACT_FRAC_BITS)`` (saturating), weights to
   multiples of ``2**-W_FRAC_BITS`` with ``|w| < 1``. Every product is then an
   integer multiple of ``2**-(ACT_FRAC_BITS + W_FRAC_BITS)`` and every partial
   sum of ``K`` products is such an integer below ``2**53`` in magnitude
   (checked for the configured sizes by :class:`ModelConfig`), so float64
   represents each partial sum exactly: any summation order, any BLAS kernel,
   any blocking, FMA or not, gives the same exact result.
2. **Row-parallel reductions are exact too.** Each rank's partial product
   is exact by (1); the ranks allgather the float64 partials and add them in
   rank order, and since the full sum obeys the same ``2**53`` bound, that
   sum is exact — equal to the TP=1 matmul. (This is stronger than adding
   fixed-size chunks in global order: no order matters at all.)
3. **Attention is exact except for elementwise steps.** q and k are on the
   activation grid, so the scores are exact; the row max is exact; the
   probabilities are ``round(exp(s - max) * 2**PROB_BITS)`` — integers — so
   the softmax denominator and the probability-weighted sum of V (V on the
   activation grid) are exact sums; the output is ``num / den``, one
   correctly rounded division. Masked keys get probability exactly 0, so a
   query's result does not depend on how many keys (chunk and past) are
   present.
4. **No transcendental library call** whose result could depend on where an
   element sits in a tensor (torch's vectorized loops send the tail of a
   tensor through scalar code, and vector and scalar ``exp`` may differ in
   the last bit). ``exp`` is evaluated with + and * only (a polynomial and
   repeated squaring); the MLP uses ReLU; RMSNorm uses ``sqrt`` and
   division — every one of them correctly rounded by IEEE 754, so each
   element's result depends only on its inputs.
5. **The one non-matmul reduction**, RMSNorm's sum of squares, is summed in
   a fixed binary tree of elementwise adds (pair ``i`` with ``i + n/2``, then
   halve), so the order is fixed by construction, per row.
6. **K/V are float32-exact**: K and V are on the activation grid with at most
   ``ACT_INT_BITS <= 24`` significant bits, so returning them as float32 and
   reading them back as ``past_kv`` loses nothing.

What this costs
---------------
Semantics: this is a fixed-point-activation transformer. Matmul inputs carry
16 fractional bits and saturate at ``|x| >= 64`` (deterministically; with
these weights activations stay far below), attention probabilities have 19
fractional bits, and ``max_positions`` is at most 4096 for the ``p.V`` bound.
That is plenty for a random-weight reference model and changes nothing in
the KV layout an engine sees.

Time: float64 matmuls and ~25 elementwise passes over the attention scores.
A 2048-token prompt prefilled in 16-token chunks takes ≈ 2.9–3.5 s at TP=1
(2 threads) and ≈ 2.4–3.1 s at TP=2 (one thread per rank) on the 2-core
development VM, against ≈ 1.5–2.4 s for a plain float32 model of the same
shapes (torch SDPA) — about 1.5–2× for exactness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .config import (
    ACT_FRAC_BITS,
    ACT_MAX,
    KV,
    KV_DTYPE,
    PROB_BITS,
    ModelConfig,
    shard_for,
)
from .tp import TpComm
from .weights import full_weights, remember_digest

__all__ = ["ChunkOutput", "Generation", "ReferenceModel", "SequenceCache", "concat_kv", "slice_kv"]

# exp(u) Taylor coefficients, highest degree first (see _exp_on_prob_grid).
_EXP_COEFFS = tuple(1.0 / math.factorial(k) for k in range(6, -1, -1))


class ChunkOutput(NamedTuple):
    """``logits``: ``[tokens, vocab]`` float32, identical on every rank; ``kv``: this rank's new K/V."""

    logits: torch.Tensor
    kv: KV


@dataclass
class SequenceCache:
    """One sequence's float64 working KV on this rank (see :meth:`ReferenceModel.begin_sequence`).

    ``buffers[layer] = (K, V)``, each ``[local_kv_heads, capacity, head_dim]``;
    positions ``< length`` are filled.
    """

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    length: int
    capacity: int


class Generation(NamedTuple):
    """A greedy generation: the new tokens, the logits each was picked from, the KV of every fed token."""

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab] float32
    kv: KV  # prompt + tokens[:-1] (the last token was never fed)


def concat_kv(parts: Sequence[KV | None]) -> KV | None:
    """Concatenate per-chunk KV along tokens (``None`` parts skipped; all None → None)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return [(torch.cat([p[i][0] for p in parts], dim=1), torch.cat([p[i][1] for p in parts], dim=1))
            for i in range(len(parts[0]))]


def slice_kv(kv: KV, *, tokens: slice = slice(None), heads: slice = slice(None)) -> KV:
    """A contiguous copy of ``kv[:, heads, tokens]`` for every layer (e.g. a rank's heads, a prefix)."""
    return [(k[heads, tokens].contiguous(), v[heads, tokens].contiguous()) for k, v in kv]


# -- exact building blocks ---------------------------------------------------------------------


def _to_act_grid(x: torch.Tensor) -> torch.Tensor:
    """``x`` snapped to the activation grid (round half to even, saturating): exact float64 values."""
    scale = float(2**ACT_FRAC_BITS)
    return torch.round(x * scale).clamp_(-ACT_MAX, ACT_MAX).mul_(1.0 / scale)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``grid(x) @ w`` in float64: exact (module docstring, point 1), so independent of rows and blocking."""
    return _to_act_grid(x) @ w


def _fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed binary tree of elementwise adds (no reduction kernel)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.nn.functional.pad(x, (0, 1))  # + 0.0 changes nothing
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    mean_sq = _fixed_order_sum(x * x) * (1.0 / x.shape[-1])
    return x / torch.sqrt(mean_sq + eps).unsqueeze(-1) * gain


def _exp_on_prob_grid(x: torch.Tensor) -> torch.Tensor:
    """``round(exp(x) * 2**PROB_BITS)`` for float32 ``x <= 0`` (``-inf`` → 0), in place; float32 integers.

    Only correctly rounded elementwise ops, no library ``exp`` (module
    docstring, point 4): ``exp(x) = exp(x/64)**64``, with ``exp(u)`` for
    ``u in [-1/4, 0]`` by a degree-6 Taylor polynomial in Horner form, then
    six squarings; relative error a few 1e-6 (within ~2 units of the
    ``2**-PROB_BITS`` grid). ``x`` is clamped at -16 first: ``exp(-16) *
    2**19 < 0.5`` rounds to 0, like everything below it. ``exp(0)`` lands on
    exactly ``2**PROB_BITS`` (the polynomial is exactly 1 at 0), so every
    row's maximum has probability exactly 1 and no denominator is 0. Each
    step is its own kernel, so nothing can be fused into an FMA on one code
    path and not on another; float32 halves the memory traffic and is as
    deterministic as float64. The integers it returns (<= 2**19) are exact in
    float32.
    """
    u = x.clamp_(min=-16.0).mul_(1.0 / 64)
    acc = u * _EXP_COEFFS[0]
    for c in _EXP_COEFFS[1:-1]:
        acc.add_(c).mul_(u)
    acc.add_(_EXP_COEFFS[-1])
    for _ in range(6):
        acc.mul_(acc)
    return acc.mul_(float(2**PROB_BITS)).round_()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Causal attention of a chunk's queries over all keys so far.

    ``q``: ``[q_heads, T, d]`` at positions ``start_pos..start_pos+T-1``;
    ``k``/``v``: ``[kv_heads, start_pos+T, d]``; all float64 on the
    activation grid. Returns ``[T, q_heads*d]`` float64. Exact except the
    elementwise steps (module docstring, point 3): a query's output depends
    only on the keys at or before its position, never on how many other keys
    or queries are present.
    """
    q_heads, t, d = q.shape
    kv_heads = k.shape[0]
    group = q_heads // kv_heads
    qg = q.reshape(kv_heads, group * t, d)  # the query heads of one kv head are adjacent
    scores = torch.bmm(qg, k.transpose(1, 2))  # exact
    # Only the chunk's own keys can lie in a query's future; the past is visible to all.
    future = (torch.arange(t).unsqueeze(0) > torch.arange(t).unsqueeze(1)).repeat(group, 1)  # [group*T, T]
    scores[:, :, start_pos:].masked_fill_(future, -math.inf)
    top = scores.amax(dim=-1, keepdim=True)  # exact: max is order-free
    x = scores.sub_(top).to(torch.float32).mul_(1.0 / math.sqrt(d))  # s - max is exact; then rounded
    p = _exp_on_prob_grid(x).to(torch.float64)  # integers in [0, 2**PROB_BITS]; masked keys exactly 0
    num = torch.bmm(p, v)  # exact: integers times grid values
    den = p.sum(dim=-1, keepdim=True)  # exact: integers
    out = num.div_(den)  # [kv_heads, group*T, d]
    return out.reshape(q_heads, t, d).transpose(0, 1).reshape(t, q_heads * d)


# -- the model --------------------------------------------------------------------------------


class ReferenceModel:
    """This rank's shard of the reference transformer (see the module docstring for the contract).

    ``tp`` is the TP group (default: a group of one, no MPI). Construction
    makes no MPI call; :meth:`forward_chunk` makes ``2 * num_layers + 1``
    allgathers when ``tp.size > 1``, so every rank of the group must run the
    same forwards in the same order. Not thread-safe (one forward at a time).
    """

    def __init__(self, config: ModelConfig | None = None, tp: TpComm | None = None) -> None:
        self.config = config or ModelConfig()
        self.tp = tp or TpComm()
        self.shard = shard_for(self.config, self.tp.rank, self.tp.size)
        self._build_weights()

    # -- layout facts the engine needs ----------------------------------------------------

    @property
    def kv_head_range(self) -> range:
        """Global kv heads whose K/V this rank computes and holds (MLA: ``range(0, 1)``, on every rank)."""
        return self.shard.kv_heads

    @property
    def local_kv_heads(self) -> int:
        return len(self.shard.kv_heads)

    # -- weights --------------------------------------------------------------------------

    def _build_weights(self) -> None:
        c, s = self.config, self.shard
        d = c.head_dim
        q_cols = slice(s.q_heads.start * d, s.q_heads.stop * d)
        kv_cols = slice(s.kv_heads.start * d, s.kv_heads.stop * d)
        mlp = slice(s.mlp.start, s.mlp.stop)
        full = full_weights(c)
        remember_digest(c, full)  # the identity of exactly these tensors, for the fingerprint
        self.tok_emb = full["tok_emb"]
        self.pos_emb = full["pos_emb"]
        self.final_norm = 1.0 + full["final_norm"]
        self.lm_head = full["lm_head"][:, s.vocab.start:s.vocab.stop].contiguous()
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(c.num_layers):
            def w(name: str, i: int = i) -> torch.Tensor:
                return full[f"layers.{i}.{name}"]

            self.layers.append({
                "attn_norm": 1.0 + w("attn_norm"),
                # one matmul for q|k|v: the columns are independent dot products, exact either way
                "wqkv": torch.cat([w("wq")[:, q_cols], w("wk")[:, kv_cols], w("wv")[:, kv_cols]], dim=1).contiguous(),
                "wo": w("wo")[q_cols].contiguous(),
                "mlp_norm": 1.0 + w("mlp_norm"),
                "w_up": w("w_up")[:, mlp].contiguous(),
                "w_down": w("w_down")[mlp].contiguous(),
            })

    def shard_shapes(self) -> dict[str, list[int]]:
        """Shapes of this rank's weight shards (layer 0) — for tests and logs."""
        layer = self.layers[0]
        return {"wqkv": list(layer["wqkv"].shape), "wo": list(layer["wo"].shape),
                "w_up": list(layer["w_up"].shape), "w_down": list(layer["w_down"].shape),
                "lm_head": list(self.lm_head.shape)}

    # -- forward --------------------------------------------------------------------------

    def _row_parallel(self, x_local: torch.Tensor, w_local: torch.Tensor) -> torch.Tensor:
        """``x @ w`` for a row-parallel ``w``: exact partials, gathered, added in rank order (still exact)."""
        partial = _linear(x_local, w_local)
        if self.tp.size == 1:
            return partial
        parts = self.tp.allgather(partial)
        total = parts[0].clone()
        for r in range(1, self.tp.size):
            total += parts[r]
        return total

    def _check_past(self, past_kv: KV | None, start_pos: int) -> None:
        c = self.config
        if past_kv is None:
            if start_pos:
                raise ValueError(f"start_pos={start_pos} but no past_kv")
            return
        if len(past_kv) != c.num_layers:
            raise ValueError(f"past_kv has {len(past_kv)} layers, the model {c.num_layers}")
        want = (self.local_kv_heads, start_pos, c.head_dim)
        for i, (k, v) in enumerate(past_kv):
            for name, t in (("K", k), ("V", v)):
                if tuple(t.shape) != want or t.dtype != KV_DTYPE:
                    raise ValueError(f"past_kv layer {i} {name} is {tuple(t.shape)} {t.dtype}; this rank needs "
                                     f"{want} {KV_DTYPE} ([local_kv_heads, start_pos, head_dim])")

    def forward_chunk(self, token_ids: Sequence[int] | torch.Tensor, start_pos: int = 0,
                      past_kv: KV | None = None) -> ChunkOutput:
        """Run tokens at positions ``start_pos..`` given this rank's KV of positions ``0..start_pos-1``.

        ``past_kv``: per layer ``(K, V)``, each ``[local_kv_heads, start_pos,
        head_dim]`` float32 (None when ``start_pos == 0``), exactly as returned
        by earlier forwards — of this rank, or of any rank/TP size holding the
        same heads. Returns the chunk's logits ``[T, vocab]`` (float32, full
        vocabulary, identical on every rank) and the chunk's K/V in the same
        layout ``[local_kv_heads, T, head_dim]``. Collective when TP > 1.
        Bit-exact in the sense of the module docstring (a)-(c).
        """
        ids = self._check_ids(token_ids, start_pos)
        self._check_past(past_kv, start_pos)
        cache = self._new_cache(start_pos + ids.numel(), past_kv)
        return self._forward(ids, start_pos, cache)

    def _check_ids(self, token_ids: Sequence[int] | torch.Tensor, start_pos: int) -> torch.Tensor:
        c = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("a forward needs at least one token")
        if start_pos < 0 or start_pos + ids.numel() > c.max_positions:
            raise ValueError(f"positions {start_pos}..{start_pos + ids.numel() - 1} are outside "
                             f"0..{c.max_positions - 1}")
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"token ids must be in [0, {c.vocab_size})")
        return ids

    def _new_cache(self, capacity: int, past_kv: KV | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer float64 K/V buffers ``[local_kv_heads, capacity, head_dim]`` holding ``past_kv`` first.

        Widening float32 → float64 is exact, so the buffers hold the very
        values a forward computed; forwards append in place (no re-copy of
        the past per chunk).
        """
        shape = (self.local_kv_heads, capacity, self.config.head_dim)
        cache = []
        for i in range(self.config.num_layers):
            k, v = torch.empty(shape, dtype=torch.float64), torch.empty(shape, dtype=torch.float64)
            if past_kv is not None:
                n = past_kv[i][0].shape[1]
                k[:, :n] = past_kv[i][0]
                v[:, :n] = past_kv[i][1]
            cache.append((k, v))
        return cache

    def _forward(self, ids: torch.Tensor, start_pos: int,
                 cache: list[tuple[torch.Tensor, torch.Tensor]]) -> ChunkOutput:
        """The forward of ``ids`` at ``start_pos..``; ``cache`` holds positions ``< start_pos`` and gets the new."""
        c, s = self.config, self.shard
        t, end = ids.numel(), start_pos + ids.numel()
        d, lq, lkv = c.head_dim, len(s.q_heads), self.local_kv_heads
        h = self.tok_emb[ids] + self.pos_emb[start_pos:end]
        new_kv: KV = []
        with torch.inference_mode():
            for layer, (k_all, v_all) in zip(self.layers, cache):
                qkv = _to_act_grid(_linear(_rms_norm(h, layer["attn_norm"], c.rms_eps), layer["wqkv"]))
                q = qkv[:, :lq * d].reshape(t, lq, d).transpose(0, 1)
                k = qkv[:, lq * d:(lq + lkv) * d].reshape(t, lkv, d).transpose(0, 1)
                v = qkv[:, (lq + lkv) * d:].reshape(t, lkv, d).transpose(0, 1)
                k_all[:, start_pos:end] = k
                v_all[:, start_pos:end] = v
                new_kv.append((k.to(KV_DTYPE).contiguous(), v.to(KV_DTYPE).contiguous()))  # exact (point 6)
                attn = _attention(q.contiguous(), k_all[:, :end], v_all[:, :end], start_pos)
                h = h + self._row_parallel(attn, layer["wo"])
                up = torch.relu_(_linear(_rms_norm(h, layer["mlp_norm"], c.rms_eps), layer["w_up"]))
                h = h + self._row_parallel(up, layer["w_down"])
            logits = _linear(_rms_norm(h, self.final_norm, c.rms_eps), self.lm_head).to(torch.float32)
            if self.tp.size > 1:  # [tp, T, V/tp] -> [T, V]: vocabulary shards in rank order
                logits = self.tp.allgather(logits).permute(1, 0, 2).reshape(t, c.vocab_size)
        return ChunkOutput(logits, new_kv)

    def _prefill_into(self, ids: torch.Tensor, start_pos: int, cache: list[tuple[torch.Tensor, torch.Tensor]],
                      chunk_tokens: int) -> list[ChunkOutput]:
        """Forward ``ids`` at ``start_pos..`` in chunks that end on multiples of ``chunk_tokens``."""
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        outs = []
        done = 0
        while done < ids.numel():
            pos = start_pos + done
            n = min(chunk_tokens - pos % chunk_tokens, ids.numel() - done)
            outs.append(self._forward(ids[done:done + n], pos, cache))
            done += n
        return outs

    def prefill(self, token_ids: Sequence[int] | torch.Tensor, *, chunk_tokens: int = 16, start_pos: int = 0,
                past_kv: KV | None = None) -> ChunkOutput:
        """Forward ``token_ids`` at ``start_pos..`` in chunks ending on multiples of ``chunk_tokens``.

        The chunks are aligned to absolute positions (a block engine's
        boundaries); the result — every token's logits and the new tokens' KV
        — is bit-identical to any other chunking (module docstring, (b)), and
        faster than calling :meth:`forward_chunk` per chunk (the past KV is
        widened to float64 once, not once per chunk). Collective when TP > 1.
        """
        ids = self._check_ids(token_ids, start_pos)
        self._check_past(past_kv, start_pos)
        outs = self._prefill_into(ids, start_pos, self._new_cache(start_pos + ids.numel(), past_kv), chunk_tokens)
        kv = concat_kv([o.kv for o in outs])
        assert kv is not None
        return ChunkOutput(torch.cat([o.logits for o in outs]), kv)

    def begin_sequence(self, capacity: int, past_kv: KV | None = None) -> SequenceCache:
        """A working cache for one sequence of up to ``capacity`` tokens, holding ``past_kv`` first.

        For an engine that runs a sequence over many steps (chunks of a
        prefill, then one decode token a step): :meth:`extend` appends to it
        in place, so the past is widened to float64 once, not once per step.
        ``past_kv`` is this rank's KV of the first ``n`` positions, as
        :meth:`forward_chunk` takes it (e.g. gathered from paged blocks).
        """
        n = 0 if past_kv is None else int(past_kv[0][0].shape[1])
        self._check_past(past_kv, n)
        if not n <= capacity <= self.config.max_positions:
            raise ValueError(f"capacity {capacity} must be in {n}..{self.config.max_positions}")
        return SequenceCache(self._new_cache(capacity, past_kv), n, capacity)

    def extend(self, seq: SequenceCache, token_ids: Sequence[int] | torch.Tensor, *,
               chunk_tokens: int = 16) -> ChunkOutput:
        """Run ``token_ids`` at positions ``seq.length..`` and append their KV to ``seq``.

        Chunks end on multiples of ``chunk_tokens`` (absolute positions), as
        :meth:`prefill`; the result is bit-identical to any other chunking.
        Collective when TP > 1.
        """
        ids = self._check_ids(token_ids, seq.length)
        if seq.length + ids.numel() > seq.capacity:
            raise ValueError(f"{ids.numel()} tokens at {seq.length} overflow the sequence's capacity {seq.capacity}")
        outs = self._prefill_into(ids, seq.length, seq.buffers, chunk_tokens)
        seq.length += ids.numel()
        kv = concat_kv([o.kv for o in outs])
        assert kv is not None
        return ChunkOutput(torch.cat([o.logits for o in outs]), kv)

    def generate_greedy(self, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int, *,
                        chunk_tokens: int = 16, past_kv: KV | None = None) -> Generation:
        """Greedy decoding: prefill ``prompt``, then feed back the argmax of the last logits, one token a step.

        ``past_kv`` may cover a prefix of the prompt (e.g. blocks read from a
        remote worker); the rest is prefilled in ``chunk_tokens`` chunks
        aligned to absolute positions. Ties in argmax go to the lowest token
        id. Collective when TP > 1.
        """
        ids = self._check_ids(prompt, 0)
        past_len = 0 if past_kv is None else past_kv[0][0].shape[1]
        if past_len >= ids.numel():
            raise ValueError(f"past_kv covers {past_len} tokens; the prompt has {ids.numel()} (one must be fed)")
        self._check_past(past_kv, past_len)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        fed = ids.numel() + max_new_tokens - 1  # the last new token is picked, never fed
        if fed > self.config.max_positions:
            raise ValueError(f"{ids.numel()} prompt + {max_new_tokens - 1} fed tokens exceed "
                             f"max_positions={self.config.max_positions}")
        cache = self._new_cache(fed, past_kv)
        outs = self._prefill_into(ids[past_len:], past_len, cache, chunk_tokens)
        last = outs[-1].logits[-1]
        tokens: list[int] = []
        picked: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            tokens.append(int(torch.argmax(last)))
            picked.append(last)
            if step + 1 == max_new_tokens:
                break
            outs.append(self._forward(torch.tensor([tokens[-1]]), ids.numel() + step, cache))
            last = outs[-1].logits[-1]
        kv = concat_kv([past_kv, *(o.kv for o in outs)])
        assert kv is not None
        return Generation(tokens, torch.stack(picked), kv)
