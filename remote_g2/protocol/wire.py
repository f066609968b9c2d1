"""The envelope every remote-g2 frame travels in, and its strict codec.

A frame is one msgpack array ``[header, type, body]``:

* ``header`` — map ``{"v": PROTOCOL_VERSION, "id": int}``; a reply adds
  ``"re": <id of the request>``.
* ``type`` — a message name from :data:`remote_g2.protocol.messages.MESSAGES`, or
  ``"OK"`` / ``"ERR"`` on replies.
* ``body`` — map of the message dataclass's fields (``ERR``: ``name``,
  ``message``).

Decoding never trusts the peer: the frame size is checked before unpacking,
msgpack is told the same bounds so it cannot allocate past them, and every
body is validated by the compiled decoder of its dataclass. Anything wrong
raises :class:`~remote_g2.errors.ProtocolError`; servers turn that into an
``ERR`` reply and keep serving. No pickle, no ext types.

On a plain stream socket (the worker-internal links of
:mod:`remote_g2.rpc.local_link`, the RPC stream lane of
:mod:`remote_g2.rpc.stream`) each frame is preceded by its length, 4 bytes
big-endian: :func:`stream_frame` writes that, :func:`take_stream_frames`
cuts a receive buffer into whole frames and refuses an announced length past
the limit before any of it is read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from remote_g2.errors import FrameTooLarge, ProtocolError, UnknownMessage
from remote_g2.protocol.messages import MESSAGES, ErrorReply, MessageSpec, spec_for_request
from remote_g2.protocol.schema import decoder_for, encoder_for

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_FRAME_BYTES",
    "OK",
    "ERR",
    "Frame",
    "encode_request",
    "encode_ok",
    "encode_err",
    "decode_frame",
    "decode_request",
    "decode_request_body",
    "peek_type",
    "decode_reply_body",
    "stream_frame",
    "take_stream_frames",
    "read_stream",
]

PROTOCOL_VERSION = 2  # 2: block-id lists travel packed (schema.Packed)
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
OK = "OK"
ERR = "ERR"
_MAX_ID = 2**63 - 1
_STREAM_LEN = struct.Struct(">I")

_packer_kwargs = {"use_bin_type": True}


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded envelope whose body is still the raw map (validated later, by type)."""

    version: int
    id: int
    re: int | None
    type: str
    body: dict[str, Any]


def _pack(header: dict[str, int], type_: str, body: dict[str, Any]) -> bytes:
    return msgpack.packb([header, type_, body], **_packer_kwargs)


def encode_request(msg_id: int, request: Any) -> bytes:
    """Pack a request dataclass (its type name comes from the message table)."""
    spec = spec_for_request(type(request))
    return _pack({"v": PROTOCOL_VERSION, "id": msg_id}, spec.name, encoder_for(spec.request)(request))


def encode_ok(msg_id: int, re: int | None, reply: Any) -> bytes:
    """Pack an ``OK`` reply carrying ``reply`` (a reply dataclass)."""
    header = {"v": PROTOCOL_VERSION, "id": msg_id}
    if re is not None:
        header["re"] = re
    return _pack(header, OK, encoder_for(type(reply))(reply))


def encode_err(msg_id: int, re: int | None, name: str, message: str) -> bytes:
    """Pack an ``ERR`` reply; ``re`` is None when the request id could not be read."""
    header = {"v": PROTOCOL_VERSION, "id": msg_id}
    if re is not None:
        header["re"] = re
    # Bound what we echo back: the message may quote attacker-controlled input.
    return _pack(header, ERR, {"name": name[:128], "message": message[:2048]})


