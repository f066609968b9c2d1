"""Across hosts with default settings: a registry, a source engine and a target engine on three "hosts".

The hosts are Linux network namespaces on one box (:mod:`remote_g2.adapters.reference.netns`):
a private subnet behind a bridge, which exists only inside the namespaces,
so nothing reaches another host over loopback. The registry runs as an
operator would start it (``remote-g2 serve --bind tcp://0.0.0.0:PORT``, its
change feed on the same wildcard), and the engines get nothing but
``--source|--target --registry tcp://<registry host>:PORT``: no bind or
advertise address. ``UCX_TLS=tcp`` on every engine, since all namespaces
share one kernel and UCX would otherwise move the bytes through shared
memory, not across the veths (the target's link counters check that they
did cross).

Checked: the reference engines TP 2 → 2 and 2 → 1 reuse remote blocks with
tokens and logits bit-identical to the source's own run; a source killed
mid-load (lease resolved, READ about to be posted) means recompute, not a
hang; a target's registry mirror follows the registry's change feed across
hosts and answers the lookups; an address present on every host (the trap
where UCX over TCP dials itself) never fails silently, and pinning UCX to
the hosts' link (``UCX_NET_DEVICES``) makes reuse work; ``remote-g2 demo
--netns``.

Needs root (skipped with the reason otherwise; CI runs as root). Every
process is stopped by PID / process group and every namespace removed, also
when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from bench.common import stop_group
from conftest import engine_prompt
from remote_g2.adapters.reference.launch import EngineProcess, mpiexec_path
from remote_g2.adapters.reference.messages import EngineResult
from remote_g2.adapters.reference import netns
from remote_g2.adapters.reference.netns import (Host, Hosts, NetnsError, list_netns, netns_unavailable_reason,
                                               remove_stale)

from remote_g2.identity.hashing import chain_block_hashes

_WHY_NOT = netns_unavailable_reason()

pytestmark = [pytest.mark.mpi, pytest.mark.nixl, pytest.mark.slow,
              pytest.mark.skipif(_WHY_NOT is not None, reason=f"multi-host tests: {_WHY_NOT}"),
              pytest.mark.skipif(mpiexec_path() == "mpiexec", reason="mpiexec is not in the venv (pip install mpich)")]

TPB = 16
TESTS = str(Path(__file__).resolve().parent)
SLOW = "fault_procs.slow_transfer:SlowNixlTransfer"
REGISTRY_PORT = 7450   # each registry host is a fresh namespace: the port is free there
UCX_TCP = {"UCX_TLS": "tcp"}
SHARED_ADDRESS = "172.31.255.1"

# Run inside a host (the test process cannot reach the subnet): wait until the registry lists ``blocks``
# blocks of a worker; print the count and the endpoint that worker advertised.
_WAIT_BLOCKS = """
import json, sys
from remote_g2.registry import RegistryClient
with RegistryClient(sys.argv[1]) as reg:
    n = reg.wait_for_blocks(sys.argv[2], int(sys.argv[3]), timeout_s=float(sys.argv[4]))
    w = reg.worker_info(sys.argv[2])
print(json.dumps({"blocks": n, "endpoint": getattr(w, "endpoint", None)}))
"""

# Run inside the target's host: the value of one counter on its leader's /metrics.
_METRIC = """
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
print(sum(float(l.split()[-1]) for l in text.splitlines() if l.split() and l.split()[0] == sys.argv[2]))
"""


def _python_in(host: Host, code: str, *args: str, timeout_s: float = 30.0) -> str:
    res = subprocess.run(host.command([sys.executable, "-c", code, *args]), capture_output=True, text=True,
                         timeout=timeout_s)
    assert res.returncode == 0, f"in {host.name}: {res.stderr[-2000:]}"
    return res.stdout


@dataclass
class Registry:
    """A ``remote-g2 serve`` running in its host, bound to the wildcard; ``endpoint`` is what the others dial."""

    proc: subprocess.Popen[bytes]
    endpoint: str
    banner: str   # its "serving on ... change feed on ..." line
    log: Path

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to its own process group (it runs in its own session)."""
        stop_group(self.proc, timeout_s=10)


