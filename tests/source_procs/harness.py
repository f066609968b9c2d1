"""Launch and watch synthetic source workers (``mpiexec -n TP source_rank.py``) and NIXL readers.

Used by ``tests/test_source_mpi.py`` and ``bench/source/bench_source.py``. Every
process is started in its own session and stopped by its PID (its process
group: mpiexec and the ranks it started); every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import kill_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VENV_BIN = Path(sys.executable).parent
MPIEXEC = VENV_BIN / "mpiexec"
SOURCE_SCRIPT = HERE / "source_rank.py"
READER_SCRIPT = HERE / "nixl_reader.py"


def have_mpiexec() -> bool:
    return MPIEXEC.exists()


class SourceWorker:
    """A source worker of ``np`` ranks running ``source_rank.py`` with ``args``, files in ``directory``.

    ``tag`` selects one TP group's files when ``--tp-size`` splits the world.
    """

    def __init__(self, directory: Path, worker_id: str, *, np: int = 2, args: list[str] | None = None,
                 auto_cleanup: bool = True, start_timeout_s: float = 60.0, groups: int = 1,
                 launcher: str = "mpiexec") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.worker_id = worker_id
        self.np = np
        self.log_path = self.dir / "mpiexec.log"
        args = list(args or [])
        if "--ipc-dir" in args:
            self.ipc_dir = Path(args[args.index("--ipc-dir") + 1])
            self._own_ipc_dir = False
        else:  # pytest's tmp paths are too long for a unix socket path (107 bytes)
            self.ipc_dir = Path(tempfile.mkdtemp(prefix="rg2-"))
            self._own_ipc_dir = True
            args += ["--ipc-dir", str(self.ipc_dir)]
        env = dict(os.environ)
        env.setdefault("UCX_LOG_LEVEL", "fatal")  # a killed peer makes UCX print errors we expect
        script = [sys.executable, str(SOURCE_SCRIPT), "--dir", str(self.dir), "--worker-id", worker_id, *args]
        self._log = open(self.log_path, "wb")
        if launcher == "mpiexec":
            cmd = [str(MPIEXEC)]
            if not auto_cleanup:
                cmd.append("-disable-auto-cleanup")
            cmds = [cmd + ["-n", str(np), *script]]
        elif launcher == "plain":  # one process per rank, no MPI (start-up exchange through files)
            cmds = [script + ["--file-comm", f"{r}:{np}"] for r in range(np)]
        elif launcher == "torch":  # one process per rank, start-up exchange over a torch.distributed group
            cmds = [script + ["--torch-comm", f"{r}:{np}"] for r in range(np)]
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
        self.procs = [subprocess.Popen(c, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=REPO, env=env) for c in cmds]
        self.tags = [""] if groups == 1 else [f"-g{g}" for g in range(groups)]
        self.endpoints: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + start_timeout_s
        for tag in self.tags:
            path = self.dir / f"endpoint{tag}.json"
            while not path.exists():
                if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                    rcs = [p.poll() for p in self.procs]
                    self.kill()
                    raise RuntimeError(f"source worker did not start (rc={rcs}):\n{self.log()}")
                time.sleep(0.05)
            self.endpoints[tag] = json.loads(path.read_text())

    @property
    def endpoint(self) -> str:
        return self.endpoints[self.tags[0]]["endpoint"]

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    # -- watching ranks ----------------------------------------------------------------

    def state(self, rank: int, tag: str = "") -> dict[str, Any]:
        return json.loads((self.dir / f"state{tag}-{rank}.json").read_text())

    def wait_state(self, rank: int, predicate: Callable[[dict[str, Any]], bool], *, timeout_s: float = 10.0,
                   tag: str = "", what: str = "") -> dict[str, Any]:
        """The first fresh state of ``rank`` (written after this call) that satisfies ``predicate``."""
        t_call = time.time()
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                last = self.state(rank, tag)
            except (OSError, ValueError):
                last = {}
            if last and last["t"] >= t_call and predicate(last):
                return last
            time.sleep(0.02)
        raise AssertionError(f"rank {rank}{tag}: {what or 'condition'} not reached within {timeout_s} s; "
                             f"last state {last}\n{self.log()}")

    def wait_registered(self, registry: str, blocks: int, timeout_s: float = 15.0) -> None:
        """Wait until ``registry`` lists this worker with ``blocks`` blocks (rank 0 publishes them)."""
        from remote_g2.registry import RegistryClient

        with RegistryClient(registry) as reg:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                rec = reg.worker_info(self.worker_id)
                if rec is not None and rec.blocks == blocks:
                    return
                time.sleep(0.05)
        raise AssertionError(f"the source never showed its {blocks} blocks in the registry\n{self.log()}")

    def wait_pins(self, rank: int, pins: int, **kw: Any) -> dict[str, Any]:
        """Wait until ``rank``'s pool holds exactly ``pins`` pins."""
        return self.wait_state(rank, lambda s: s["total_pins"] == pins, what=f"total_pins == {pins}", **kw)

    def pid(self, rank: int, tag: str = "") -> int:
        return int(self.wait_state(rank, lambda s: True, tag=tag)["pid"])

    def command(self, rank: int, ops: list[dict[str, Any]], tag: str = "", timeout_s: float = 10.0) -> None:
        """Have ``rank`` store/remove hashes; returns once it has."""
        path = self.dir / f"cmd{tag}-{rank}.json"
        done = path.with_suffix(".done")
        done.unlink(missing_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ops))
        os.replace(tmp, path)
        deadline = time.monotonic() + timeout_s
        while not done.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} did not apply {ops}\n{self.log()}")
            time.sleep(0.02)

    def set_pin_delay(self, rank: int, seconds: float, tag: str = "") -> None:
        path = self.dir / f"delay-pin{tag}-{rank}"
        if seconds > 0:
            path.write_text(str(seconds))
        else:
            path.unlink(missing_ok=True)

    # -- stopping --------------------------------------------------------------------------

    def stop(self, timeout_s: float = 20.0, *, expect_done: list[int] | None = None) -> dict[str, Any]:
        """Ask every rank to stop; wait; return what the ranks reported (``done``) and the exit code.

        Raises when a rank in ``expect_done`` (default: all) did not report a
        clean shutdown. A non-zero exit *after* every expected rank reported
        (NIXL's crash at interpreter exit) is tolerated and returned as ``rc``.
        """
        (self.dir / "stop").touch()
        deadline = time.monotonic() + timeout_s
        try:
            rcs = [p.wait(max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"source worker did not stop within {timeout_s} s\n{self.log()}") from None
        finally:
            self._log.close()
            self._remove_ipc_dir()
        rc = rcs[0] if len(rcs) == 1 else rcs
        ranks = range(self.np // len(self.tags)) if expect_done is None else expect_done
        done: dict[str, Any] = {}
        missing = []
        for tag in self.tags:
            for r in ranks:
                path = self.dir / f"done{tag}-{r}"
                if path.exists():
                    done[f"{tag}{r}"] = json.loads(path.read_text())
                else:
                    missing.append(f"{tag}{r}")
        if missing:
            raise AssertionError(f"rank(s) {missing} did not shut down cleanly (rc={rc})\n{self.log()}")
        return {"rc": rc, "done": done}

    def kill(self) -> None:
        """Kill what we started (mpiexec and its ranks: the process groups we created) if still running."""
        for p in self.procs:
            if p.poll() is None:
                kill_group(p)
        if not self._log.closed:
            self._log.close()
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._own_ipc_dir and all(p.poll() is not None for p in self.procs):
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def run_readers(endpoint: str, out_dir: Path, specs: list[dict[str, Any]], *, timeout_s: float = 90.0
                ) -> list[dict[str, Any]]:
    """Run one ``nixl_reader.py`` per spec (``hashes``, ``start``, ``loops``, ``ttl_ms``, ``no_release``)
    at once; return their results.

    A reader that wrote its result and then died of a signal (NIXL at exit) is
    fine; one that wrote nothing fails with its output.
    """
    procs = []
    for i, spec in enumerate(specs):
        out = out_dir / f"reader-{os.getpid()}-{time.monotonic_ns()}-{i}.json"
        cmd = [sys.executable, str(READER_SCRIPT), "--endpoint", endpoint, "--hashes", str(spec["hashes"]),
               "--start", str(spec.get("start", 0)), "--loops", str(spec.get("loops", 1)),
               "--ttl-ms", str(spec.get("ttl_ms", 30_000)), "--out", str(out)]
        if spec.get("no_release"):
            cmd.append("--no-release")
        env = dict(os.environ)
        env.setdefault("UCX_LOG_LEVEL", "fatal")
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True, cwd=REPO, env=env), out))
    results = []
    deadline = time.monotonic() + timeout_s
    for proc, out in procs:
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                if p.poll() is None:
                    kill_group(p)
            raise AssertionError(f"reader did not finish within {timeout_s} s") from None
        if not out.exists():
            raise AssertionError(f"reader wrote no result (rc={proc.returncode}):\n"
                                 f"{output.decode(errors='replace')[-4000:]}")
        result = json.loads(out.read_text())
        result["rc"] = proc.returncode
        result["output"] = output.decode(errors="replace")[-4000:]
        results.append(result)
    return results
