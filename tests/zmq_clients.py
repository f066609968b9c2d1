"""A ZMQ client that names its own routing id, as a hostile (or merely careless) client may."""

from __future__ import annotations

from typing import Any

import zmq

from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.protocol.messages import spec_for_request
from remote_g2.protocol.wire import decode_frame, decode_reply_body, encode_request

__all__ = ["call_with_routing_id"]


def call_with_routing_id(endpoint: str, routing_id: bytes, request: Any,
                         curve: CurveClientConfig | None = None) -> Any:
    """One call from a DEALER presenting ``routing_id``; its decoded reply (an ``ErrorReply`` for ERR).

    While the server still holds an earlier connection under that id (it
    learns of a close a moment later) it ignores the new one, so an
    unanswered attempt is made again on a new connection, for up to ~6 s.
    """
    ctx = zmq.Context.instance()
    for _ in range(20):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if curve is not None:
            curve.apply(sock)
        try:
            sock.connect(endpoint)
            sock.send(encode_request(1, request))
            if sock.poll(300):
                return decode_reply_body(decode_frame(sock.recv()), spec_for_request(type(request)))
        finally:
            sock.close(0)
    raise AssertionError(f"no reply from {endpoint} to a client with routing id {routing_id!r}")
