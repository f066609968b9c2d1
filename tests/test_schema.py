"""Body validation: every malformed value is a ProtocolError that names its path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_g2.errors import ProtocolError
from remote_g2.protocol.schema import BlockHash, HashList, Limits, Packed, decoder_for, encoder_for


@dataclass(frozen=True)
class Inner:
    name: Annotated[str, Limits(max_len=8)]
    size: Annotated[int, Limits(ge=0, le=100)]


@dataclass(frozen=True)
class Outer:
    hashes: HashList
    parent: BlockHash | None
    kind: Literal["stored", "removed"]
    ratio: float
    flag: bool
    inner: Inner
    items: Annotated[list[Inner], Limits(max_len=3)]
    tags: dict[str, int] = field(default_factory=dict)
    note: str = ""


decode = decoder_for(Outer)
encode = encoder_for(Outer)


def valid() -> dict:
    return {
        "hashes": [b"\x01" * 8, b"\x02" * 32, b"\x03"],
        "parent": None,
        "kind": "stored",
        "ratio": 1,
        "flag": True,
        "inner": {"name": "a", "size": 3},
        "items": [{"name": "b", "size": 0}],
        "tags": {"x": 1},
    }


@dataclass(frozen=True)
class Older:
    """``Newer`` as a peer that predates its optional field knows it."""

    name: Annotated[str, Limits(max_len=8)]
    peer: Annotated[int, Limits(ge=0)] | None = None


@dataclass(frozen=True)
class Newer:
    name: Annotated[str, Limits(max_len=8)]
    peer: Annotated[int, Limits(ge=0)] | None = None
    added: Annotated[int, Limits(ge=0)] | None = None


def test_an_unset_optional_field_stays_off_the_wire_so_an_older_peer_still_decodes_it():
    assert encoder_for(Newer)(Newer("a")) == {"name": "a"}
    assert decoder_for(Older)(encoder_for(Newer)(Newer("a", 3))) == Older("a", 3)
    assert decoder_for(Newer)(encoder_for(Newer)(Newer("a"))) == Newer("a")
    with pytest.raises(ProtocolError, match="unknown field"):  # a field it does not know, in use: refused
        decoder_for(Older)(encoder_for(Newer)(Newer("a", added=1)))


def test_valid_body_decodes_to_dataclasses_and_round_trips():
    obj = decode(valid())
    assert obj.hashes[1] == b"\x02" * 32
    assert obj.inner == Inner("a", 3)
    assert obj.items == [Inner("b", 0)]
    assert isinstance(obj.ratio, float)
    assert obj.note == ""  # default applied
    assert decode(encode(obj)) == obj


@pytest.mark.parametrize(
    "mutate, path_fragment",
    [
        (lambda b: b["hashes"].append(b""), "hashes[3]"),
        (lambda b: b["hashes"].append(b"\x00" * 33), "hashes[3]"),
        (lambda b: b["hashes"].append("ab"), "hashes[3]"),
        (lambda b: b.update(parent=b"\x00" * 40), "parent"),
        (lambda b: b.update(kind="cleared"), "kind"),
        (lambda b: b.update(ratio="1.0"), "ratio"),
        (lambda b: b.update(flag=1), "flag"),
        (lambda b: b["inner"].update(size=True), "inner.size"),  # bool is not an int on the wire
        (lambda b: b["inner"].update(size=101), "inner.size"),
        (lambda b: b["inner"].update(size=-1), "inner.size"),
        (lambda b: b["inner"].update(name="x" * 9), "inner.name"),
        (lambda b: b["inner"].update(extra=1), "unknown field"),
        (lambda b: b["inner"].pop("name"), "missing field"),
        (lambda b: b.update(items=[{"name": "b", "size": 0}] * 4), "items"),
        (lambda b: b.update(tags={"x": "y"}), "tags"),
        (lambda b: b.update(inner=[1, 2]), "inner"),
        (lambda b: b.update(hashes={"a": 1}), "hashes"),
    ],
)
def test_each_bad_value_is_a_protocol_error_naming_its_path(mutate, path_fragment):
    body = valid()
    mutate(body)
    with pytest.raises(ProtocolError) as info:
        decode(body)
    assert path_fragment in str(info.value)


def test_hash_list_is_bounded():
    body = valid()
    body["hashes"] = [b"\x01"] * 65_537
    with pytest.raises(ProtocolError, match="hashes"):
        decode(body)


def test_unsupported_annotation_is_rejected_when_compiled():
    @dataclass
    class Bad:
        x: object

    with pytest.raises(TypeError):
        decoder_for(Bad)


_wire_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(list(valid().keys()) + ["zz"]), _wire_values, max_size=10))
def test_arbitrary_maps_decode_or_raise_protocol_error_only(raw):
    try:
        obj = decode(raw)
    except ProtocolError as e:
        assert str(e).startswith("Outer")  # the path always starts at the message
    else:
        assert isinstance(obj, Outer)
        assert decode(encode(obj)) == obj


@dataclass(frozen=True)
class Ids:
    ids: Annotated[list[Annotated[int, Limits(ge=0, le=1000)]], Limits(max_len=4096)]


@pytest.mark.parametrize("bad, index", [
    ([1, 2, True], 2),          # a bool is not an id
    ([0, 1001, 3], 1),          # above the bound
    ([5, -1], 1),               # below it
    ([1, 2.0], 1),              # a float
    ([1, 1 << 70], 1),          # a huge int
    ([0, "3"], 1),
])
def test_bulk_checked_int_lists_still_name_the_bad_item(bad, index):
    decode = decoder_for(Ids)
    assert decode({"ids": list(range(1000))}).ids == list(range(1000))
    with pytest.raises(ProtocolError, match=rf"ids\[{index}\]"):
        decode({"ids": bad})


@dataclass(frozen=True)
class PackedIds:
    ids: Annotated[list[Annotated[int, Limits(ge=0)]], Limits(max_len=4), Packed()]
    bounded: Annotated[list[Annotated[int, Limits(ge=1, le=1000)]], Limits(max_len=8), Packed()] = \
        field(default_factory=list)


def test_packed_ids_travel_as_one_little_endian_bin_and_decode_to_a_list():
    enc, dec = encoder_for(PackedIds), decoder_for(PackedIds)
    wire = enc(PackedIds([1, 2**64 - 1, 0], [7]))
    assert wire["ids"] == b"".join(v.to_bytes(8, "little") for v in (1, 2**64 - 1, 0))
    back = dec(wire)
    assert back == PackedIds([1, 2**64 - 1, 0], [7]) and type(back.ids) is list and type(back.ids[0]) is int
    assert enc(PackedIds(np.array([3, 4], dtype=np.int32)))["ids"] == enc(PackedIds([3, 4]))["ids"]
    assert enc(PackedIds([]))["ids"] == b"" and dec({"ids": b""}).ids == []


@pytest.mark.parametrize("raw, fragment", [
    ({"ids": [1, 2]}, r"ids: expected 0\.\.4 packed <u8"),            # a msgpack array, not a bin
    ({"ids": b"\x00" * 12}, r"ids: expected .*bytes of length 12"),    # not a whole number of ids
    ({"ids": b"\x00" * 40}, r"ids: expected 0\.\.4 packed"),           # five ids, four allowed
    ({"ids": b"", "bounded": (0).to_bytes(8, "little")}, r"bounded\[0\]: expected int in \[1, 1000\], got 0"),
    ({"ids": b"", "bounded": (5).to_bytes(8, "little") + (1001).to_bytes(8, "little")}, r"bounded\[1\]"),
])
def test_malformed_packed_ids_are_protocol_errors_naming_the_field(raw, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        decoder_for(PackedIds)(raw)


@pytest.mark.parametrize("ids", [[-1], [2**64], ["3"], [1.5], np.array([-2, 3]), np.array([0.5])])
def test_the_sender_cannot_pack_what_the_width_does_not_hold(ids):
    with pytest.raises(ValueError, match="pack"):
        encoder_for(PackedIds)(PackedIds(ids))


def test_packed_needs_a_list_of_ints_and_a_supported_dtype():
    @dataclass(frozen=True)
    class OnStr:
        names: Annotated[list[str], Packed()]

    @dataclass(frozen=True)
    class BigEndian:
        ids: Annotated[list[int], Packed(">u8")]

    for cls in (OnStr, BigEndian):
        with pytest.raises(TypeError, match="Packed"):
            decoder_for(cls)
