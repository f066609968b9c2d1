"""The envelope codec: round trips, and every malformed frame is a ProtocolError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_g2.errors import FrameTooLarge, ProtocolError, UnknownMessage
from remote_g2.protocol.messages import ErrorReply, Ping, Pong, spec_for_request
from remote_g2.protocol.wire import (
    ERR,
    OK,
    PROTOCOL_VERSION,
    decode_frame,
    decode_reply_body,
    decode_request,
    decode_request_body,
    encode_err,
    encode_ok,
    encode_request,
    peek_type,
)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_request_and_replies_round_trip():
    frame = decode_frame(encode_request(7, Ping()))
    assert (frame.version, frame.id, frame.re, frame.type) == (PROTOCOL_VERSION, 7, None, "ping")
    spec, req = decode_request_body(frame)
    assert spec.name == "ping" and req == Ping()

    ok = decode_frame(encode_ok(1, 7, Pong(server="s", version="1", uptime_s=2.5)))
    assert (ok.type, ok.re) == (OK, 7)
    assert decode_reply_body(ok, spec) == Pong("s", "1", 2.5)

    err = decode_frame(encode_err(2, 7, "SourceError", "no such lease"))
    assert err.type == ERR
    assert decode_reply_body(err, spec) == ErrorReply("SourceError", "no such lease")


def test_err_echo_is_bounded():
    frame = decode_frame(encode_err(1, None, "X" * 500, "m" * 10_000))
    body = decode_reply_body(frame, spec_for_request(Ping))
    assert len(body.name) == 128 and len(body.message) == 2048


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (pack([{"v": PROTOCOL_VERSION, "id": 1}, "ping"]), "3-element"),
        (pack({"v": 1}), "3-element"),
        (pack([[1], "ping", {}]), "header must be a map"),
        (pack([{"v": PROTOCOL_VERSION + 1, "id": 1}, "ping", {}]), "version"),
        (pack([{"v": 1, "id": 1}, "ping", {}]), "version"),  # before block ids were packed
        (pack([{"id": 1}, "ping", {}]), "version"),
        (pack([{"v": PROTOCOL_VERSION, "id": -1}, "ping", {}]), "header.id"),
        (pack([{"v": PROTOCOL_VERSION, "id": "1"}, "ping", {}]), "header.id"),
        (pack([{"v": PROTOCOL_VERSION, "id": True}, "ping", {}]), "header.id"),
        (pack([{"v": PROTOCOL_VERSION, "id": 1, "x": 0}, "ping", {}]), "unknown keys"),
        (pack([{"v": PROTOCOL_VERSION, "id": 1}, b"ping", {}]), "type"),
        (pack([{"v": PROTOCOL_VERSION, "id": 1}, "", {}]), "type"),
        (pack([{"v": PROTOCOL_VERSION, "id": 1}, "ping", []]), "body must be a map"),
        (pack([{"v": PROTOCOL_VERSION, "id": 1}, "ping", {}]) + b"\x00", "not valid msgpack"),
        (pack([{"v": PROTOCOL_VERSION, "id": 1}, "ping", {1: 2}]), "not valid msgpack"),  # non-str map key
        (msgpack.packb(msgpack.ExtType(1, b"abc")), "not valid msgpack"),
    ],
)
def test_malformed_envelopes(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_frame(data)


def test_oversized_frame_is_refused_before_unpacking():
    with pytest.raises(FrameTooLarge):
        decode_frame(b"\x00" * 1025, max_frame_bytes=1024)


def test_length_prefix_lies_do_not_allocate():
    # A bin32 header claiming 1 GiB followed by 3 bytes must fail cleanly.
    with pytest.raises(ProtocolError):
        decode_frame(b"\xc6\x40\x00\x00\x00abc")


def test_unknown_type_and_bad_body():
    with pytest.raises(UnknownMessage):
        decode_request_body(decode_frame(pack([{"v": PROTOCOL_VERSION, "id": 1}, "nope", {}])))
    with pytest.raises(ProtocolError, match="unknown field"):
        decode_request_body(decode_frame(pack([{"v": PROTOCOL_VERSION, "id": 1}, "ping", {"x": 1}])))


def test_reply_of_unexpected_type():
    frame = decode_frame(pack([{"v": PROTOCOL_VERSION, "id": 1, "re": 1}, "ping", {}]))
    with pytest.raises(ProtocolError, match="expected OK or ERR"):
        decode_reply_body(frame, spec_for_request(Ping))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(data):
    try:
        frame = decode_frame(data)
        decode_request_body(frame)
    except ProtocolError:
        return
    # Random bytes that happen to form a valid ping are fine, but must really be one.
    assert frame.type == "ping"


def test_peek_type_reads_the_type_alone_and_never_raises():
    from remote_g2.protocol.messages import Resolve

    assert peek_type(encode_request(3, Resolve([b"h" * 8] * 4, 1000))) == "resolve"
    assert peek_type(encode_request(4, Ping())) == "ping"
    # The body is not looked at: a frame whose body is wrong still names its type (decoding refuses it).
    assert peek_type(pack([{"v": PROTOCOL_VERSION, "id": 1}, "resolve", {"hashes": "nope"}])) == "resolve"
    for junk in (b"", b"\xc1garbage", pack([1, 2]), pack([{}, 5, {}]), pack({"a": 1}), pack([{}, "x"])[:3]):
        assert peek_type(junk) is None, junk
    assert peek_type(encode_request(5, Ping()), max_frame_bytes=4) is None


def test_decode_request_applies_every_request_check_and_names_the_id():
    frame, spec, request = decode_request(encode_request(9, Ping()))
    assert (frame.id, spec.name, request) == (9, "ping", Ping())
    with pytest.raises(ProtocolError, match="header.re") as info:
        decode_request(pack([{"v": PROTOCOL_VERSION, "id": 11, "re": 1}, "ping", {}]))
    assert info.value.request_id == 11
    with pytest.raises(UnknownMessage) as unknown:
        decode_request(pack([{"v": PROTOCOL_VERSION, "id": 12}, "no_such", {}]))
    assert unknown.value.request_id == 12
    with pytest.raises(FrameTooLarge):
        decode_request(encode_request(1, Ping()), max_frame_bytes=4)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_peek_type_agrees_with_decoding_on_random_bytes(data):
    try:
        frame, spec, _ = decode_request(data)
    except ProtocolError:
        return
    assert peek_type(data) == spec.name == frame.type
