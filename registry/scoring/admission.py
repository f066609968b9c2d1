"""Who gets a connection to the scoring API: bearer tokens, and two connection budgets that keep a flood of
strangers from crowding out the routers that hold a token.

A connection is *unauthenticated* from its accept (a TLS handshake in
progress included) until its first request carries a valid token (or, with
no token configured, until its first request head is in; with TLS client
certificates and no token, until its handshake ends). Unauthenticated
connections share a small budget (``max_unauthenticated``); when it is
full, a new connection takes the place of an old one, never the other way
round, so an attacker who holds the whole budget open cannot keep a valid
client out: the victim is the oldest connection of the source (an IPv4
address, an IPv6 /64) that holds the most, so one attacking host evicts
only its own connections while a valid client from elsewhere holds one. An
attacker with as many addresses as the budget, or behind the same address
as the client, can still race a client, who then has the time the attacker
needs to open a budget's worth of connections to send its first request.

Authenticated connections have their own, larger budget
(``max_authenticated``); when a connection authenticates with it full, the
least recently used idle authenticated connection is closed for it (a
router reopens one at the cost of a handshake), and with none idle the
request is refused (503). Nothing here touches a socket but through
:meth:`Admitted.evict`.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

__all__ = ["Admission", "Admitted", "BearerTokens", "source_of"]


class Admitted(Protocol):
    """What the budgets need of a connection."""

    source: str  # the key fairness is counted by (source_of)

    @property
    def idle(self) -> bool:
        """No request of it in progress: closing it loses no answer."""

    def evict(self) -> None:
        """Close it now (its handshake, its head, its keep-alive): the budget needs its place."""


def source_of(peername: object) -> str:
    """The fairness key of a peer: its IPv4 address, its IPv6 /64 (one host gets a whole /64), '' if unknown."""
    if not isinstance(peername, tuple) or not peername:
        return ""
    host = str(peername[0])
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))
    return host


class BearerTokens:
    """The tokens a request may present (``Authorization: Bearer <token>``); none configured: every request is
    accepted. Several may be valid at once, for rotation; every one is compared, in constant time, so the time
    taken says nothing about which matched or how much of one did."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._tokens = [t.encode() for t in tokens if t]

    @property
    def required(self) -> bool:
        return bool(self._tokens)

    def accept(self, header: str | None) -> bool:
        if not self._tokens:
            return True
        if not header:
            return False
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given_b = given.strip().encode("utf-8", "surrogateescape")
        ok = False
        for token in self._tokens:
            ok |= hmac.compare_digest(given_b, token)
        return ok


class Admission:
    """The two budgets; every call is made on the server's event loop (no lock)."""

    def __init__(self, max_unauthenticated: int, max_authenticated: int) -> None:
        if max_unauthenticated < 1 or max_authenticated < 1:
            raise ValueError("connection budgets must be at least 1")
        self.max_unauthenticated = max_unauthenticated
        self.max_authenticated = max_authenticated
        self._waiting: OrderedDict[Admitted, None] = OrderedDict()  # unauthenticated, oldest first
        self._per_source: dict[str, int] = {}
        self._authed: OrderedDict[Admitted, None] = OrderedDict()  # least recently used first
        self.evicted_unauthenticated = 0
        self.evicted_idle = 0
        self.refused = 0

    @property
    def unauthenticated(self) -> int:
        return len(self._waiting)

    @property
    def authenticated(self) -> int:
        return len(self._authed)

    def admit(self, conn: Admitted) -> None:
        """A new connection (accepted, before any handshake): unauthenticated, taking an old one's place if
        the budget is full."""
        if len(self._waiting) >= self.max_unauthenticated:
            victim = self._victim()
            self._forget_waiting(victim)
            self.evicted_unauthenticated += 1
            victim.evict()
        self._waiting[conn] = None
        self._per_source[conn.source] = self._per_source.get(conn.source, 0) + 1

    def _victim(self) -> Admitted:
        """The oldest unauthenticated connection of the source holding the most of them."""
        most = max(self._per_source.values())
        for conn in self._waiting:
            if self._per_source[conn.source] == most:
                return conn
        raise AssertionError("a source counted with no connection")  # (the counts follow _waiting exactly)

    def authenticate(self, conn: Admitted) -> bool:
        """``conn`` proved it may ask: it leaves the small budget for the large one. False: the large one is
        full of busy connections (the caller refuses the request and closes it)."""
        if conn in self._authed:
            self._authed.move_to_end(conn)
            return True
        if len(self._authed) >= self.max_authenticated:
            for other in self._authed:  # least recently used first
                if other.idle:
                    del self._authed[other]
                    self.evicted_idle += 1
                    other.evict()
                    break
            else:
                self.refused += 1
                return False
        self._forget_waiting(conn)
        self._authed[conn] = None
        return True

    def touch(self, conn: Admitted) -> None:
        """An authenticated connection's request: it is the most recently used."""
        if conn in self._authed:
            self._authed.move_to_end(conn)

    def release(self, conn: Admitted) -> None:
        """The connection is gone (closed by either side); idempotent."""
        self._forget_waiting(conn)
        self._authed.pop(conn, None)

    def _forget_waiting(self, conn: Admitted) -> None:
        if self._waiting.pop(conn, 0) is None:  # (present: its value is None)
            left = self._per_source[conn.source] - 1
            if left:
                self._per_source[conn.source] = left
            else:
                del self._per_source[conn.source]

    def everyone(self) -> list[Admitted]:
        return [*self._waiting, *self._authed]
