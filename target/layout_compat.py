"""Whether a source's blocks can be read by a target at all: layouts, TP pairing, model — checked before any address.

:func:`check_fingerprints` answers with what a lookup knows (both
fingerprints); :func:`check_compatible` with the source's per-rank layout,
known after ``get_metadata``/``resolve``. Each returns the reason a pairing
cannot be served, or ``None``. The TP pairings that can be served are those
:mod:`.tp_mapping` plans: equal TP, an integer ratio either way with a
head-major (``HND``) layout on both sides, and MLA's replicated latent cache.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint

__all__ = ["LayoutShape", "layout_shape", "check_tp", "check_layout", "check_fingerprints", "check_holder_tp",
           "check_compatible"]


class LayoutShape(NamedTuple):
    """What must line up between two sides, per rank."""

    num_layers: int
    kv: int | None  # a fingerprint does not say
    heads: int  # kv heads per rank
    tokens_per_block: int
    head_dim: int
    dtype: int | str  # dtype_bytes from a layout, the dtype name from a fingerprint
    order: str

    @property
    def head_major(self) -> bool:
        return self.order == "HND" or self.heads == 1


def layout_shape(layout: BlockLayout) -> LayoutShape:
    return LayoutShape(layout.num_layers, layout.kv, layout.num_kv_heads, layout.tokens_per_block, layout.head_dim,
                  layout.dtype_bytes, layout.order)


def check_tp(source_tp: int, target_tp: int) -> str | None:
    for side, tp in (("source", source_tp), ("target", target_tp)):
        if not isinstance(tp, (int, np.integer)) or tp < 1:
            return f"{side} TP size must be a positive integer, got {tp!r}"
    return None


def _check_shapes(src: LayoutShape, source_tp: int, tgt: LayoutShape, target_tp: int, *, is_mla: bool) -> str | None:
    for name in ("num_layers", "kv", "tokens_per_block", "head_dim", "dtype"):
        a, b = getattr(src, name), getattr(tgt, name)
        if a != b:
            label = "dtype_bytes" if name == "dtype" and isinstance(a, int) else name
            return f"{label} differs: source {a}, target {b}"
    if is_mla:
        # Every rank holds the whole (replicated) latent cache.
        if src.heads != tgt.heads:
            return f"MLA kv heads per rank differ: source {src.heads}, target {tgt.heads}"
        return _check_same_order(src, tgt)
    if source_tp == target_tp:
        if src.heads != tgt.heads:
            return f"kv heads per rank differ at equal TP {source_tp}: source {src.heads}, target {tgt.heads}"
        return _check_same_order(src, tgt)
    hi, lo = max(source_tp, target_tp), min(source_tp, target_tp)
    if hi % lo:
        return f"TP ratio {source_tp}:{target_tp} (source:target) is not an integer either way"
    if src.heads * source_tp != tgt.heads * target_tp:
        return (f"total kv heads differ: source {src.heads} per rank x TP {source_tp} = {src.heads * source_tp}, "
                f"target {tgt.heads} per rank x TP {target_tp} = {tgt.heads * target_tp}")
    for side, s in (("source", src), ("target", tgt)):
        if not s.head_major:
            return (f"heterogeneous TP ({source_tp} -> {target_tp}) needs a head-major (HND) layout on both sides; "
                    f"the {side} is {s.order} with {s.heads} kv heads per rank")
    return None


def _check_same_order(src: LayoutShape, tgt: LayoutShape) -> str | None:
    if src.order != tgt.order and not (src.heads == 1 and tgt.heads == 1):
        return f"layout order differs: source {src.order}, target {tgt.order}"
    return None


def check_holder_tp(target: LayoutFingerprint, holder_tp: int) -> str | None:
    """Why a target with fingerprint ``target`` cannot read a holder the registry matched on its compat key
    (everything but the TP size, which is ``holder_tp``), or None when it can."""
    return check_fingerprints(replace(target, tp_size=holder_tp), target)


def check_fingerprints(source: LayoutFingerprint, target: LayoutFingerprint) -> str | None:
    """Why a target with fingerprint ``target`` cannot read from ``source``, or None when it can.

    What lookup time knows: the registry matched ``compat_key`` (every field
    but ``tp_size``), so a caller holding only the best holder's ``tp_size``
    can pass ``dataclasses.replace(own_fingerprint, tp_size=holder.tp_size)``.
    This also rejects what the registry cannot see: a TP pairing the layout
    cannot serve (heads that do not split over a TP size, a non-integer ratio,
    heterogeneous TP without a head-major layout).
    """
    reason = check_tp(source.tp_size, target.tp_size)
    if reason:
        return reason
    if source.model_identity != target.model_identity:
        return f"model differs: source {source.model_id!r}, target {target.model_id!r}"
    if source.is_mla != target.is_mla:
        return f"MLA differs: source is_mla={source.is_mla}, target is_mla={target.is_mla}"
    if source.kv_layout != target.kv_layout:
        return f"kv layout differs: source {source.kv_layout}, target {target.kv_layout}"
    if source.num_kv_heads != target.num_kv_heads:
        return f"num_kv_heads differs: source {source.num_kv_heads}, target {target.num_kv_heads}"
    shapes = []
    for side, fp in (("source", source), ("target", target)):
        if source.is_mla:
            heads = fp.num_kv_heads
        elif fp.num_kv_heads % fp.tp_size:
            return (f"{side}: {fp.num_kv_heads} kv heads do not split evenly over TP {fp.tp_size} "
                    f"(replicated kv heads are not supported)")
        else:
            heads = fp.num_kv_heads // fp.tp_size
        shapes.append(LayoutShape(fp.num_layers, None, heads, fp.tokens_per_block, fp.head_dim, fp.dtype,
                             fp.kv_layout.upper()))
    return _check_shapes(shapes[0], source.tp_size, shapes[1], target.tp_size, is_mla=source.is_mla)


def check_compatible(source_layout: BlockLayout, source_tp: int, target_layout: BlockLayout, target_tp: int, *,
                     is_mla: bool) -> str | None:
    """Why a target rank with ``target_layout`` cannot read a source rank's ``source_layout``, or None.

    Layouts are per rank (``num_kv_heads`` per rank); ``is_mla`` is both
    sides' ``LayoutFingerprint.is_mla``. Checks each layout holds its slabs,
    that the geometry matches (layers, k/v, tokens per block, head dim, dtype
    size), and that the TP pairing can be served (see the module docstring).
    """
    reason = check_tp(source_tp, target_tp)
    if reason:
        return reason
    for side, layout in (("source", source_layout), ("target", target_layout)):
        reason = check_layout(side, layout)
        if reason:
            return reason
    return _check_shapes(layout_shape(source_layout), source_tp, layout_shape(target_layout), target_tp,
                         is_mla=is_mla)


def check_layout(side: str, layout: BlockLayout) -> str | None:
    payload = layout.num_layers * layout.kv * layout.slab_bytes
    if payload > layout.block_bytes:
        return (f"{side} layout: {layout.num_layers} layers x {layout.kv} x slab {layout.slab_bytes} B = "
                f"{payload} B do not fit a block of {layout.block_bytes} B")
    if layout.order not in ("HND", "NHD"):
        return f"{side} layout: unknown order {layout.order!r}"
    return None
