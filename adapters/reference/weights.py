"""The reference engine's checkpoint: its weights, made from the config's seed, and their identity.

Every rank makes every full (unsharded) tensor from the seed — each from a
generator of its own, seeded from (seed, name), so no tensor shifts another
— and keeps its shard (:mod:`.model`). Those full tensors are the engine's
checkpoint: the fingerprint's model id is a digest of every element of
every one of them and of every config field that changes K or V
(:func:`weights_model_id`; :mod:`remote_g2.identity.model_identity`), so every TP
size of one config shares, and a change to any weight does not.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch

from remote_g2.identity.file_digest import ALGORITHM as DIGEST_ALGORITHM
from remote_g2.identity.file_digest import hasher_for
from remote_g2.identity.model_identity import model_id_for

from .config import W_FRAC_BITS, W_MAX, ModelConfig

__all__ = ["full_weights", "remember_digest", "weights_digest", "weights_model_id"]


def _weight_specs(c: ModelConfig) -> list[tuple[str, tuple[int, ...], float, bool]]:
    """Every full weight tensor: ``(name, shape, std, on the weight grid)``, in the order they are made."""
    d, in_std = c.head_dim, 1.0 / math.sqrt(c.hidden)
    specs = [("tok_emb", (c.vocab_size, c.hidden), 1.0, False), ("pos_emb", (c.max_positions, c.hidden), 0.5, False),
             ("final_norm", (c.hidden,), 0.1, False),
             ("lm_head", (c.hidden, c.vocab_size), 2.0 / math.sqrt(c.hidden), True)]
    for i in range(c.num_layers):
        specs += [(f"layers.{i}.wq", (c.hidden, c.num_q_heads * d), in_std, True),
                  (f"layers.{i}.wk", (c.hidden, c.num_kv_heads * d), in_std, True),
                  (f"layers.{i}.wv", (c.hidden, c.num_kv_heads * d), in_std, True),
                  (f"layers.{i}.attn_norm", (c.hidden,), 0.1, False),
                  (f"layers.{i}.wo", (c.num_q_heads * d, c.hidden), 1.0 / math.sqrt(c.num_q_heads * d), True),
                  (f"layers.{i}.mlp_norm", (c.hidden,), 0.1, False),
                  (f"layers.{i}.w_up", (c.hidden, c.mlp_hidden), in_std, True),
                  (f"layers.{i}.w_down", (c.mlp_hidden, c.hidden), 1.0 / math.sqrt(c.mlp_hidden), True)]
    return specs


def _full_tensor(c: ModelConfig, name: str, shape: tuple[int, ...], std: float, on_grid: bool) -> torch.Tensor:
    """The full tensor ``name``: its own generator seeded from (seed, name), so no other tensor shifts it."""
    gen = torch.Generator().manual_seed((c.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
    w = torch.randn(shape, generator=gen, dtype=torch.float64).mul_(std)
    if on_grid:
        scale = float(2**W_FRAC_BITS)
        w = torch.round(w * scale).clamp_(-W_MAX, W_MAX).mul_(1.0 / scale)
    return w


def full_weights(c: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's checkpoint: every full (unsharded) weight tensor by name, float64, as every rank makes it."""
    return {name: _full_tensor(c, name, shape, std, grid) for name, shape, std, grid in _weight_specs(c)}


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """A digest of every element of every tensor (with its name, dtype and shape): one changed bit changes it."""
    h = hasher_for(DIGEST_ALGORITHM)()
    for name in sorted(weights):
        t = weights[name].contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


_DIGESTS: dict[ModelConfig, str] = {}


def remember_digest(c: ModelConfig, full: dict[str, torch.Tensor]) -> None:
    if c not in _DIGESTS:
        _DIGESTS[c] = weights_digest(full)


def weights_model_id(c: ModelConfig) -> str:
    """``reference-<gqa|mla>#w-…``: the identity of ``c``'s weights and of every field that changes K or V.

    Computed once per config in a process (a model built here already
    digested its tensors; otherwise they are made and digested here).
    """
    if c not in _DIGESTS:
        remember_digest(c, full_weights(c))
    return model_id_for(f"reference-{'mla' if c.mla else 'gqa'}", _DIGESTS[c], dataclasses.asdict(c))
