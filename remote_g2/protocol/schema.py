"""Strict, compiled validation of message bodies against dataclass type hints.

A message body is a frozen dataclass whose field annotations say what the wire
may carry. Supported annotations: ``int``, ``float``, ``bool``, ``str``,
``bytes``, ``list[T]``, ``dict[str, T]``, ``T | None``, ``Literal[...]`` of
strings, and nested dataclasses. ``Annotated[T, Limits(...)]`` narrows sizes;
without it the module defaults apply, so nothing that arrives from a socket is
unbounded. ``Annotated[list[int], ..., Packed()]`` sends a list of integers as
one msgpack bin of fixed-width little-endian integers (block-id lists).

Decoders are compiled once per class (a closure per field) because they run on
every request; the error message names the path to the offending value, e.g.
``lookup.hashes[3]: expected 1..32 bytes, got 40``.
"""

from __future__ import annotations

import array
import dataclasses
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import numpy as np

from remote_g2.errors import ProtocolError

__all__ = [
    "Limits",
    "Packed",
    "BlockHash",
    "HashList",
    "decoder_for",
    "encoder_for",
    "DEFAULT_MAX_STR",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ITEMS",
    "MAX_HASHES",
]

DEFAULT_MAX_STR = 64 * 1024
DEFAULT_MAX_BYTES = 1024 * 1024
DEFAULT_MAX_ITEMS = 65_536
#: Longest hash list one message may carry (a 1M-token prompt at 16 tokens/block).
MAX_HASHES = 65_536
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class Limits:
    """Bounds for the annotated value: sizes for str/bytes/list/dict, range for numbers."""

    min_len: int = 0
    max_len: int | None = None
    ge: float | None = None
    le: float | None = None


@dataclass(frozen=True)
class Packed:
    """On ``list[int]``: travel as one msgpack bin of ``dtype`` integers (numpy notation, little-endian).

    Decoded back to a ``list[int]``, so the dataclass field is an ordinary
    list. Why: ids ride every hop of a load (resolve reply, sibling replies,
    the hand-off to each target rank), and a msgpack array of ints costs several
    times more to unpack and check in Python than the packed bin
    (``np.frombuffer``, min/max, ``tolist``; docs/benchmarks.md, "One-off
    measurements"). The sender gets a
    :class:`ValueError` for a value the width cannot hold.
    """

    dtype: str = "<u8"


#: A block hash: opaque bytes, 1..32 long (u64 big-endian, SHA-256, ...).
BlockHash = Annotated[bytes, Limits(min_len=1, max_len=32)]
#: An ordered list of block hashes (a prompt's prefix chain).
HashList = Annotated[list[BlockHash], Limits(max_len=MAX_HASHES)]

Decoder = Callable[[Any, str], Any]
Encoder = Callable[[Any], Any]

_decoders: dict[type, Decoder] = {}
_encoders: dict[type, Encoder] = {}


def _describe(value: Any) -> str:
    if isinstance(value, (bytes, str, list, dict)):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


def _fail(path: str, expected: str, value: Any) -> typing.NoReturn:
    raise ProtocolError(f"{path}: expected {expected}, got {_describe(value)}")


def _sized(kind: type, limits: Limits | None, default_max: int) -> Decoder:
    lo = limits.min_len if limits else 0
    hi = limits.max_len if limits and limits.max_len is not None else default_max
    name = kind.__name__
    expected = f"{name} of length {lo}..{hi}"

    def check(value: Any, path: str) -> Any:
        if type(value) is not kind or not lo <= len(value) <= hi:
            _fail(path, expected, value)
        return value

    check.leaf = True  # type: ignore[attr-defined]  # returns its input unchanged

    def all_ok(values: list[Any]) -> bool:
        """Whether every item passes, checked with C-level loops (no call per item)."""
        if not values:
            return True
        if set(map(type, values)) != {kind}:
            return False
        lengths = set(map(len, values))  # a few distinct lengths at most (hashes: one)
        return lo <= min(lengths) and max(lengths) <= hi

    check.all_ok = all_ok  # type: ignore[attr-defined]
    return check


def _number(kind: type, limits: Limits | None) -> Decoder:
    lo = limits.ge if limits and limits.ge is not None else None
    hi = limits.le if limits and limits.le is not None else None
    if kind is int:
        lo = _INT64_MIN if lo is None else lo
        hi = _UINT64_MAX if hi is None else hi
        accepted: tuple[type, ...] = (int,)
    else:
        accepted = (int, float)
    expected = f"{kind.__name__}" + (f" in [{lo}, {hi}]" if (lo is not None or hi is not None) else "")

    def check(value: Any, path: str) -> Any:
        # bool is an int subclass; a bool where a number belongs is a client bug.
        if type(value) not in accepted:
            _fail(path, expected, value)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ProtocolError(f"{path}: expected {expected}, got {value!r}")
        return kind(value)

    if kind is int:
        def all_ok(values: list[Any]) -> bool:
            """Whether every item passes, with C-level loops (block-id lists run to 64 Ki items)."""
            if not values:
                return True
            if set(map(type, values)) != {int}:  # exact: a bool is not an id
                return False
            return lo <= min(values) and max(values) <= hi

        check.all_ok = all_ok  # type: ignore[attr-defined]
    return check


