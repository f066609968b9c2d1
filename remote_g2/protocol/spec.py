"""The message table's machinery, and the field types the conversations share.

:func:`message` registers a request dataclass under its wire name with the
dataclass its ``OK`` reply carries (or ``None``: one-way), compiling both
codecs at import time; :data:`MESSAGES` holds the rows and
:func:`spec_for_request` finds the row of a request class. The rows
themselves are declared one module per conversation (``*_messages.py`` beside
this one); :mod:`remote_g2.protocol.messages` imports them all, so code that
decodes frames takes the table from there, never from here (a module that
imported only this one would see a table without the conversations it did not
import).

The aliases below are field annotations (the wire schema, see
:mod:`remote_g2.protocol.schema`) used by more than one conversation; one used
by a single conversation stays in its module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

from remote_g2.errors import UnknownMessage
from remote_g2.protocol.schema import Limits, Packed, decoder_for, encoder_for

__all__ = [
    "MESSAGES",
    "MessageSpec",
    "message",
    "spec_for_request",
    "Addr",
    "AgentName",
    "BlockIds",
    "Count",
    "Endpoint",
    "Epoch",
    "Rank",
    "Short",
    "Text",
    "Ttl",
    "WorkerId",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MessageSpec:
    """One row of the message table: wire name, request class, reply class."""

    name: str
    request: type
    reply: type | None  # None: a one-way message (local links only)
    doc: str


MESSAGES: dict[str, MessageSpec] = {}
_by_class: dict[type, MessageSpec] = {}


def message(name: str, *, reply: type | None) -> Callable[[type[T]], type[T]]:
    """Register a request dataclass under ``name`` with the dataclass of its reply.

    ``reply=None`` registers a one-way message: it travels only over a
    worker's private :mod:`~remote_g2.rpc.local_link` links or the registry's
    change feed, never as an RPC (no RPC server has a handler for it, so one
    sent there is answered ``ERR``).

    Compiles both codecs at import time so a bad annotation fails loudly at
    start-up rather than on the first request. A duplicate name is an error.
    """

    def register(cls: type[T]) -> type[T]:
        if name in MESSAGES or name in ("OK", "ERR"):
            raise TypeError(f"duplicate message name {name!r}")
        cls.WIRE_NAME = name  # type: ignore[attr-defined]
        for c in (cls, reply) if reply is not None else (cls,):
            decoder_for(c)
            encoder_for(c)
        spec = MessageSpec(name, cls, reply, (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "")
        MESSAGES[name] = spec
        _by_class[cls] = spec
        return cls

    return register


def spec_for_request(cls: type) -> MessageSpec:
    """The table row for a request class; :class:`UnknownMessage` if it is not registered."""
    spec = _by_class.get(cls)
    if spec is None:
        raise UnknownMessage(f"{cls.__name__} is not a registered request message")
    return spec


# --------------------------------------------------------------------------
# Field types more than one conversation uses
# --------------------------------------------------------------------------

Text = Annotated[str, Limits(max_len=4096)]
Short = Annotated[str, Limits(max_len=64)]
WorkerId = Annotated[str, Limits(min_len=1, max_len=128)]
Endpoint = Annotated[str, Limits(min_len=1, max_len=256)]
Count = Annotated[int, Limits(ge=0)]
Epoch = Annotated[int, Limits(ge=0)]
#: A NIXL agent's name.
AgentName = Annotated[str, Limits(min_len=1, max_len=256)]
#: A TP rank.
Rank = Annotated[int, Limits(ge=0, le=4095)]
#: An address or a size in bytes in a registered region.
Addr = Annotated[int, Limits(ge=0)]
#: A lease's time to live, in milliseconds.
Ttl = Annotated[int, Limits(ge=1, le=3_600_000)]
BlockIds = Annotated[list[Annotated[int, Limits(ge=0)]], Limits(max_len=65_536), Packed()]  # u64 LE bin on the wire
