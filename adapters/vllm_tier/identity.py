"""What a chunk of vLLM's primary CPU tier is, as the registry must match it: the tier's layout fingerprint.

vLLM's ``OffloadKey`` is a block hash and a KV-cache group index; it says
nothing of the model, the weights, the dtype, the chunk size or how the
chunk's row is laid out. Two instances may exchange a chunk only when all of
those agree, so the tier registers under a :class:`LayoutFingerprint` whose
compat key (everything but ``tp_size``) holds them:

* ``model_id``: the weights' digest and the options that change K and V,
  exactly as the connector's (:func:`remote_g2.adapters.vllm.block_identity.model_identity`,
  checked against the start mark of vLLM's plugin); none, and the tier
  shares nothing, where the connector would give none, and also for an
  instance with LoRA enabled (a chunk key names an adapter by name and path
  only, not by its bytes, and the tier sees no request's adapter);
* ``dtype``: the KV cache's dtype (a quantised cache keeps its name);
* ``tokens_per_block``: the tokens of one chunk (``blocks_per_chunk`` blocks);
* ``hash_scheme``: vLLM's algorithm and seed, with the hash unit when vLLM
  hashes more finely than the chunk (the chunk's key is the hash of its last
  unit, :func:`~remote_g2.identity.vllm_hashing.with_hash_unit`): a router's scorer
  then scores the tier's chunks like the connector's blocks;
* ``kv_layout``: the row: its bytes, vLLM's KV-cache layout, and either
  ``canonical`` (vLLM's parallelism-free pages: the same bytes at every TP
  size, shared across TP sizes) or ``tpN`` (every rank's pages side by side
  in the row: shared only with the same TP size) or ``replicated`` (one MLA
  latent copy for every rank).

Only a model with one KV-cache group is shared: with several, one chunk key
per group would have to be matched together.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import LayoutFingerprint
from remote_g2.identity.vllm_hashing import with_hash_unit

__all__ = ["TierIdentity", "tier_identity", "vllm_config_of_caller"]

log = logging.getLogger("remote_g2.adapters.vllm_tier")


@dataclass(frozen=True)
class TierIdentity:
    """The tier's fingerprint, or why it has none (then it shares nothing: ``kind`` as the connector's gauge)."""

    fingerprint: LayoutFingerprint | None
    why_not: str = ""
    kind: str = "digest"


def vllm_config_of_caller(max_depth: int = 16) -> Any:
    """The ``VllmConfig`` the engine is building its offloading connector from, or None.

    A secondary tier is handed only vLLM's offloading spec, which carries the
    model's name but not its configuration; the identity needs the whole
    configuration (the weights' files, the load format, the hf config). vLLM
    builds the tier inside ``OffloadingConnector.__init__(vllm_config, ...)``,
    so the configuration is read from that frame; else from vLLM's current
    config context. None when neither is there (then the tier has no identity).
    """
    try:
        from vllm.config import VllmConfig, get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - the tier only runs inside vLLM
        return None
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        candidate = frame.f_locals.get("vllm_config")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back
    return get_current_vllm_config_or_none()


def tier_identity(offloading_spec: Any, row_bytes: int, vllm_config: Any, *, model_id: str | None = None,
                  identity: Any = None) -> TierIdentity:
    """The fingerprint this instance's chunks are shared under (see the module docstring).

    ``identity`` (a :class:`~remote_g2.adapters.vllm.block_identity.ModelIdentity`) is worked out here when not
    given; ``model_id`` is the operator's name for the weights (the connector's ``model_id`` setting).
    """
    from remote_g2.adapters.vllm import block_identity

    cfg = offloading_spec.config
    if vllm_config is None:
        return TierIdentity(None, "the tier could not find vLLM's configuration to work out the model's identity",
                            "unreadable")
    if len(cfg.groups) != 1:
        return TierIdentity(None, f"{len(cfg.groups)} KV-cache groups: a chunk would need one key per group",
                            "kv_cache_groups")
    if getattr(vllm_config, "lora_config", None) is not None:
        return TierIdentity(None, "LoRA is enabled: a chunk's key names an adapter by name and path only, not by "
                                  "its bytes", "lora")
    if identity is None:
        vc = vllm_config
        identity = block_identity.model_identity(vc.model_config, vc.load_config, vc.cache_config, model_id)
    if identity.model_id is None:
        return TierIdentity(None, identity.why_not, identity.kind)
    mc = vllm_config.model_config
    try:
        heads = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
        head_dim = int(mc.get_head_size())
    except Exception as e:  # no layout to match by: never match rather than guess
        return TierIdentity(None, f"no KV layout to match by ({e})", "unreadable")
    group = cfg.groups[0]
    chunk_tokens = int(group.tokens_per_block) * int(cfg.cache.blocks_per_chunk)
    try:
        base_scheme = block_identity.hash_scheme(str(vllm_config.cache_config.prefix_caching_hash_algo))
    except ConfigError as e:  # hashes random per process (xxhash unseeded), or an algorithm not known here
        return TierIdentity(None, str(e), "hash_scheme")
    scheme = with_hash_unit(base_scheme, int(cfg.cache.tokens_per_hash), chunk_tokens)
    if getattr(cfg, "canonical_layout", False):
        rows = "canonical"
    elif getattr(offloading_spec, "replicated_layout", False) or getattr(cfg, "replicated_layout", False):
        rows = "replicated"
    else:
        rows = f"tp{int(cfg.parallel.world_size)}"
    layout = f"tier/{rows}/{cfg.kv_cache_layout or 'default'}/r{int(row_bytes)}"
    fp = LayoutFingerprint(model_id=identity.model_id, dtype=str(cfg.model.dtype)[:64], tokens_per_block=chunk_tokens,
                           kv_layout=layout[:64], num_layers=max(1, len(group.layer_names)), num_kv_heads=heads,
                           head_dim=head_dim, tp_size=int(cfg.parallel.tp_size), is_mla=bool(getattr(mc, "use_mla",
                                                                                                    False)),
                           hash_scheme=scheme)
    return TierIdentity(fp, kind=identity.kind)
