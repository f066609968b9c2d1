"""Hostile frames for the endpoint fuzz tests: a seeded generator, by category.

Every category is something a network peer can send: random bytes,
truncated valid frames, valid envelopes with wrong-typed bodies, msgpack
headers that claim huge lengths, deeply nested bombs, unknown message
types, block hashes of the wrong length, out-of-range ids, and well-formed
requests naming leases that belong to nobody (or somebody else).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from remote_g2.protocol.wire import PROTOCOL_VERSION, encode_request

CATEGORIES = ("random_bytes", "truncated", "wrong_types", "huge_lengths", "nested_bomb", "unknown_type",
              "bad_hashes", "out_of_range", "foreign_lease")


def _frame(msg_id: int, type_: str, body: Any) -> bytes:
    return msgpack.packb([{"v": PROTOCOL_VERSION, "id": msg_id}, type_, body], use_bin_type=True)


def _junk(rng: random.Random, instead_of: Any) -> Any:
    """A value of another wire type than ``instead_of`` (never None: optional fields take it)."""
    kinds = {bool: [True, False], int: [-1, 2**63], float: [1.5, float("nan")], str: ["x" * rng.randrange(40)],
             bytes: [b"\x00" * rng.randrange(40)], list: [[1, "a"], [None]], dict: [{"k": "v"}, {1: 2}]}
    own = type(instead_of)
    choices = [v for t, vs in kinds.items() if t is not own for v in vs]
    return rng.choice(choices)


def frames(rng: random.Random, valid: list[Any], types: list[str]) -> Iterator[tuple[str, bytes, bool]]:
    """Endless ``(category, frame, must_be_err)``; ``valid`` are sample requests this endpoint serves.

    ``must_be_err`` is False only for ``foreign_lease``: a well-formed
    release/renew of a lease that is not the caller's gets a normal "not
    released" answer, indistinguishable from an unknown lease.
    """
    makers: dict[str, Callable[[int], tuple[bytes, bool]]] = {}

    def random_bytes(i: int) -> tuple[bytes, bool]:
        return rng.randbytes(rng.randrange(0, 2048)), True

    def truncated(i: int) -> tuple[bytes, bool]:
        whole = encode_request(i, rng.choice(valid))
        return whole[:rng.randrange(0, max(1, len(whole) - 1))], True

    def wrong_types(i: int) -> tuple[bytes, bool]:
        req = rng.choice(valid)
        body = msgpack.unpackb(encode_request(i, req), raw=False)[2]
        keys = [k for k, v in body.items() if v is not None]  # an unset optional field takes several types
        if keys:
            key = rng.choice(keys)
            body[key] = _junk(rng, body[key])
            if rng.random() < 0.3:
                body["unexpected_field"] = 1
        else:
            body = {"unexpected_field": 1}
        return _frame(i, type(req).WIRE_NAME, body), True

    def huge_lengths(i: int) -> tuple[bytes, bool]:
        # array32 / map32 / bin32 / str32 headers claiming ~2**31 items with a few bytes behind them
        head = rng.choice([b"\xdd", b"\xdf", b"\xc6", b"\xdb"]) + struct.pack(">I", rng.randrange(2**24, 2**32))
        envelope = b"\x93" + msgpack.packb({"v": PROTOCOL_VERSION, "id": i}) + msgpack.packb(rng.choice(types))
        return rng.choice([head + b"\x00" * 8, envelope + head + b"\x00" * 8]), True

    def nested_bomb(i: int) -> tuple[bytes, bool]:
        depth = rng.choice([100, 1000, 20000])
        bomb = (b"\x91" if rng.random() < 0.5 else b"\x81\xa1k") * depth + b"\xc0"
        return b"\x93\x82\xa1v" + msgpack.packb(PROTOCOL_VERSION) + b"\xa2id" + msgpack.packb(i) + \
            msgpack.packb(rng.choice(types)) + bomb, True

    def unknown_type(i: int) -> tuple[bytes, bool]:
        return _frame(i, rng.choice(["nope", "OK", "ERR", "x" * 64, "x" * 65, "", "resolve\x00"]), {}), True

    def bad_hashes(i: int) -> tuple[bytes, bool]:
        req = rng.choice(valid)
        body = msgpack.unpackb(encode_request(i, req), raw=False)[2]
        if "hashes" not in body:
            return _frame(i, type(req).WIRE_NAME, {**body, "hashes": [b""]}), True
        body["hashes"] = rng.choice([[], [b""], [b"\x01" * 33], [b"\x01" * 8] * 70_000, ["deadbeef"], [1, 2]])
        return _frame(i, type(req).WIRE_NAME, body), True

    def out_of_range(i: int) -> tuple[bytes, bool]:
        req = rng.choice(valid)
        body = msgpack.unpackb(encode_request(i, req), raw=False)[2]
        ints = [k for k, v in body.items() if isinstance(v, int) and not isinstance(v, bool)]
        if not ints:
            return _frame(i, type(req).WIRE_NAME, {**body, "ttl_ms": -5}), True
        body[rng.choice(ints)] = rng.choice([-1, -7, -(2**63)])  # every int field on the wire is >= 0
        return _frame(i, type(req).WIRE_NAME, body), True

    def foreign_lease(i: int) -> tuple[bytes, bool]:
        lease_ok = [r for r in valid if "lease_id" in getattr(r, "__dataclass_fields__", {})
                    and type(r).WIRE_NAME in ("release", "renew")]
        if not lease_ok:
            return random_bytes(i)
        req = rng.choice(lease_ok)
        body = msgpack.unpackb(encode_request(i, req), raw=False)[2]
        body["lease_id"] = rng.randrange(1, 2**62)
        return _frame(i, type(req).WIRE_NAME, body), False

    for name in CATEGORIES:
        makers[name] = locals()[name]
    i = 1
    while True:
        category = CATEGORIES[i % len(CATEGORIES)]
        frame, must_err = makers[category](i)
        yield category, frame, must_err
        i += 1
