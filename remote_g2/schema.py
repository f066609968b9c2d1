"""Strict, compiled validation of message bodies against dataclass type hints.

A message body is a frozen dataclass whose field annotations say what the wire
may carry. Supported annotations: ``int``, ``float``, ``bool``, ``str``,
``bytes``, ``list[T]``, ``dict[str, T]``, ``T | None``, ``Literal[...]`` of
strings, and nested dataclasses. ``Annotated[T, Limits(...)]`` narrows sizes;
without it the module defaults apply, so nothing that arrives from a socket is
unbounded.

Decoders are compiled once per class (a closure per field) because they run on
every request; the error message names the path to the offending value, e.g.
``lookup.hashes[3]: expected 1..32 bytes, got 40``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from remote_g2.errors import ProtocolError

__all__ = [
    "Limits",
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
        lengths = list(map(len, values))
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


def _compile(tp: Any, limits: Limits | None = None) -> Decoder:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        found = next((e for e in extra if isinstance(e, Limits)), None)
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
        return _compile_encoder(get_args(tp)[0])
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
    """Compile (once) a function turning a ``cls`` instance into a plain msgpack-able map."""
    cached = _encoders.get(cls)
    if cached is not None:
        return cached
    hints = get_type_hints(cls, include_extras=True)
    plan = [(f.name, _compile_encoder(hints[f.name])) for f in dataclasses.fields(cls)]

    def encode(obj: Any) -> dict[str, Any]:
        out = {}
        for name, enc in plan:
            value = getattr(obj, name)
            out[name] = value if enc is None else enc(value)
        return out

    _encoders[cls] = encode
    return encode
