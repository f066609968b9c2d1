"""The reference engine's model: a tiny TP-sharded transformer whose KV and logits are bit-exact.

* :mod:`.config` — :class:`ModelConfig` (shape, seed, the exactness grids), TP shards.
* :mod:`.weights` — the weights made from the seed, and their digest (the model id).
* :mod:`.model` — :class:`ReferenceModel` (``forward_chunk``
  over this rank's past KV, ``prefill``, ``generate_greedy``), KV helpers. Its
  docstring states the contract: logits and per-head K/V are bit-identical on
  every run, for every chunking of the prompt (own or fed-back past KV) and
  for every TP size.
* :mod:`.tp` — :class:`TpComm`, rank/size/allgather over an mpi4py
  communicator (or a group of one without MPI).

The engine around it (:mod:`.executor`, :mod:`.scheduler`, :mod:`.kv_cache`, :mod:`.server`) and the demo
(:mod:`.demo`, :mod:`.launch`, with :mod:`.netns` for several hosts on one box).

May import: the core, ``source``, ``target``, ``registry`` and ``adapters``' own transfers and pools.
"""

from .config import KV_DTYPE, ModelConfig, TpShard, shard_for
from .model import ChunkOutput, Generation, ReferenceModel, SequenceCache, concat_kv, slice_kv
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
