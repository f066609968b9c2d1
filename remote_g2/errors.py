"""The one exception tree of remote-g2.

Everything the project raises on purpose derives from :class:`RemoteG2Error`::

    RemoteG2Error
    ├── ConfigError                  bad settings or environment
    ├── TransportError               the bytes did not get there (or back)
    │   ├── RpcTimeout               no reply within the call's timeout
    │   ├── RpcClosed                the RPC object was used after close()
    │   └── LinkClosed               a local link's peer went away or stopped reading
    ├── ProtocolError                a frame or message failed validation
    │   ├── FrameTooLarge
    │   └── UnknownMessage
    ├── RemoteError                  the peer answered ERR with a name we do not know
    ├── RegistryError                registry semantics
    │   ├── StaleEpoch               a registration older than the one on record
    │   ├── StoreUnavailable         Redis is unreachable (the server answers, the store does not)
    │   ├── MirrorNotReady           a registry mirror is (re)taking its snapshot; ask the server
    │   └── CannotScore              a score request the registry cannot answer exactly (reason named)
    ├── SourceError                  source semantics (unknown lease, pin budget, ...)
    │   └── SiblingUnavailable       rank 0 does not wait again for a sibling that failed recently
    ├── TransferError                a data-plane transfer failed; the caller recomputes
    └── PoolIndexError               misuse of the secondary-pool index
        └── BlockPinnedError         the operation would disturb a pinned block

When a server handler raises one of these, the client re-raises the class of
the same name (every subclass registers itself by name), with ``remote`` set to
the endpoint that raised it. Context is keyword-only so messages stay readable.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "RemoteG2Error",
    "ConfigError",
    "TransportError",
    "RpcTimeout",
    "RpcClosed",
    "LinkClosed",
    "ProtocolError",
    "FrameTooLarge",
    "UnknownMessage",
    "RemoteError",
    "RegistryError",
    "StaleEpoch",
    "StoreUnavailable",
    "MirrorNotReady",
    "CannotScore",
    "SourceError",
    "SiblingUnavailable",
    "TransferError",
    "PoolIndexError",
    "BlockPinnedError",
    "EngineError",
    "RequestRejected",
    "error_class_for",
]


class RemoteG2Error(Exception):
    """Root of every error remote-g2 raises on purpose.

    ``remote`` is the endpoint that raised the error when it crossed the wire,
    ``None`` when it was raised locally.
    """

    _by_name: ClassVar[dict[str, type[RemoteG2Error]]] = {}

    def __init__(self, message: str = "", *, remote: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remote = remote

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # A duplicate name would make ERR replies ambiguous.
        if cls.__name__ in RemoteG2Error._by_name:
            raise TypeError(f"duplicate error class name {cls.__name__!r}")
        RemoteG2Error._by_name[cls.__name__] = cls

    def __str__(self) -> str:
        if self.remote:
            return f"{self.message} (from {self.remote})"
        return self.message


RemoteG2Error._by_name["RemoteG2Error"] = RemoteG2Error


class ConfigError(RemoteG2Error):
    """A setting or environment variable is missing or invalid."""


class TransportError(RemoteG2Error):
    """A message could not be delivered or its reply did not arrive."""


class RpcTimeout(TransportError):
    """No reply within the timeout; the message names the call and the endpoint."""

    def __init__(self, message: str = "", *, call: str = "", endpoint: str = "",
                 timeout_ms: float = 0.0, remote: str | None = None) -> None:
        super().__init__(message, remote=remote)
        self.call = call
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms


class RpcClosed(TransportError):
    """The client or server was used after it was closed."""


class LinkClosed(TransportError):
    """A local link's peer (:mod:`remote_g2.rpc.local_link`) went away (EOF, reset) or stopped reading.

    Nothing more can be sent or received on that link.
    """


class ProtocolError(RemoteG2Error):
    """A frame or message body failed validation (type, size, version, shape).

    ``request_id`` is the offending request's header id when it could be read,
    so the ``ERR`` reply can name the request it answers.
    """

    request_id: int | None = None


class FrameTooLarge(ProtocolError):
    """A frame exceeded the negotiated maximum size."""


class UnknownMessage(ProtocolError):
    """The message type is not in the message table."""


class RemoteError(RemoteG2Error):
    """The peer answered ERR with an error name this side does not know."""

    def __init__(self, message: str = "", *, name: str = "", remote: str | None = None) -> None:
        super().__init__(message, remote=remote)
        self.name = name

    def __str__(self) -> str:
        return f"{self.name}: {super().__str__()}"


class RegistryError(RemoteG2Error):
    """Registry semantics: unknown worker, stale epoch, resync needed, ..."""


class StaleEpoch(RegistryError):
    """A worker registered with an epoch older than (or conflicting with) the one the registry holds."""


class StoreUnavailable(RegistryError):
    """The registry's backing store (Redis) cannot be reached; retry later."""


class MirrorNotReady(RegistryError):
    """A registry mirror is still taking (or retaking) its snapshot; ask the registry server instead."""


class CannotScore(RegistryError):
    """A score request the registry cannot answer exactly; ``reason`` is a short code for scripts.

    Raised instead of answering "nothing cached": a hash the registry cannot
    compute as the engine does (a scheme it does not know, a seed it was not
    given, multimodal input) would otherwise read as a silent miss.
    """

    def __init__(self, message: str = "", *, reason: str = "cannot_score", remote: str | None = None) -> None:
        super().__init__(message, remote=remote)
        self.reason = reason


class SourceError(RemoteG2Error):
    """Source semantics: unknown lease, pin budget exhausted, sibling failure, ..."""


class SiblingUnavailable(SourceError):
    """A sibling TP rank failed recently; rank 0 does not wait for it again yet.

    Internal to rank 0: it never crosses the wire (the resolve answers
    ``ERR SourceError`` naming the rank). Not a :class:`TransportError`: the
    rank was not called, so it is not counted as one that did not answer.
    """


class TransferError(RemoteG2Error):
    """A data-plane transfer failed or timed out; the engine recomputes the blocks."""


class PoolIndexError(RemoteG2Error):
    """Misuse of the secondary-pool index."""


class BlockPinnedError(PoolIndexError, ValueError):
    """The operation would change or free a block that is pinned."""


class EngineError(RemoteG2Error):
    """The reference engine (``remote_g2.adapters.reference``) failed a request or an operation."""


class RequestRejected(EngineError, ValueError):
    """The engine refused a request it can never run (bad token ids, duplicate id, too long, shutting down)."""


def error_class_for(name: str) -> type[RemoteG2Error] | None:
    """The registered error class called ``name``, or None."""
    return RemoteG2Error._by_name.get(name)