def start_registry(host: Host, log_dir: Path, *extra: str, timeout_s: float = 30.0,
                   bind: str = f"tcp://0.0.0.0:{REGISTRY_PORT}") -> Registry:
    log = log_dir / f"registry-{host.netns}-{bind.rsplit(':', 1)[1]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(host.command([sys.executable, "-m", "remote_g2.cli", "serve",
                                              "--bind", bind, *extra]),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    reg = Registry(proc, f"tcp://{host.address}:{bind.rsplit(':', 1)[1]}", "", log)
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "registry serving on" in ln]
        if lines:
            reg.banner = lines[0]
            return reg
        if proc.poll() is not None or time.monotonic() > deadline:
            reg.stop()
            raise RuntimeError(f"the registry in {host.name} did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)


def wait_published(hosts: Hosts, registry: Registry, worker: str, blocks: int, timeout_s: float = 15.0) -> dict:
    """Wait (from the target's host) until the registry lists ``blocks`` blocks of ``worker``; what it lists."""
    out = json.loads(_python_in(hosts["target"], _WAIT_BLOCKS, registry.endpoint, worker, str(blocks),
                                str(timeout_s), timeout_s=timeout_s + 30))
    assert out["blocks"] >= blocks, f"{worker}'s blocks never reached the registry: {out}"
    return out


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    return a.tokens == b.tokens and a.logits == b.logits


def _explain(*engines: EngineProcess) -> str:
    return "\n".join(f"--- {e.worker_id} log:\n{e.log_tail(3000)}" for e in engines)


def test_hosts_reach_each_other_only_inside_and_close_removes_everything() -> None:
    hosts = Hosts(["a", "b"], subnet="10.201.7")
    names = [h.netns for h in hosts] + [hosts.switch_netns]
    try:
        assert [(h.name, h.address) for h in hosts] == [("a", "10.201.7.1"), ("b", "10.201.7.2")]
        assert all(n in list_netns() for n in names)
        listener = subprocess.Popen(hosts["a"].command([sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(('0.0.0.0', 9000)); s.listen(); c, a = s.accept(); "
            "print(a[0], flush=True); c.close()")]), stdout=subprocess.PIPE, text=True)
        try:
            _python_in(hosts["b"], "import socket, sys, time\n"
                       "for _ in range(100):\n"
                       "    try:\n        socket.create_connection(('10.201.7.1', 9000), timeout=2).close(); break\n"
                       "    except ConnectionRefusedError:\n        time.sleep(0.05)\n"
                       "else:\n    sys.exit('never connected')")
            out, _ = listener.communicate(timeout=10)
            assert out.strip() == "10.201.7.2"
        finally:
            if listener.poll() is None:
                listener.kill()
                listener.wait(5)
        root = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True, timeout=10).stdout
        assert "10.201.7." not in root, "the private subnet leaked into the root namespace"
        stray = subprocess.Popen(hosts["b"].command(["sleep", "60"]))
        time.sleep(0.2)
    finally:
        hosts.close()
    assert stray.wait(10) == -signal.SIGKILL  # close() killed what still ran inside
    assert not any(n in list_netns() for n in names)
    hosts.close()  # idempotent


def test_hosts_that_fail_half_built_remove_what_they_made(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(list_netns())
    real_ip = netns._ip

    def failing_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if args[:3] == ("-n", args[1], "addr") and "10.202.0.2/24" in args:
            raise NetnsError("injected: the second host's address")
        return real_ip(*args, check=check)

    monkeypatch.setattr(netns, "_ip", failing_ip)
    with pytest.raises(NetnsError, match="injected"):
        Hosts(["a", "b", "c"], subnet="10.202.0")
    assert set(list_netns()) == before


def test_remove_stale_removes_namespaces_of_dead_creators_only() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(5)
    stale, mine = f"rg2-{dead.pid}-0-x", f"rg2-{os.getpid()}-999-x"
    for n in (stale, mine):
        subprocess.run(["ip", "netns", "add", n], check=True, timeout=10)
    try:
        removed = remove_stale()
        assert stale in removed and mine not in removed
        assert stale not in list_netns() and mine in list_netns()
    finally:
        for n in (stale, mine):
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=10)


@dataclass
class Net:
    hosts: Hosts
    registry: Registry


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    """Three hosts (registry, source, target) and a registry on the wildcard, for the module."""
    remove_stale()  # namespaces a killed earlier run left behind
    hosts = Hosts(["registry", "source", "target"])
    registry = None
    try:
        registry = start_registry(hosts["registry"], tmp_path_factory.mktemp("registry"))
        yield Net(hosts, registry)
    finally:
        if registry is not None:
            registry.stop()
        hosts.close()