_ARRAY_CODES = {"<u8": "Q", "<i8": "q", "<u4": "I", "<i4": "i"}  # numpy dtype -> array typecode


@dataclass(frozen=True)
class _PackedSpec:
    """What a ``Packed`` list field allows: its numpy dtype, array typecode and the items' value range."""

    dtype: np.dtype
    code: str
    lo: int
    hi: int
    full_range: bool  # [lo, hi] is the dtype's whole range: no value check needed


def _packed_spec(list_tp: Any, packed: Packed) -> _PackedSpec:
    """Check that ``Packed`` sits on ``list[int]`` with a supported dtype; the item ``Limits`` narrow the range."""
    if get_origin(list_tp) is not list:
        raise TypeError(f"Packed applies to list[int], not {list_tp}")
    (item,) = get_args(list_tp)
    item_limits = None
    if get_origin(item) is Annotated:
        item, *extra = get_args(item)
        item_limits = next((e for e in extra if isinstance(e, Limits)), None)
    dtype = np.dtype(packed.dtype)
    code = _ARRAY_CODES.get(dtype.str)
    if item is not int or code is None or array.array(code).itemsize != dtype.itemsize:
        raise TypeError(f"Packed({packed.dtype!r}) needs list[int] and one of the dtypes {sorted(_ARRAY_CODES)}")
    info = np.iinfo(dtype)
    lo = max(info.min, int(item_limits.ge)) if item_limits and item_limits.ge is not None else info.min
    hi = min(info.max, int(item_limits.le)) if item_limits and item_limits.le is not None else info.max
    return _PackedSpec(dtype, code, lo, hi, (lo, hi) == (info.min, info.max))


def _packed(list_tp: Any, limits: Limits | None, packed: Packed) -> Decoder:
    spec = _packed_spec(list_tp, packed)
    lo_n = limits.min_len if limits else 0
    hi_n = limits.max_len if limits and limits.max_len is not None else DEFAULT_MAX_ITEMS
    size = spec.dtype.itemsize
    expected = f"{lo_n}..{hi_n} packed {spec.dtype.str} integers ({size} bytes each)"

    def check_packed(value: Any, path: str) -> Any:
        if type(value) is not bytes or len(value) % size or not lo_n <= len(value) // size <= hi_n:
            _fail(path, expected, value)
        a = np.frombuffer(value, dtype=spec.dtype)
        if not spec.full_range and a.size and (a.min() < spec.lo or a.max() > spec.hi):
            i = int(np.flatnonzero((a < spec.lo) | (a > spec.hi))[0])
            raise ProtocolError(f"{path}[{i}]: expected int in [{spec.lo}, {spec.hi}], got {int(a[i])}")
        return a.tolist()

    return check_packed


def _packed_encoder(list_tp: Any, packed: Packed) -> Encoder:
    spec = _packed_spec(list_tp, packed)
    dtype, lo, hi = spec.dtype, spec.lo, spec.hi
    swap = sys.byteorder != "little"

    def encode(value: Any) -> bytes:
        if len(value) == 0:
            return b""
        if isinstance(value, np.ndarray):
            if value.ndim != 1 or value.dtype.kind not in "iu":
                raise ValueError(f"cannot pack {value.dtype} values of shape {value.shape} as {dtype.str}")
            if int(value.min()) < lo or int(value.max()) > hi:
                raise ValueError(f"values outside [{lo}, {hi}] cannot be packed as {dtype.str}")
            return value.astype(dtype, copy=False).tobytes()
        try:
            a = array.array(spec.code, value)  # C loop; rejects non-ints and values the width cannot hold
        except (OverflowError, TypeError) as e:
            raise ValueError(f"cannot pack {len(value)} values as {dtype.str}: {e}") from None
        if not spec.full_range and (min(a) < lo or max(a) > hi):
            raise ValueError(f"values outside [{lo}, {hi}] cannot be packed as {dtype.str}")
        if swap:
            a.byteswap()
        return a.tobytes()

    return encode


