"""What the real-vLLM tests share: the instance process, its environment, prompts, and how to read its log.

An :class:`Instance` is ``tests/vllm_procs/instance.py`` in a process group
of its own (its engine core and TP workers with it), pinned to this box's
cores the way vLLM's CPU backend wants (``VLLM_CPU_OMP_THREADS_BIND``: one
core per TP rank).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import kill_group
from remote_g2.protocol.messages import LayoutFingerprint
from remote_g2.identity.model_identity import checkpoint_files, weights_digest
from remote_g2.registry import RegistryClient

__all__ = ["HERE", "INSTANCE", "BLOCK", "IN_PROCESS", "Instance", "make_model", "prompts", "write_prompts",
           "blocks_fetched", "instance_env", "wait_published", "result_and_fingerprints", "source_a", "plain_outputs"]

HERE = Path(__file__).resolve().parent
INSTANCE = HERE / "vllm_procs" / "instance.py"
BLOCK = 32

#: vLLM's other process layout: the engine core (and a TP-1 worker) in the instance's own process, as
#: ``LLM(...)`` runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the connector's scheduler and worker sides
#: then share one process (at TP > 1 the workers stay processes of their own). Such an instance starts
#: sooner (one vLLM import fewer): the edge-case tests run in it, the main paths in vLLM's default layout.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def make_model(out: Path, **kw: int) -> Path:
    """A tiny random-weight Llama (``tests/vllm_procs/make_model.py``; ``heads``, ``kv_heads``...) in ``out``."""
    if str(HERE / "vllm_procs") not in sys.path:
        sys.path.insert(0, str(HERE / "vllm_procs"))
    from make_model import make_model as make

    return make(out, **kw)


def prompts(seed: int, n: int, length: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def write_prompts(tmp: Path, name: str, entries: list) -> Path:
    path = tmp / f"{name}.prompts.json"
    path.write_text(json.dumps(entries))
    return path


def blocks_fetched(log: str) -> int:
    """Blocks the instance read from remote G2s, summed over its fetches (one READ per block each)."""
    return sum(int(n) for n in re.findall(r"fetch \S+: (\d+) of \d+ blocks read from a remote G2", log))


def cores(name: str, tp: int = 1) -> str:
    """The CPU(s) instance ``name``'s TP ranks pin to (``VLLM_CPU_OMP_THREADS_BIND``: ranks split by ``|``).

    vLLM's CPU backend pins each worker process to cores; left at ``auto``
    every instance on a box picks the same one (core 0 here), and
    remote-g2's source threads, which live in that process, get no CPU while
    a neighbour computes there: A's resolves and renewals timed out while B
    started up (sampled: A's worker threads runnable, 0 ms of CPU in 30 s).
    Instances are spread over the cores by name; TP ranks take consecutive
    ones from there (on a 2-core box, an instance at TP 2 uses both).
    """
    cpus = sorted(os.sched_getaffinity(0))
    first = (ord(name[0]) - ord("a")) % len(cpus)
    return "|".join(str(cpus[(first + r) % len(cpus)]) for r in range(tp))


def instance_env(name: str, tp: int = 1) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "UCX_LOG_LEVEL": "fatal", "VLLM_LOGGING_LEVEL": "WARNING",
            "REMOTE_G2_LOG_LEVEL": os.environ.get("REMOTE_G2_LOG_LEVEL", "INFO"), "TOKENIZERS_PARALLELISM": "false",
            "VLLM_CPU_OMP_THREADS_BIND": cores(name, tp),
            # If a source still stalls, its log gets every thread's stack (remote_g2/stall_watchdog.py).
            "REMOTE_G2_STALL_DUMP_S": "5"}


def wait_published(registry: str, worker_id: str, want: int, inst: Instance) -> None:
    with RegistryClient(registry) as reg:
        held = reg.wait_for_blocks(worker_id, want, timeout_s=20)
    assert held >= want, f"{worker_id}'s blocks never reached the registry\n{inst.tail()}"


class Instance:
    """A vLLM instance process (instance.py) at TP ``tp``; ``result()`` waits for its outputs."""

    def __init__(self, tmp: Path, name: str, model: Path, prompts: Path, registry: str | None, *args: str,
                 env: dict[str, str] | None = None, tp: int = 1, nice: int = 0) -> None:
        """``nice``: the instance's processes run at this nice value (a reader sharing its cores with a
        source instance on a small box yields them to the source's service threads).

        The instance gets a process group of its own (for :meth:`kill`), not a session: with the kernel's
        autogroup scheduling on (the default here), each session is a scheduling group and nice values count
        only inside their group: a niced reader in a session of its own took as much of a shared core as a
        source in another session, and a source rank pinned there was once starved until the reader's READ
        timed out."""
        self.name = name
        self.out, self.hold, self.log = tmp / f"{name}.json", tmp / f"{name}.stop", tmp / f"{name}.log"
        # result() takes the first out file it sees: an earlier instance's would pass for this one's.
        assert not self.out.exists(), f"instance {name!r} already ran in {tmp}: give this one another name"
        cmd = [sys.executable, str(INSTANCE), "--model", str(model), "--prompts", str(prompts),
               "--out", str(self.out), "--hold-file", str(self.hold), "--worker-id", f"vllm-{name}",
               "--tp", str(tp), *args]
        if registry:
            cmd += ["--registry", registry]
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**instance_env(name, tp), **(env or {})}, process_group=0,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def run(self) -> list[dict]:
        """:meth:`result`, then :meth:`stop` (also when there is no result)."""
        try:
            return self.result()
        finally:
            self.stop()

    def result(self, timeout_s: float = 240) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while not self.out.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"vLLM instance gave no result (rc={self.proc.poll()}):\n{self.tail()}")
            time.sleep(0.2)
        return json.loads(self.out.read_text())

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self) -> str:
        return self.log.read_bytes()[-6000:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the instance's whole process group (its engine core and workers too)."""
        kill_group(self.proc)
        self._log.close()

    def stop(self) -> None:
        """Let the instance end, then end whatever it left in its process group (an engine core, workers)."""
        if self.proc.poll() is None:
            self.hold.touch()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc)
        self._log.close()