class SharedSource:
    """The module's TP 2 source engine on the source host, and every block it has served (to wait for them)."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.served: set[bytes] = set()
        self.engine = EngineProcess("src", tp=2, args=["--source", "--registry", net.registry.endpoint],
                                    env=UCX_TCP, netns=net.hosts["source"])

    def serve(self, request_id: str, prompt: list[int], new_tokens: int) -> EngineResult:
        result = self.engine.client.generate(request_id, prompt, new_tokens, cache="local")
        assert result.ok, result.error
        self.served.update(chain_block_hashes(prompt, TPB))
        return result

    def wait_published(self) -> dict:
        return wait_published(self.net.hosts, self.net.registry, "src", len(self.served))


@pytest.fixture(scope="module")
def source(net: Net) -> Iterator[SharedSource]:
    """A TP 2 source engine on the source host: default settings, only the registry's address."""
    src = SharedSource(net)
    try:
        yield src
    finally:
        src.engine.stop()
        assert not src.engine.leftover()


@pytest.mark.parametrize("target_tp", [2, 1])
def test_reference_engines_reuse_across_hosts_bit_identically(net: Net, source: SharedSource,
                                                              target_tp: int) -> None:
    prompt = engine_prompt(200, seed=300 + target_tp)
    reusable = (len(prompt) - 1) // TPB
    src = source.serve(f"p{target_tp}", prompt, 4)
    listed = source.wait_published()
    # With defaults the source must advertise the address that reaches the registry, not loopback.
    assert listed["endpoint"].startswith(f"tcp://{net.hosts['source'].address}:"), listed
    target = EngineProcess(f"tgt{target_tp}", tp=target_tp, args=["--target", "--registry", net.registry.endpoint],
                           env=UCX_TCP, netns=net.hosts["target"])
    try:
        rx0, _ = net.hosts["target"].interface_bytes()
        remote = target.client.generate("remote", prompt, 4, cache="all", timeout_s=60)
        rx1, _ = net.hosts["target"].interface_bytes()
        assert remote.ok, remote.error
        assert (remote.blocks_remote, remote.blocks_remote_failed, remote.remote_reason) == (reusable, 0, "ok"), \
            (remote, _explain(target, source.engine))
        assert remote.blocks_computed == len(prompt) // TPB - reusable
        assert _same(remote, src), "the target's tokens or logits differ from the source's own run"
        # The KV came over the link between the hosts (not shared memory): at least its bytes were received.
        assert remote.bytes_remote > 0 and rx1 - rx0 >= remote.bytes_remote, (rx1 - rx0, remote.bytes_remote)
    finally:
        target.stop()
    assert not target.leftover()


def test_source_killed_mid_load_across_hosts_means_recompute(net: Net, tmp_path: Path) -> None:
    prompt = engine_prompt(200, seed=310)
    full = len(prompt) // TPB
    doomed = EngineProcess("src-doomed", tp=2, args=["--source", "--registry", net.registry.endpoint], env=UCX_TCP,
                           netns=net.hosts["source"])
    target = None
    try:
        src = doomed.client.generate("p", prompt, 4, cache="local")
        wait_published(net.hosts, net.registry, "src-doomed", full)
        marker = tmp_path / "reading"  # the slowed adapter touches it once the lease is resolved
        target = EngineProcess("tgt-kill", tp=2, args=["--target", "--registry", net.registry.endpoint,
                                                       "--transfer", SLOW, "--target-timeout-ms", "5000"],
                               env={**UCX_TCP, "PYTHONPATH": TESTS, "REMOTE_G2_TEST_READING_FILE": str(marker),
                                    "REMOTE_G2_TEST_READ_DELAY_S": "1.5"},
                               netns=net.hosts["target"])
        t0 = time.monotonic()
        target.client.submit("r", prompt, 4, cache="all")
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, f"the lease was never resolved\n{_explain(target, doomed)}"
            time.sleep(0.02)
        doomed.kill()  # SIGKILL to mpiexec and both source ranks, with the lease open and the READ about to go
        result = target.client.wait(["r"], timeout_s=30)["r"]
        took = time.monotonic() - t0
        assert result.ok, result.error
        assert result.blocks_remote == 0 and result.blocks_remote_failed == (len(prompt) - 1) // TPB, \
            (result, _explain(target))
        assert result.remote_error, "a failed load must say why"
        assert result.blocks_computed == full
        assert _same(result, src), "the recomputed output differs from the source's"
        assert took < 5.0 + 10.0, f"the failed load took {took:.1f} s"
        again = target.client.generate("again", prompt, 4, cache="all")  # the engine is unharmed
        assert _same(again, src) and again.blocks_g1 == (len(prompt) - 1) // TPB
    finally:
        if target is not None:
            target.stop()
        doomed.stop()


