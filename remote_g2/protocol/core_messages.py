"""What every remote-g2 server speaks, whatever its conversation: ``ping``, and the body of an ``ERR`` reply.

Registered in the one table (:mod:`remote_g2.protocol.messages`); ``docs/protocol.md``
lists ``ping`` under "Messages" and the ``ERR`` body under "Envelope".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from remote_g2.protocol.schema import Limits
from remote_g2.protocol.spec import Text, message

_Name = Annotated[str, Limits(max_len=128)]


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Body of an ``ERR`` reply: the error class name and a human message."""

    name: _Name
    message: Text


@dataclass(frozen=True, slots=True)
class Pong:
    """Who answered a ``ping``: server kind, package version, uptime."""

    server: _Name
    version: _Name
    uptime_s: float


@message("ping", reply=Pong)
@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness and identity check; every remote-g2 server answers it."""
