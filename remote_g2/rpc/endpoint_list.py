"""Several endpoints of one service, tried in turn: the registry failover list.

A registry setting (``REMOTE_G2_REGISTRY``, ``--registry``) names one
server or several, separated by commas: servers in front of one store, any
of which can answer anything. :func:`endpoint_list` reads the setting;
:class:`EndpointRotation` holds which one a client uses now and moves to
the next when the current one stops answering (every client moves on its
own; they need not agree).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..errors import ConfigError

__all__ = ["endpoint_list", "endpoint_problem", "EndpointRotation"]


def endpoint_list(value: str | Sequence[str]) -> list[str]:
    """The endpoints a setting names: one, or several separated by commas (blanks ignored), each once.

    Every one is checked here (``ConfigError``), not when a failover first dials it.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        item = item.strip()
        why = endpoint_problem(item, bind=False) if item else None
        if why is not None:
            raise ConfigError(why if len(items) == 1 else f"{why} (in the list {value!r})")
        if item and item not in out:
            out.append(item)
    if not out:
        raise ConfigError(f"no endpoint in {value!r}")
    return out


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """What is wrong with a ZMQ ``endpoint`` to bind (``bind``) or to connect to; None: nothing."""
    if endpoint.startswith("ipc://"):
        return None if len(endpoint) > len("ipc://") else "the ipc:// path is empty"
    if not endpoint.startswith("tcp://"):
        return f"endpoint {endpoint!r} is neither tcp://HOST:PORT nor ipc://PATH"
    host, colon, port = endpoint[len("tcp://"):].rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        return f"endpoint {endpoint!r} is not tcp://HOST:PORT"
    if not bind and (host == "*" or port == "0"):
        return f"cannot connect to {endpoint!r}: name the host and port to connect to"
    return None


class EndpointRotation:
    """The endpoint in use, and the next one after it fails. Thread-safe."""

    def __init__(self, endpoints: str | Sequence[str]) -> None:
        self.endpoints = endpoint_list(endpoints)
        self._at = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self.endpoints[self._at]

    def failed(self, endpoint: str) -> str:
        """``endpoint`` did not answer: move past it if it is still the current one; the endpoint to use now."""
        with self._lock:
            if self.endpoints[self._at] == endpoint:
                self._at = (self._at + 1) % len(self.endpoints)
            return self.endpoints[self._at]