# Run inside a host: register a worker by hand at a registry; print the error's class and message (or "ok").
_REGISTER = """
import sys
from remote_g2.errors import RemoteG2Error
from remote_g2.protocol.messages import LayoutFingerprint
from remote_g2.registry import RegistryClient
fp = LayoutFingerprint("m", "bf16", 16, "HND", 2, 4, 32, 1)
with RegistryClient(sys.argv[1], timeout_s=10) as reg:
    try:
        reg.register_worker("by-hand", sys.argv[2], fp, epoch=1)
        print("ok")
    except RemoteG2Error as e:
        print(type(e).__name__, e)
"""


def test_addresses_other_hosts_cannot_dial_are_refused_and_a_wildcard_bind_advertises_the_route(
        net: Net, tmp_path: Path) -> None:
    """A source bound to loopback with the registry elsewhere refuses to start, naming the setting; one bound
    to 0.0.0.0 advertises its address on the subnet; a registry bound to a routable address refuses a
    loopback endpoint, and the wildcard-bound one refuses a wildcard endpoint."""
    with pytest.raises(RuntimeError, match="REMOTE_G2_SOURCE_BIND=tcp://127.0.0.1:0 is a loopback address"):
        EngineProcess("src-lo", tp=1, args=["--source", "--registry", net.registry.endpoint],
                      env={**UCX_TCP, "REMOTE_G2_SOURCE_BIND": "tcp://127.0.0.1:0"}, netns=net.hosts["source"],
                      start_timeout_s=60)
    prompt = engine_prompt(80, seed=350)
    wild = EngineProcess("src-wild", tp=1, args=["--source", "--registry", net.registry.endpoint],
                         env={**UCX_TCP, "REMOTE_G2_SOURCE_BIND": "tcp://0.0.0.0:0"}, netns=net.hosts["source"])
    target = None
    try:
        src = wild.client.generate("p", prompt, 2, cache="local")
        listed = wait_published(net.hosts, net.registry, "src-wild", len(prompt) // TPB)
        assert listed["endpoint"].startswith(f"tcp://{net.hosts['source'].address}:"), listed
        target = EngineProcess("tgt-wild", tp=1, args=["--target", "--registry", net.registry.endpoint],
                               env=UCX_TCP, netns=net.hosts["target"])
        remote = target.client.generate("r", prompt, 2, cache="all", timeout_s=60)
        assert remote.blocks_remote == (len(prompt) - 1) // TPB and _same(remote, src), (remote, _explain(target))
    finally:
        if target is not None:
            target.stop()
        wild.stop()
    said = _python_in(net.hosts["source"], _REGISTER, net.registry.endpoint, "tcp://0.0.0.0:9")
    assert said.startswith("RegistryError") and "wildcard address no target can dial" in said, said
    routable = start_registry(net.hosts["registry"], tmp_path, "--feed-bind", "none",
                              bind=f"tcp://{net.hosts['registry'].address}:{REGISTRY_PORT + 1}")
    try:
        said = _python_in(net.hosts["source"], _REGISTER, routable.endpoint, "tcp://127.0.0.1:9")
        assert said.startswith("RegistryError") and "is a loopback address" in said, said
        assert _python_in(net.hosts["source"], _REGISTER, routable.endpoint,
                          f"tcp://{net.hosts['source'].address}:9").strip() == "ok"
    finally:
        routable.stop()


def test_target_registry_mirror_follows_the_feed_across_hosts(net: Net, source: SharedSource) -> None:
    metrics_port = "9464"  # in the target's own namespace
    target = EngineProcess("tgt-mirror", tp=1, args=["--target", "--registry", net.registry.endpoint],
                           env={**UCX_TCP, "REMOTE_G2_TARGET_REGISTRY_MIRROR": "1",
                                "REMOTE_G2_TARGET_METRICS_PORT": metrics_port},
                           netns=net.hosts["target"])

    def mirror_lookups() -> float:
        return float(_python_in(net.hosts["target"], _METRIC, metrics_port, "remote_g2_target_mirror_lookups_total"))

    try:
        # Published after the target (and its mirror) started: they reach the mirror through the feed only.
        warm = [engine_prompt(40, seed=320 + i) for i in range(6)]
        prompt = engine_prompt(200, seed=330)
        for i, w in enumerate(warm):
            source.serve(f"warm{i}", w, 1)
        src = source.serve("mirror", prompt, 4)
        source.wait_published()
        # The mirror answers once its copy is complete (the server does until then): bounded warm-up.
        for i, w in enumerate(warm):
            r = target.client.generate(f"warm{i}", w, 1, cache="all")
            if r.blocks_remote and mirror_lookups() > 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the target's registry mirror never answered a lookup with a remote hit; registry: "
                        f"{net.registry.banner!r}\n{_explain(target)}")
        before = mirror_lookups()
        remote = target.client.generate("remote", prompt, 4, cache="all", timeout_s=60)
        assert mirror_lookups() >= before + 1, "the lookup went to the server, not the mirror"
        assert remote.ok and remote.remote_reason == "ok", (remote, _explain(target))
        assert remote.blocks_remote == (len(prompt) - 1) // TPB
        assert _same(remote, src)
    finally:
        target.stop()