def result_and_fingerprints(inst: Instance, registry: str) -> tuple[list[dict], dict[str, LayoutFingerprint]]:
    """``inst``'s outputs and the fingerprint of every worker the registry holds (lapsed ones too), read while
    ``inst`` is still up; then ``inst`` stops."""
    try:
        out = inst.result()
        with RegistryClient(registry) as reg:
            return out, {w.worker_id: w.fingerprint for w in reg.list_workers(include_dead=True)}
    finally:
        inst.stop()


@contextmanager
def source_a(tmp: Path, model: Path, prompts: Path, registry: str, blocks: int, *args: str,
             tp: int = 1, name: str = "a", env: dict[str, str] | None = None) -> Iterator[tuple[Instance, list[dict]]]:
    """Instance A (connector on): serves ``prompts``, waits until ``blocks`` are published, stays up in the block."""
    a = Instance(tmp, name, model, prompts, registry, *args, tp=tp, env=env)
    try:
        out_a = a.result()
        wait_published(registry, f"vllm-{name}", blocks, a)
        yield a, out_a
    finally:
        a.stop()


_PLAIN: dict[tuple, list[dict]] = {}


def plain_outputs(tmp: Path, model: Path, prompts: Path, *args: str, tp: int = 1) -> list[dict]:
    """Plain vLLM's outputs (no connector) for ``prompts`` at TP ``tp``: run once per session for the same model
    (path and weights), prompts, arguments and TP size. A run is deterministic (greedy, seed 0, one process group
    of its own), and each vLLM start costs most of a minute on a 2-core box.

    The engine core runs in the instance's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; TP workers are
    still processes of their own): the same tokens, without a second import of vLLM and the engine core's
    shutdown wait. Instances with the connector keep vLLM's default process layout, the one deployments run.
    """
    # Keyed by the weights' bytes, not only the path: a test may load other weights under one path.
    weights = weights_digest(checkpoint_files(model), model, cache=None).digest
    key = (str(model), weights, hashlib.sha256(prompts.read_bytes()).hexdigest(), args, tp)
    if key not in _PLAIN:
        name = "c-" + hashlib.sha256(repr(key).encode()).hexdigest()[:8]  # one per key: two in one test differ
        _PLAIN[key] = Instance(tmp, name, model, prompts, None, *args, tp=tp, env=IN_PROCESS).run()
    return copy.deepcopy(_PLAIN[key])


class AnswerLines:
    """The ``@@ {json}`` answer lines a driven child process prints among its logs, read raw from its stdout
    into a buffer of our own (a buffered ``readline`` after ``select`` could take an answer into the file's
    buffer along with a log line, where ``select`` no longer sees it)."""

    def __init__(self, stream: object) -> None:
        self.fd = stream.fileno()  # type: ignore[attr-defined]
        self.buffer = b""

    def fileno(self) -> int:
        return self.fd

    def pop(self) -> dict | None:
        """The next whole answer already read, or None (log lines before it are dropped)."""
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            if line.startswith(b"@@ "):
                return json.loads(line[3:])
        return None

    def feed(self) -> bool:
        """Read what the pipe has (call when ``select`` says it is readable); False at end of file."""
        chunk = os.read(self.fd, 1 << 20)
        self.buffer += chunk
        return bool(chunk)
