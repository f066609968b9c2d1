"""A secondary tier that does nothing: bench_vllm_overhead's ``nulltier`` mode, what vLLM's own tiering manager spends
on having any secondary tier, apart from what that tier does.

Every lookup is a ``MISS``; every store job ends at the next ``get_finished_jobs`` with nothing kept; a load job (none
comes: nothing is ever a hit) fails. Loaded by vLLM's ``SecondaryTierFactory`` as
``{"type": "NullTier", "module_path": "bench.vllm.null_tier"}`` (the repository root on the path)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource


class NullTier(SecondaryTierManager):
    cache_hit_source = CacheHitSource.P2P

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str = "NullTier",
                 backpressure_detector: Any = None, **_: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._done: list[JobResult] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._done.append(JobResult(job_id=job_metadata.job_id, success=True))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._done.append(JobResult(job_id=job_metadata.job_id, success=False, successful_keys=[]))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._done = self._done, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return