def _compile(tp: Any, limits: Limits | None = None) -> Decoder:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        found = next((e for e in extra if isinstance(e, Limits)), None)
        packed = next((e for e in extra if isinstance(e, Packed)), None)
        if packed is not None:
            return _packed(base, found, packed)
        return _compile(base, found)
    if tp is bool:
        def check_bool(value: Any, path: str) -> Any:
            if type(value) is not bool:
                _fail(path, "bool", value)
            return value
        return check_bool
    if tp is int or tp is float:
        return _number(tp, limits)
    if tp is str:
        return _sized(str, limits, DEFAULT_MAX_STR)
    if tp is bytes:
        return _sized(bytes, limits, DEFAULT_MAX_BYTES)
    if origin is Literal:
        allowed = frozenset(get_args(tp))
        shown = "|".join(sorted(map(str, allowed)))

        def check_literal(value: Any, path: str) -> Any:
            if type(value) is not str or value not in allowed:
                raise ProtocolError(f"{path}: expected one of {shown}, got {value!r:.80}")
            return value
        return check_literal
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(tp) if a is not type(None)]
        if len(members) != 1 or len(get_args(tp)) != 2:
            raise TypeError(f"only Optional[T] unions are supported, not {tp}")
        inner = _compile(members[0], limits)

        def check_optional(value: Any, path: str) -> Any:
            return None if value is None else inner(value, path)
        return check_optional
    if origin is list:
        (item_tp,) = get_args(tp)
        item = _compile(item_tp)
        lo = limits.min_len if limits else 0
        hi = limits.max_len if limits and limits.max_len is not None else DEFAULT_MAX_ITEMS
        expected = f"list of {lo}..{hi} items"

        all_ok = getattr(item, "all_ok", None)

        def check_list(value: Any, path: str) -> Any:
            if type(value) is not list or not lo <= len(value) <= hi:
                _fail(path, expected, value)
            # Hot path (a lookup carries up to 64 Ki hashes): sized leaves are
            # checked in bulk, others without a per-item path string; on
            # failure, walk again to name the offending index.
            try:
                if all_ok is not None:
                    if all_ok(value):
                        return value
                    raise ProtocolError(path)
                return [item(v, path) for v in value]
            except ProtocolError:
                for i, v in enumerate(value):
                    item(v, f"{path}[{i}]")
                raise
        return check_list
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if key_tp is not str:
            raise TypeError("dict keys on the wire must be str")
        key = _sized(str, None, 256)
        val = _compile(val_tp)
        hi = limits.max_len if limits and limits.max_len is not None else 4096
        expected = f"map of at most {hi} entries"

        def check_dict(value: Any, path: str) -> Any:
            if type(value) is not dict or len(value) > hi:
                _fail(path, expected, value)
            return {key(k, f"{path}.<key>"): val(v, f"{path}[{k!r}]") for k, v in value.items()}
        return check_dict
    if dataclasses.is_dataclass(tp):
        nested = decoder_for(tp)
        return nested
    if tp is Any:
        raise TypeError("Any is not allowed in a wire message; say what the field carries")
    raise TypeError(f"unsupported wire type {tp!r}")


def decoder_for(cls: type) -> Decoder:
    """Compile (once) a function ``(raw_map, path) -> cls`` that validates strictly.

    Unknown keys and missing required keys are errors; fields with defaults
    may be omitted.
    """
    cached = _decoders.get(cls)
    if cached is not None:
        return cached
    hints = get_type_hints(cls, include_extras=True)
    fields = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fields.append((f.name, _compile(hints[f.name]), required))
    known = frozenset(name for name, _, _ in fields)
    type_name = getattr(cls, "WIRE_NAME", cls.__name__)

    def decode(raw: Any, path: str = type_name) -> Any:
        if type(raw) is not dict:
            _fail(path, "map", raw)
        extra = raw.keys() - known
        if extra:
            raise ProtocolError(f"{path}: unknown field(s) {sorted(map(str, extra))[:5]}")
        kwargs = {}
        for name, check, required in fields:
            if name in raw:
                kwargs[name] = check(raw[name], f"{path}.{name}")
            elif required:
                raise ProtocolError(f"{path}: missing field {name!r}")
        return cls(**kwargs)

    _decoders[cls] = decode
    return decode


def _compile_encoder(tp: Any) -> Encoder | None:
    """An encoder for values of ``tp``, or None when the value is already wire-ready."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        packed = next((e for e in extra if isinstance(e, Packed)), None)
        return _compile_encoder(base) if packed is None else _packed_encoder(base, packed)
    if origin in (Union, types.UnionType):
        inner = _compile_encoder(next(a for a in get_args(tp) if a is not type(None)))
        if inner is None:
            return None
        return lambda v: None if v is None else inner(v)
    if origin is list:
        inner = _compile_encoder(get_args(tp)[0])
        if inner is None:
            return None
        return lambda v: [inner(x) for x in v]
    if origin is dict:
        inner = _compile_encoder(get_args(tp)[1])
        if inner is None:
            return None
        return lambda v: {k: inner(x) for k, x in v.items()}
    if dataclasses.is_dataclass(tp):
        return encoder_for(tp)
    return None


def encoder_for(cls: type) -> Encoder:
    """Compile (once) a function turning a ``cls`` instance into a plain msgpack-able map.

    A field whose default is None is left out while it is None: the decoder
    puts the default back, and a peer that predates an optional field still
    decodes a message that does not use it (a rolling upgrade; decoders
    refuse fields they do not know).
    """
    cached = _encoders.get(cls)
    if cached is not None:
        return cached
    hints = get_type_hints(cls, include_extras=True)
    plan = [(f.name, _compile_encoder(hints[f.name]), f.default is None) for f in dataclasses.fields(cls)]

    def encode(obj: Any) -> dict[str, Any]:
        out = {}
        for name, enc, optional in plan:
            value = getattr(obj, name)
            if value is None and optional:
                continue
            out[name] = value if enc is None else enc(value)
        return out

    _encoders[cls] = encode
    return encode
