"""``RemoteG2Connector``: vLLM's KV connector (V1) for remote-g2.

Enable it with::

    kv_transfer_config={"kv_connector": "RemoteG2Connector",
                        "kv_connector_module_path": "remote_g2.adapters.vllm",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"registry": "tcp://10.0.0.5:7450",
                                                      "worker_id": "vllm-a", "g2_blocks": 2048}}

vLLM builds one connector in its scheduler process (role ``SCHEDULER``) and
one in every TP rank's model runner (``WORKER``). This class checks the
configuration, works out the instance's identity (:mod:`.instance_identity`)
and hands each of vLLM's calls to its role's half:

* :mod:`.scheduler_side` — lookups, load plans, what to save, delayed frees;
* :mod:`.worker_side` — the G2 pool, the source service and target client,
  saves (:mod:`.saver`), loads (:mod:`.fetches`, :mod:`.tp_sync`);
* :mod:`.metadata` — what the two tell each other every step.

Limits (refused with a ConfigError by the plugin of :mod:`.plugin`
before the model loads): pipeline_parallel_size 1; at tensor_parallel_size
> 1 the model's KV heads must divide among the ranks (vLLM replicates them
otherwise). Uniform attention layers, the layouts in :mod:`.kv_blocks`.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Any

import torch

from remote_g2.errors import ConfigError
from remote_g2.identity.vllm_hashing import with_hash_unit

from . import block_identity
from .instance_identity import InstanceIdentity
from .settings import ConnectorSettings

try:  # vLLM is an optional dependency: `make test-vllm` installs it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError(f"remote_g2.adapters.vllm needs vLLM ({e}); install it (make venv-vllm)") from e

from .metadata import RemoteG2ConnectorMetadata, RemoteG2WorkerMetadata  # noqa: E402 (needs vLLM)
from .scheduler_side import SchedulerSide  # noqa: E402
from .worker_side import WorkerSide  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["RemoteG2Connector", "RemoteG2ConnectorMetadata", "RemoteG2WorkerMetadata", "ConnectorSettings",
           "check_vllm_config"]

log = logging.getLogger("remote_g2.adapters.vllm")


def check_vllm_config(vllm_config: VllmConfig) -> str:
    """Refuse a configuration the connector cannot serve correctly, with what to change (``ConfigError``).

    Returns the hash scheme of the instance's block hashes (:func:`.block_identity.hash_scheme`).

    Called where vLLM creates its config (:mod:`.plugin`, before the model
    loads), whenever vLLM consults the connector class, and when a connector
    is built.
    """
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if pp != 1:
        raise ConfigError(f"remote-g2's vLLM connector supports pipeline_parallel_size=1, got {pp}")
    mc = vllm_config.model_config
    if tp > 1 and not getattr(mc, "use_mla", False):
        heads = int(mc.get_total_num_kv_heads())
        if heads % tp:
            # vLLM then replicates KV heads across ranks: no rank holds a slice the TP planner can address.
            raise ConfigError(f"remote-g2's vLLM connector needs the model's {heads} KV heads to divide among "
                              f"tensor_parallel_size={tp} ranks (vLLM would replicate them); use a TP size that "
                              f"divides {heads}")
    return block_identity.hash_scheme(str(vllm_config.cache_config.prefix_caching_hash_algo))


class RemoteG2Connector(KVConnectorBase_V1):
    """remote-g2 for vLLM: share full prompt blocks through a G2 pool, load others' blocks over NIXL.

    ``scheduler`` (role ``SCHEDULER``) or ``worker`` (role ``WORKER``) does the work; the other is None.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if not logging.getLogger("remote_g2").handlers:  # vLLM configures only its own loggers
            from remote_g2.log import configure_logging

            configure_logging()
        # The scheduler and every TP rank run in processes of their own: the default name comes from the
        # engine id they all share.
        engine_id = str(getattr(self._kv_transfer_config, "engine_id", None) or "")
        self.settings = ConnectorSettings.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config or {}),
            default_worker_id=f"vllm-{socket.gethostname()}-{engine_id[:12]}" if engine_id else None)
        # vLLM hashes every hash_block_size tokens (finer than the block with several KV-cache groups); the
        # scheme says so, so a scorer hashes as this instance publishes (vllm_hashing.with_hash_unit).
        hash_scheme = with_hash_unit(check_vllm_config(vllm_config), getattr(kv_cache_config, "hash_block_size", None),
                                     int(vllm_config.cache_config.block_size))
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kv_load_failure_policy=%r: a failed remote load fails the request; set \"recompute\" to "
                        "recompute the blocks instead", policy)
        log.info("remote-g2 connector (%s) for %s: registry %s, worker %s, hashes %s", role.name,
                 vllm_config.model_config.model, self.settings.registry, self.settings.worker_id, hash_scheme)
        ident = InstanceIdentity(vllm_config, self.settings, hash_scheme, role.name)
        self.scheduler = SchedulerSide(ident) if role.name == "SCHEDULER" else None
        self.worker = WorkerSide(ident) if role.name != "SCHEDULER" else None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM consults this while it sets attention backends up: refuse what cannot work there as well."""
        check_vllm_config(vllm_config)
        return None

    # ======================= scheduler side (SchedulerSide) =======================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    # ======================= worker side (WorkerSide) =======================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, RemoteG2ConnectorMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteG2ConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads end before the forward (sync) or before vLLM schedules the request (async)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved at once, queued in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteG2ConnectorMetadata)
        self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        return self.worker.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.shutdown()
