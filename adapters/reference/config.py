"""The reference model's shape and seed (:class:`ModelConfig`), its TP shards, and the exactness grids.

The grids are the fixed-point steps every matmul input is snapped to (:mod:`.model`'s docstring, "How it
is made exact"): a config is valid only when the longest reduction over them stays below ``2**53`` grid
units, which :class:`ModelConfig` checks when it is made. :mod:`.weights` makes a config's weights on the
weight grid; :mod:`.model` runs them. This module imports neither.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from remote_g2.errors import ConfigError

__all__ = [
    "ACT_FRAC_BITS", "ACT_INT_BITS", "ACT_MAX", "EXACT", "KV", "KV_DTYPE", "PROB_BITS", "W_FRAC_BITS", "W_MAX",
    "ModelConfig", "TpShard", "shard_for",
]

#: Activations entering a matmul are multiples of 2**-ACT_FRAC_BITS ...
ACT_FRAC_BITS = 16
#: ... that are integers below 2**ACT_INT_BITS in magnitude in those units (|x| < 64), saturating.
ACT_INT_BITS = 22
#: Attention probabilities are integers in [0, 2**PROB_BITS] (units of 2**-PROB_BITS).
PROB_BITS = 19
#: The dtype K/V are returned in and taken back as (exact: ACT_INT_BITS <= 24).
KV_DTYPE = torch.float32

ACT_MAX = float(2**ACT_INT_BITS - 1)
EXACT = 2**53  # float64 holds every integer up to here exactly

#: Weight matrices are multiples of 2**-W_FRAC_BITS with |w| < 1.
W_FRAC_BITS = 20
W_MAX = float(2**W_FRAC_BITS - 1)

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (K, V), each ``[kv_heads_of_this_rank, tokens, head_dim]`` float32."""


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and seed; equal configs give bit-equal weights on every rank and machine.

    ``mla=True`` needs ``num_kv_heads == 1`` (see :meth:`mla_default`). The
    constructor rejects sizes for which the exactness bounds of the module
    docstring do not hold (a reduction longer than the grids allow).
    """

    vocab_size: int = 1024
    hidden: int = 256
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    mlp_hidden: int = 512
    max_positions: int = 4096
    mla: bool = False
    seed: int = 0
    rms_eps: float = 1e-5

    @classmethod
    def mla_default(cls, **overrides: object) -> ModelConfig:
        """The MLA-like defaults: one replicated latent kv head of dim 64."""
        return cls(**{"mla": True, "num_kv_heads": 1, "head_dim": 64, **overrides})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v, least = getattr(self, f.name), (0 if f.name == "seed" else 1)
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise ConfigError(f"ModelConfig.{f.name} must be an int >= {least}, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.mla and self.num_kv_heads != 1:
            raise ConfigError(f"mla=True means one latent kv head replicated on every rank; "
                              f"got num_kv_heads={self.num_kv_heads} (use ModelConfig.mla_default())")
        # The exactness bounds (module docstring, points 1-3); integers in units of the grids.
        longest = max((self.hidden, "hidden"), (self.num_q_heads * self.head_dim, "num_q_heads*head_dim"),
                      (self.mlp_hidden, "mlp_hidden"))
        bounds = [
            (longest[0] * ACT_MAX * W_MAX, f"a linear layer's reduction over {longest[1]}={longest[0]}"),
            (self.head_dim * ACT_MAX * ACT_MAX, f"q.k over head_dim={self.head_dim}"),
            (self.max_positions * 2.0**PROB_BITS * ACT_MAX, f"p.V over max_positions={self.max_positions}"),
        ]
        for worst, what in bounds:
            if worst > EXACT:
                raise ConfigError(f"{what} could exceed 2**53 grid units, so float64 sums would round and "
                                  f"bit-exactness across TP sizes and chunkings would be lost")

    @property
    def q_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class TpShard:
    """What rank ``rank`` of ``size`` owns, as global index ranges.

    ``kv_heads`` is ``range(0, 1)`` on every rank in MLA mode (replicated).
    """

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    mlp: range
    vocab: range


def shard_for(config: ModelConfig, rank: int, size: int) -> TpShard:
    """Rank ``rank``'s slices of a TP group of ``size``; ConfigError when the sizes do not divide."""
    if not 0 <= rank < size:
        raise ConfigError(f"TP rank {rank} is outside a group of {size}")

    def split(total: int, what: str, why: str) -> range:
        if total % size:
            raise ConfigError(f"{what}={total} is not divisible by tp_size={size}: {why}")
        n = total // size
        return range(rank * n, (rank + 1) * n)

    if config.mla:
        kv = range(1)
    else:
        kv = split(config.num_kv_heads, "num_kv_heads",
                   "each TP rank must own whole kv heads (rank r owns [r*kv_heads/tp, (r+1)*kv_heads/tp))")
    q = split(config.num_q_heads, "num_q_heads", "each TP rank must own whole query heads")
    return TpShard(rank, size, q, kv,
                   split(config.mlp_hidden, "mlp_hidden", "the MLP is column/row-parallel over it"),
                   split(config.vocab_size, "vocab_size", "the LM head is split by vocabulary"))
