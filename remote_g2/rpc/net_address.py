"""Which address a server tells others: the rule every advertised endpoint follows.

A server binds an endpoint (``tcp://HOST:PORT``) and tells others where to
reach it: a source tells the registry (which hands it to every target), a
source's ranks put their peer lanes in their metadata, the registry tells
mirrors where its change feed is. What is bound is not always what can be
dialled from another host:

* a **wildcard** host (``0.0.0.0``, ``*``, ``::``) listens on every interface
  but is nobody's address — dialling it reaches the dialler's own host;
* a **loopback** host (``127.0.0.0/8``, ``::1``, ``localhost``) is reachable
  from this host only.

The rule (:func:`advertised_endpoint`): an explicit advertise address wins,
but never a wildcard, and never a loopback one when the party being told
(the registry) is not on this host's loopback; a wildcard bind advertises
the address this host reaches the registry from (the kernel's route toward
it, :func:`local_address_toward`); a loopback bind with a registry elsewhere
is refused, naming the settings, because every target elsewhere would be
handed an address it cannot reach and would silently recompute.

:func:`default_bind_host` is where a server left at its default binds: the
loopback when the registry is on loopback (or there is none), else the
address that reaches the registry — one box stays private by default, a
fleet works by default.
"""

from __future__ import annotations

import ipaddress
import socket

from remote_g2.rpc.endpoint_list import endpoint_list
from remote_g2.errors import ConfigError

__all__ = [
    "split_tcp",
    "with_host",
    "apply_advertise",
    "is_wildcard",
    "is_loopback",
    "reachable_elsewhere",
    "local_address_toward",
    "is_on_this_host",
    "default_bind_host",
    "advertised_endpoint",
    "toward_registry",
]

_WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "0:0:0:0:0:0:0:0"})


def split_tcp(endpoint: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``SCHEME://HOST:PORT`` (``[v6]`` brackets removed); ConfigError otherwise."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or not colon or not port.isdigit() or int(port) > 65535 or scheme not in ("tcp", "tcp+stream"):
        raise ConfigError(f"{endpoint!r}: expected tcp://HOST:PORT")
    return scheme, host.strip("[]"), int(port)


def with_host(endpoint: str, host: str) -> str:
    """``endpoint`` with its host replaced (scheme and port kept)."""
    scheme, _, port = split_tcp(endpoint)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def apply_advertise(bound: str, advertise: str) -> str:
    """``bound`` as told to others: ``advertise``'s host, and its port unless that is 0 or the bound one."""
    _, host, port = split_tcp(advertise)
    _, _, bound_port = split_tcp(bound)
    return with_host(bound if port in (0, bound_port) else advertise, host)


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in _WILDCARDS


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: we do not resolve names here (a blocking lookup); not loopback by its text
        return False


def reachable_elsewhere(endpoint: str) -> bool:
    """Whether another host could dial ``endpoint``: TCP, and neither a wildcard nor a loopback host."""
    try:
        _, host, _ = split_tcp(endpoint)
    except ConfigError:
        return False  # ipc:// and anything else is local to this host
    return not is_wildcard(host) and not is_loopback(host)


def local_address_toward(endpoint: str) -> str:
    """The local address the kernel would use to reach ``endpoint``'s host (nothing is sent).

    A connected UDP socket picks its source address from the route table
    without a packet leaving. ConfigError when there is no route.
    """
    _, host, port = split_tcp(endpoint)
    if is_wildcard(host):
        raise ConfigError(f"{endpoint!r} is a wildcard address: no host to find a route toward")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"no route from this host toward {endpoint}: {e}") from e


def is_on_this_host(endpoint: str | None) -> bool:
    """Whether ``endpoint`` (the registry) is reached over loopback: None, ipc://, a loopback address, or a
    name or address this host routes to itself (e.g. its own name mapped to ``127.0.1.1``)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return True
    _, host, _ = split_tcp(endpoint)
    if is_loopback(host):
        return True
    try:
        return is_loopback(local_address_toward(endpoint))
    except ConfigError:  # no route from here: certainly not this host
        return False


def toward_registry(setting: str | None) -> str | None:
    """The registry endpoint the rule routes toward, from a registry setting (one server or a failover list):
    the first server not on this host (then targets elsewhere must reach us), else the first; None for none."""
    if not setting:
        return None
    servers = endpoint_list(setting)
    return next((s for s in servers if not is_on_this_host(s)), servers[0])


def default_bind_host(toward: str | None) -> str:
    """Where a server left at its default binds: loopback unless ``toward`` (the registry) is elsewhere."""
    if is_on_this_host(toward):
        return "127.0.0.1"
    assert toward is not None
    return local_address_toward(toward)


def advertised_endpoint(bound: str, *, advertise: str | None, toward: str | None, what: str,
                        bind_setting: str, advertise_setting: str) -> str:
    """The endpoint to tell others for a server bound at ``bound`` (its real port), by the module's rule.

    ``advertise`` — the configured address (its host is used; a port of 0 or
    the bound port keeps the bound port, another port is kept as given: a
    NAT or proxy in front). ``toward`` — the endpoint of whoever is told
    (the registry), None when nobody is. ``what``, ``bind_setting`` and
    ``advertise_setting`` name the server and its settings in errors.
    """
    _, bound_host, bound_port = split_tcp(bound)
    remote_audience = not is_on_this_host(toward)
    if advertise:
        _, host, port = split_tcp(advertise)
        if is_wildcard(host):
            raise ConfigError(f"{what}: {advertise_setting}={advertise} is a wildcard address, which no other "
                              f"host can dial; set it to this host's routable address")
        if remote_audience and is_loopback(host):
            raise ConfigError(f"{what}: {advertise_setting}={advertise} is a loopback address but the registry "
                              f"({toward}) is not on this host's loopback: targets elsewhere could not reach it")
        return apply_advertise(bound, advertise)
    if is_wildcard(bound_host):
        if toward is None:
            raise ConfigError(f"{what}: bound to {bound} (every interface) with nobody to find a route toward; "
                              f"set {advertise_setting} to the address others should dial")
        return with_host(bound, local_address_toward(toward) if remote_audience else "127.0.0.1")
    if remote_audience and is_loopback(bound_host):
        raise ConfigError(f"{what}: {bind_setting}={bound} is a loopback address but the registry ({toward}) "
                          f"is not on this host's loopback: targets elsewhere could not reach it. Leave "
                          f"{bind_setting} unset (the address that reaches the registry is used), bind a "
                          f"routable address, or set {advertise_setting}")
    return bound
