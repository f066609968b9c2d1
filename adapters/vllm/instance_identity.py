"""What one vLLM instance is, as both sides of its connector must agree: settings, model identity, layout.

The scheduler matches by :meth:`InstanceIdentity.fingerprint` (from the
configuration); each worker checks its real KV tensors against it before it
shares a block.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Gauge

from remote_g2.protocol.messages import LayoutFingerprint

from . import block_identity
from .settings import ConnectorSettings

__all__ = ["IDENTITY_GAUGE", "InstanceIdentity"]

log = logging.getLogger("remote_g2.adapters.vllm")

#: 1 when this process's connector has a model identity (shares), 0 when not; ``kind`` says which
#: (:attr:`~.block_identity.ModelIdentity.kind`: digest, override; generated, load_format, absent, changed,
#: unreadable). On prometheus_client's default registry: vLLM's ``/metrics`` shows it where the connector's
#: process serves it (one process, or PROMETHEUS_MULTIPROC_DIR).
IDENTITY_GAUGE = Gauge("remote_g2_vllm_model_identity", "Whether this vLLM process's remote-g2 connector has a model "
                       "identity (1: it shares KV) or not (0), by role and kind", ["role", "kind"])


class InstanceIdentity:
    """One process's view of its vLLM instance (``role``: vLLM's connector role name)."""

    def __init__(self, vllm_config: Any, settings: ConnectorSettings, hash_scheme: str, role: str) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.hash_scheme = hash_scheme
        self.role = role
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self.is_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self._identity: block_identity.ModelIdentity | None = None
        self._fingerprint: LayoutFingerprint | None = None

    def model_identity(self) -> block_identity.ModelIdentity:
        """This instance's model identity (the loaded weights' digest), worked out once per process.

        Asked once the weights are loaded: the scheduler's connector is made
        after the model loaded, a worker's asks in ``register_kv_caches``. The
        file digests are cached on the node, so the second process to ask
        (and every restart) reads nothing. Every process checks against the
        same mark (the plugin's snapshot, taken before the load, inherited by
        the engine's processes; else the process's own start): a change after
        it gives no identity wherever it is seen, and an instance whose
        scheduler or any worker has none shares nothing (the scheduler looks
        nothing up and saves nothing; the workers agree over their TP group).
        Without one, the scheduler says why in one warning and
        :data:`IDENTITY_GAUGE` reads 0 with the reason's kind.
        """
        if self._identity is None:
            vc = self.vllm_config
            self._identity = ident = block_identity.model_identity(vc.model_config, vc.load_config, vc.cache_config,
                                                                   self.settings.model_id)
            IDENTITY_GAUGE.labels(self.role, ident.kind).set(0 if ident.model_id is None else 1)
            if ident.model_id is None:
                if self.role == "SCHEDULER":
                    log.warning("remote-g2: not sharing KV blocks: %s", ident.why_not)
                else:
                    log.info("remote-g2 %s: no model identity: %s", self.role.lower(), ident.why_not)
            else:
                log.info("remote-g2 model identity %s (%s)", ident.model_id,
                         f"{ident.where}: {ident.weights.summary()}" if ident.weights else ident.where)
                if ident.caveat and self.role == "SCHEDULER":
                    log.warning("remote-g2: model identity given, but %s", ident.caveat)
        return self._identity

    def fingerprint(self) -> LayoutFingerprint | None:
        """The layout this instance's blocks have, as its configuration says (model config; dtype resolved).

        None when there is none to match by (no model identity, no layout): then nothing is loaded or saved."""
        model_id = self.model_identity().model_id
        if model_id is None:
            return None
        if self._fingerprint is None:
            mc = self.vllm_config.model_config
            mla = bool(getattr(mc, "use_mla", False))
            try:
                heads = 1 if mla else int(mc.get_total_num_kv_heads())
                layers = int(mc.get_num_layers(self.vllm_config.parallel_config))
                head_dim = int(mc.get_head_size())
            except Exception as e:  # no layout, no fingerprint: never match rather than guess
                log.warning("no layout fingerprint for lookups (%s): not loading remote blocks", e)
                return None
            dtype = block_identity.resolved_kv_dtype(mc.dtype, self.cache_dtype)
            self._fingerprint = block_identity.fingerprint(
                model_id=model_id, dtype=block_identity.kv_dtype_name(dtype, self.cache_dtype),
                block_size=self.block_size, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                scheme=self.hash_scheme, tp_size=self.tp_size, is_mla=mla)
        return self._fingerprint
