"""Several "hosts" on one Linux box: network namespaces on a private bridged subnet, for multi-host tests.

::

    from remote_g2.adapters.reference.netns import Hosts, netns_unavailable_reason

    if (why := netns_unavailable_reason()) is None:
        with Hosts(["registry", "source", "target"]) as hosts:
            reg = hosts["registry"]                     # Host(name, netns, address="10.200.0.1", ...)
            subprocess.Popen(reg.command(["remote-g2", "serve", "--bind", "tcp://0.0.0.0:7450"]))
            ...                                        # every process left in the namespaces dies at close()

Layout: one *switch* namespace holds a Linux bridge; every host namespace
gets a veth pair into it (``Host.interface`` on the host's side) with the
address ``{subnet}.{i+1}/24``, hosts numbered in the order given, and ``lo``
up. The subnet exists only inside the namespaces: nothing is added to the
root namespace, so the test process itself cannot reach the hosts over TCP
(Unix sockets and files are shared: the namespaces are network-only).

``shared_address`` adds the same ``/32`` address on one more interface of
EVERY host (``Host.shared_interface``), the way a container runtime's
``172.17.0.1`` shows up on every machine: UCX over TCP then dials that
address and reaches itself. A ``dummy`` interface when the kernel has that
driver, else a veth pair kept inside the host (both ends up: an interface
UCX sees as active).

All namespaces share one kernel, so UCX picks shared memory between them
unless told otherwise: set ``UCX_TLS=tcp`` for traffic to cross the veths.

Needs root and iproute2 (``netns_unavailable_reason()`` says why not, for a
``pytest.skip``). Names are ``rg2-<pid>-<n>-<name>`` (and
``rg2-<pid>-<n>-switch``), unique per process and instance;
``remove_stale()`` deletes those whose creating process is gone.
:meth:`Hosts.close` (also run at interpreter exit) kills every process left
inside the namespaces, by PID, and deletes them.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import json
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Host", "Hosts", "NetnsError", "list_netns", "netns_unavailable_reason", "remove_stale"]

log = logging.getLogger("remote_g2.adapters.reference.netns")

PREFIX = "rg2-"
SWITCH = "switch"          # suffix of the bridge's namespace (so not a valid host name)
HOST_IFACE = "rg2eth0"     # the host's end of its veth into the bridge (≤ 15 chars: IFNAMSIZ)
SHARED_IFACE = "rg2dup0"   # carries ``shared_address``
_BRIDGE = "rg2br0"
_CMD_TIMEOUT_S = 15.0
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")

_counter = itertools.count()
_open: weakref.WeakSet[Hosts] = weakref.WeakSet()
_open_lock = threading.Lock()


class NetnsError(RuntimeError):
    """Creating or removing a namespace (or a link in one) failed; the message names the ``ip`` command and its error."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *args]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(cmd)}` did not finish within {_CMD_TIMEOUT_S} s") from e
    if check and res.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (rc={res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


@functools.lru_cache(maxsize=1)
def netns_unavailable_reason() -> str | None:
    """None when namespaces can be made here (root, ``ip`` on PATH, a probe namespace with a bridge and a veth
    pair works); else a one-line reason, for ``pytest.skip``. Probed once per process."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not on PATH; install iproute2"
    probe = f"{PREFIX}{os.getpid()}-{next(_counter)}-probe"
    try:
        _ip("netns", "add", probe)
    except NetnsError as e:
        return f"cannot create a network namespace: {e}"
    try:
        _ip("-n", probe, "link", "add", "rg2p0", "type", "veth", "peer", "name", "rg2p1")
        _ip("-n", probe, "link", "add", "rg2pbr", "type", "bridge")
        _ip("netns", "exec", probe, "true")
    except NetnsError as e:
        return f"network namespaces are not usable here: {e}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One "host": a network namespace with one address on the private subnet.

    ``interface`` is its link to the others (for ``UCX_NET_DEVICES``);
    ``shared_interface`` carries the address every host has (``""`` unless
    :class:`Hosts` was given ``shared_address``).
    """

    name: str
    netns: str
    address: str
    interface: str = HOST_IFACE
    shared_interface: str = ""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host: ``["ip", "netns", "exec", netns, *argv]`` (same PID, same process group
        as the command itself: ``ip netns exec`` execs it)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def interface_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes so far on ``interface``: what crossed between this host and the others."""
        out = json.loads(_ip("-n", self.netns, "-j", "-s", "link", "show", self.interface).stdout)
        stats = out[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


class Hosts:
    """Namespaces ``names`` on ``{subnet}.0/24`` behind one bridge, made at construction; a context manager.

    ``hosts[name]`` is a :class:`Host`; iterating yields them in order. A
    failure while building removes whatever was made and raises
    :class:`NetnsError`. :meth:`close` is idempotent, also runs at
    interpreter exit, and kills (SIGKILL, by PID) every process still inside
    the namespaces before deleting them.
    """

    def __init__(self, names: Sequence[str], *, subnet: str = "10.200.0", shared_address: str | None = None) -> None:
        names = list(names)
        if not names:
            raise ValueError("Hosts needs at least one host name")
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        for n in names:
            if not _NAME_RE.match(n) or n == SWITCH:
                raise ValueError(f"host name {n!r}: lower-case letters, digits, '_' (at most 32), not {SWITCH!r}")
        if len(names) > 253:
            raise ValueError("at most 253 hosts on one /24")
        try:
            ipaddress.IPv4Network(f"{subnet}.0/24")
        except ValueError as e:
            raise ValueError(f"subnet {subnet!r} is not the first three octets of an IPv4 /24") from e
        if shared_address is not None:
            ipaddress.IPv4Address(shared_address)  # ValueError when it is not one
        self.subnet = subnet
        self.shared_address = shared_address
        self._owner = os.getpid()
        base = f"{PREFIX}{self._owner}-{next(_counter)}"
        self.switch_netns = f"{base}-{SWITCH}"
        self._made: list[str] = []  # namespaces created so far, removed by close()
        self._closed = False
        self._hosts: dict[str, Host] = {}
        with _open_lock:
            _open.add(self)
        try:
            self._build(base, names)
        except BaseException:
            self.close()
            raise

    def _build(self, base: str, names: list[str]) -> None:
        sw = self.switch_netns
        self._add_netns(sw)
        _ip("-n", sw, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", _BRIDGE, "up")
        dummy_ok = True
        for i, name in enumerate(names):
            ns = f"{base}-{name}"
            self._add_netns(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            port = f"p{i}"  # the bridge's end, in the switch namespace
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", HOST_IFACE, "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", _BRIDGE)
            _ip("-n", sw, "link", "set", port, "up")
            address = f"{self.subnet}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", HOST_IFACE)
            _ip("-n", ns, "link", "set", HOST_IFACE, "up")
            shared_iface = ""
            if self.shared_address is not None:
                shared_iface = SHARED_IFACE
                if dummy_ok and _ip("-n", ns, "link", "add", SHARED_IFACE, "type", "dummy", check=False).returncode:
                    dummy_ok = False  # no dummy driver in this kernel: a veth pair looks the same to UCX
                if not dummy_ok:
                    _ip("-n", ns, "link", "add", SHARED_IFACE, "type", "veth", "peer", "name", "rg2dup1")
                    _ip("-n", ns, "link", "set", "rg2dup1", "up")
                _ip("-n", ns, "addr", "add", f"{self.shared_address}/32", "dev", SHARED_IFACE)
                _ip("-n", ns, "link", "set", SHARED_IFACE, "up")
            self._hosts[name] = Host(name, ns, address, HOST_IFACE, shared_iface)
        self._wait_links_up()

    def _add_netns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def _wait_links_up(self, timeout_s: float = 10.0) -> None:
        """Bounded wait until every host's link to the bridge has carrier (veths come up asynchronously)."""
        deadline = time.monotonic() + timeout_s
        for h in self._hosts.values():
            while "LOWER_UP" not in _ip("-n", h.netns, "link", "show", HOST_IFACE).stdout:
                if time.monotonic() > deadline:
                    raise NetnsError(f"{h.netns}: {HOST_IFACE} has no carrier after {timeout_s} s")
                time.sleep(0.02)

    def __getitem__(self, name: str) -> Host:
        return self._hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts.values())

    def __len__(self) -> int:
        return len(self._hosts)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process still inside the namespaces (SIGKILL, by PID), then delete them. Idempotent; only
        the process that made them removes them (a forked child's exit leaves them alone)."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        errors = []
        for ns in reversed(self._made):
            try:
                _remove_netns(ns)
            except NetnsError as e:
                errors.append(str(e))
        self._made.clear()
        with _open_lock:
            _open.discard(self)
        if errors:
            raise NetnsError("; ".join(errors))

    def __repr__(self) -> str:
        hosts = ", ".join(f"{h.name}={h.address}" for h in self._hosts.values())
        return f"Hosts({hosts}{', closed' if self._closed else ''})"


def _pids_in(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()] if res.returncode == 0 else []


def _remove_netns(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL what runs in ``ns`` (by PID, bounded wait for them to go) and delete it."""
    deadline = time.monotonic() + timeout_s
    while pids := _pids_in(ns):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in namespace {ns} survived SIGKILL for {timeout_s} s")
        time.sleep(0.02)
    res = _ip("netns", "del", ns, check=False)
    if res.returncode != 0 and ns in list_netns():
        raise NetnsError(f"`ip netns del {ns}` failed: {res.stderr.strip()}")


def list_netns() -> list[str]:
    """The names of the named network namespaces (``ip netns list``)."""
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces named ``{prefix}<pid>-...`` whose creating process ``pid`` is dead (killing what
    still runs inside them first); the names removed. Namespaces of live processes are left alone."""
    removed = []
    for ns in list_netns():
        if not ns.startswith(prefix):
            continue
        pid = ns[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            _remove_netns(ns)
            removed.append(ns)
        except NetnsError as e:
            log.warning("could not remove stale namespace %s: %s", ns, e)
    return removed


@atexit.register
def _close_all() -> None:
    with _open_lock:
        left = list(_open)
    for hosts in left:
        try:
            hosts.close()
        except NetnsError as e:
            log.warning("%s", e)
