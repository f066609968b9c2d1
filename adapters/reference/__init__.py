"""The reference engine's model: a tiny TP-sharded transformer whose KV and logits are bit-exact.

* :mod:`.model` — :class:`ModelConfig`, :class:`ReferenceModel` (``forward_chunk``
  over this rank's past KV, ``prefill``, ``generate_greedy``), KV helpers. Its
  docstring states the contract: logits and per-head K/V are bit-identical on
  every run, for every chunking of the prompt (own or fed-back past KV) and
  for every TP size.
* :mod:`.tp` — :class:`TpComm`, rank/size/allgather over an mpi4py
  communicator (or a group of one without MPI).
"""

from .model import (
    KV_DTYPE,
    ChunkOutput,
    Generation,
    ModelConfig,
    ReferenceModel,
    SequenceCache,
    TpShard,
    concat_kv,
    shard_for,
    slice_kv,
)
from .tp import TpComm

__all__ = [
    "KV_DTYPE",
    "ChunkOutput",
    "Generation",
    "ModelConfig",
    "ReferenceModel",
    "SequenceCache",
    "TpComm",
    "TpShard",
    "concat_kv",
    "shard_for",
    "slice_kv",
]