def _check_id(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_ID:
        raise ProtocolError(f"header.{what}: expected a non-negative int, got {value!r:.40}")
    return value


def decode_frame(data: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Unpack and check the envelope; the body is returned raw for :func:`decode_*_body`."""
    if len(data) > max_frame_bytes:
        raise FrameTooLarge(f"frame of {len(data)} bytes exceeds the {max_frame_bytes}-byte limit")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=max_frame_bytes,
            max_str_len=max_frame_bytes,
            max_array_len=max_frame_bytes,
            max_map_len=max_frame_bytes,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}"[:300]) from None
    if type(obj) is not list or len(obj) != 3:
        raise ProtocolError("frame must be a 3-element array [header, type, body]")
    header, type_, body = obj
    if type(header) is not dict:
        raise ProtocolError("header must be a map")
    msg_id = _check_id(header.get("id"), "id")
    try:
        version = header.get("v")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {version!r:.20} (this side speaks {PROTOCOL_VERSION})")
        if header.keys() - {"v", "id", "re"}:
            raise ProtocolError("header has unknown keys")
        re = _check_id(header["re"], "re") if "re" in header else None
        if type(type_) is not str or not 0 < len(type_) <= 64:
            raise ProtocolError("type must be a non-empty string of at most 64 characters")
        if type(body) is not dict:
            raise ProtocolError("body must be a map")
    except ProtocolError as e:
        # The id was readable, so the ERR reply can say which request it answers.
        e.request_id = msg_id
        raise
    return Frame(version, msg_id, re, type_, body)


def peek_type(data: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> str | None:
    """The message type a frame says it carries, read without decoding its body; None if unreadable.

    A hint for routing only (rank 0 forwards ``resolve`` frames to its
    siblings before decoding them): nothing is validated, so the frame must
    still go through :func:`decode_request`.
    """
    if len(data) > max_frame_bytes:
        return None
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) or 1, max_ext_len=0)
        unpacker.feed(data)
        if unpacker.read_array_header() != 3:
            return None
        unpacker.skip()  # the header
        type_ = unpacker.unpack()
    except Exception:  # any malformed input: no hint
        return None
    return type_ if type(type_) is str else None


def decode_request(data: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> tuple[Frame, MessageSpec, Any]:
    """Decode and validate a whole request frame: envelope, no ``re``, a known type, a valid body.

    Raises :class:`~remote_g2.errors.ProtocolError` (or a subclass) naming the
    request's id when it could be read.
    """
    frame = decode_frame(data, max_frame_bytes=max_frame_bytes)
    try:
        if frame.re is not None:
            raise ProtocolError("a request must not carry header.re")
        spec, request = decode_request_body(frame)
    except ProtocolError as e:
        e.request_id = frame.id
        raise
    return frame, spec, request


def decode_request_body(frame: Frame) -> tuple[MessageSpec, Any]:
    """Validate a request frame's body against its message type."""
    spec = MESSAGES.get(frame.type)
    if spec is None:
        raise UnknownMessage(f"unknown message type {frame.type!r}")
    return spec, decoder_for(spec.request)(frame.body, frame.type)


def decode_reply_body(frame: Frame, spec: MessageSpec) -> Any:
    """Validate an ``OK`` reply body; an ``ERR`` frame decodes to :class:`ErrorReply`."""
    if frame.type == ERR:
        return decoder_for(ErrorReply)(frame.body, f"{spec.name}.ERR")
    if frame.type != OK:
        raise ProtocolError(f"reply to {spec.name} has type {frame.type!r}, expected OK or ERR")
    return decoder_for(spec.reply)(frame.body, f"{spec.name}.OK")


def stream_frame(frame: bytes) -> bytes:
    """``frame`` with its 4-byte big-endian length in front, as it travels on a stream socket."""
    return _STREAM_LEN.pack(len(frame)) + frame


def read_stream(sock: Any, buf: bytearray, *, chunk: int = 1 << 18) -> bool:
    """Append what the non-blocking stream ``sock`` has to ``buf`` without blocking; True once the peer closed it.

    Stops at the first short read (nothing more queued). Socket errors other
    than "would block" propagate (``OSError``): the caller closes the stream.
    """
    while True:
        try:
            data = sock.recv(chunk)
        except BlockingIOError:
            return False
        if not data:
            return True
        buf += data
        if len(data) < chunk:
            return False


def take_stream_frames(buf: bytearray, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[bytes]:
    """Remove every whole length-prefixed frame from the front of ``buf`` and return them (raw, undecoded).

    A partial frame stays in ``buf`` for the next read. An announced length
    over ``max_frame_bytes`` raises :class:`~remote_g2.errors.FrameTooLarge`
    (the frames before it are removed and lost with it): the stream cannot be
    resynchronised after that, so the caller closes it.
    """
    out: list[bytes] = []
    pos, end = 0, len(buf)
    try:
        while end - pos >= _STREAM_LEN.size:
            (size,) = _STREAM_LEN.unpack_from(buf, pos)
            if size > max_frame_bytes:
                raise FrameTooLarge(f"a frame of {size} bytes was announced; the limit is {max_frame_bytes}")
            start = pos + _STREAM_LEN.size
            if end - start < size:
                break
            out.append(bytes(buf[start:start + size]))
            pos = start + size
    finally:
        del buf[:pos]
    return out
