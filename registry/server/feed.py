"""The registry's change feed: every write a server applied, published for mirrors to follow.

A server with a feed binds a ZMQ PUB socket and, after each write its store
accepted, publishes the request that made it: ``register_worker``,
``heartbeat`` (status ``ok``), ``events`` (``ok``), ``resync`` (``ok``) and
``drain_worker`` (the worker existed). A :class:`~registry.mirror.RegistryMirror`
replays them into an in-process copy of the registry, so a router asks its own
memory instead of paying a network round trip per lookup.

Frames are two parts: ``[instance, frame]``. ``instance`` is 16 hex characters,
new every time the server starts; ``frame`` is the usual envelope (see
:mod:`remote_g2.protocol.wire`) whose header ``id`` is the feed sequence number —
1, 2, 3, … per instance, one per write. An idle feed sends ``feed_tick``
(``{seq}`` = the last number used) every ``tick_s``, so a follower learns its
subscription is live, and notices a lost tail, within one tick.

PUB never blocks the server: past the high-water mark a frame is dropped,
which a follower sees as a gap in the numbers and answers with a fresh
snapshot. Sends from several handler threads are serialised by a lock, so
numbers go out in order.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import zmq

from remote_g2.rpc.curve import CurveServerConfig
from remote_g2.protocol.messages import FeedTick
from remote_g2.rpc.server import normalize_bind_endpoint
from remote_g2.protocol.wire import encode_request

__all__ = ["FeedPublisher", "DEFAULT_TICK_S"]

DEFAULT_TICK_S = 0.1
_SNDHWM = 100_000


class FeedPublisher:
    """Number and publish applied writes on ``bind`` (``tcp://HOST:0`` picks a free port)."""

    def __init__(self, bind: str, *, context: zmq.Context | None = None, curve: CurveServerConfig | None = None,
                 tick_s: float = DEFAULT_TICK_S) -> None:
        self.instance = secrets.token_hex(8)
        self._instance_b = self.instance.encode()
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._sock.bind(normalize_bind_endpoint(bind))
        self.endpoint: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tick_s = tick_s
        self._ticker = threading.Thread(target=self._tick_loop, name="registry-feed-tick", daemon=True)
        self._ticker.start()

    @property
    def seq(self) -> int:
        """The last sequence number published."""
        return self._seq

    def publish(self, request: Any) -> None:
        """Publish one applied write (a request dataclass) under the next sequence number."""
        with self._lock:
            if self._stop.is_set():
                return
            self._seq += 1
            self._send(encode_request(self._seq, request))

    def _send(self, frame: bytes) -> None:
        try:
            self._sock.send_multipart([self._instance_b, frame], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # past the high-water mark: followers see the gap and resnapshot

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            with self._lock:
                if self._stop.is_set():
                    return
                self._send(encode_request(self._seq, FeedTick(self._seq)))

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            self._sock.close(linger=0)
        self._ticker.join(2)