def test_an_address_on_every_host_never_fails_silently_and_pinning_the_link_works(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host also holds ``SHARED_ADDRESS`` (like a container runtime's 172.17.0.1 on every machine).

    With UCX's defaults (only ``UCX_TLS=tcp``) the target's UCX may dial that address and reach itself:
    then the load must fail visibly (UCX's error line and NIXL's in the target's log, the blocks counted as
    failed, the output recomputed bit for bit), never silently. ``UCX_NET_DEVICES`` = the hosts' link on
    both sides makes reuse work.
    """
    monkeypatch.delenv("UCX_LOG_LEVEL", raising=False)  # the launcher's own default must let UCX's reason out
    with Hosts(["registry", "source", "target"], shared_address=SHARED_ADDRESS) as hosts:
        registry = start_registry(hosts["registry"], tmp_path_factory.mktemp("registry-dup"))
        try:
            for label, extra in (("default", {}), ("pinned", {"UCX_NET_DEVICES": hosts["source"].interface})):
                prompt = engine_prompt(120, seed=340 if label == "default" else 341)
                reusable = (len(prompt) - 1) // TPB
                env = {**UCX_TCP, **extra}
                source = EngineProcess(f"src-{label}", tp=1, args=["--source", "--registry", registry.endpoint],
                                       env=env, netns=hosts["source"])
                target = None
                try:
                    src = source.client.generate("p", prompt, 3, cache="local")
                    wait_published(hosts, registry, f"src-{label}", len(prompt) // TPB)
                    target = EngineProcess(f"tgt-{label}", tp=1, args=["--target", "--registry", registry.endpoint],
                                           env=env, netns=hosts["target"])
                    remote = target.client.generate("r", prompt, 3, cache="all", timeout_s=60)
                    assert remote.ok, remote.error
                    assert _same(remote, src)
                    log = target.log_tail(100_000)
                    if label == "pinned" or remote.blocks_remote:
                        assert (remote.blocks_remote, remote.blocks_remote_failed) == (reusable, 0), \
                            (label, remote, _explain(target, source))
                    else:  # the trap: the failure and its cause are in plain sight
                        assert remote.blocks_remote_failed == reusable, (remote, log[-3000:])
                        assert "NIXL_ERR_BACKEND" in log, log[-3000:]
                        # ... and in the result: the backend's words, and where UCX's own reason went.
                        assert "NIXL_ERR_BACKEND" in remote.remote_error and "UCX_LOG_LEVEL" in remote.remote_error
                        assert "UCX  ERROR" in log and SHARED_ADDRESS in log, \
                            f"UCX's own error line (naming {SHARED_ADDRESS}) is not in the target's log:\n{log[-3000:]}"
                finally:
                    if target is not None:
                        target.stop()
                    source.stop()
        finally:
            registry.stop()


def test_demo_across_namespaces_reports_remote_reuse_and_identical_outputs() -> None:
    cmd = [sys.executable, "-m", "remote_g2.cli", "demo", "--netns", "--json", "--source-tp", "2", "--target-tp",
           "1", "--prompts", "2", "--prefix-tokens", "256", "--suffix-tokens", "32", "--new-tokens", "3"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["netns"] is True and set(out["hosts"]) == {"registry", "source", "target"}
    assert out["registry"] == f"tcp://{out['hosts']['registry']['address']}:7450"
    assert out["source_endpoint"].startswith(f"tcp://{out['hosts']['source']['address']}:")
    assert out["outputs_identical"] is True and out["leftover_processes"] == []
    reusable, shared = (256 + 32 - 1) // TPB, 256 // TPB
    assert out["blocks_reused_remote"] == 2 * reusable - shared
    assert out["target_link_rx_bytes"] >= out["bytes_read"] > 0
    names = {h["netns"] for h in out["hosts"].values()}
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not any(n in left for n in names), f"the demo left namespaces behind: {left}"
    assert took < 90, f"the demo took {took:.0f} s"
