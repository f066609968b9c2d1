"""What a source rank's progress mode costs and buys: event (NIXL's thread on the UCX event fd) vs poll (our thread).

A source's NIXL agent (``source/rank_agent.py``) gets the UCX progress its
readers need in one of two modes (``source/progress_pace.py``): ``event``,
NIXL's own progress thread asleep on the UCX worker's event descriptor, or
``poll``, a thread of ours calling ``get_new_notifs()`` every 0.2 ms while
leases are open when ``UCX_TLS`` may emulate READs (TCP; also when it is
unset), every 5 ms when every allowed transport is one-sided, every 1 s idle.
This bench measures, for each, the READ throughput a reader gets and the CPU
the source spends to give it.

Everything real, on this machine, fresh processes for every run:

* ``--sources`` N (1 and 2 by default) source processes
  (``bench/source/progress_procs/source.py``), each a RankAgent in the mode under test
  over ``--mib`` MiB of known bytes (poll mode as while a reader on this
  host holds a lease: every 5 ms with ``cma``, every 0.2 ms with ``UCX_TLS=tcp``);
* one reader process (``bench/source/progress_procs/reader.py``), a bare NIXL agent
  with no progress thread, reading every source's whole buffer into one
  destination: one READ per source, all posted at once, each the buffer as
  descriptors of ``--block-kib`` KiB in a shuffled order (nothing coalesces),
  then ``check_xfer_state`` on all until every one is DONE (30 s each, else
  the run fails). One warm-up (the wire-up; checked byte for byte), then
  ``--reps`` timed repetitions, the destination zeroed before the last, whose
  bytes are checked too. A wrong byte aborts the bench with exit status 1.

Fabrics (``--fabrics``): ``one-host`` (``UCX_TLS`` unset: UCX copies with
``cma``, a one-sided READ that never needs the source; poll mode still paces
at 0.2 ms, since unset ``UCX_TLS`` may mean TCP to another host) and ``tcp``
(``UCX_TLS=tcp`` for sources and reader: every READ is messages the source's
worker must answer). Per ``--rounds`` round, each (fabric, sources, block
size) configuration runs ``event`` and ``poll`` back to back, which goes
first alternating each round.

The parent asks every source for its process CPU seconds (every thread's)
just before it lets the reader start its timed READs and just after they
end: that CPU over the wall time between the two samples is "read CPU", in
% of one core per source (mean over the sources). After the reader exits it
waits ``--idle-s`` and asks again: "idle CPU", the same unit, of a source
with a lease still open and nobody reading (event: NIXL's timed wake-ups
only, 10 a second; poll: the 0.2 ms pace). A poll source with no lease open
paces at 1 s and costs next to nothing: not measured here.

    python -m bench.source.bench_source_progress [--sources 1,2] [--fabrics one-host,tcp] [--modes event,poll]
                                          [--mib 64] [--block-kib 64[,1024]] [--reps 10] [--rounds 3]
                                          [--idle-s 2] [--json out.json]

How to read it: one row per fabric x sources x block size x mode. GB/s is
all sources' bytes over a repetition's time (the median repetition of a run;
the row shows the median over rounds and the lowest-highest round). read /
idle CPU: % of one core per source, median over rounds. event/poll: the
ratio of GB/s, paired within each round (median and range over rounds): 1.0
means event mode loses nothing; a ratio well below 1 over TCP would mean
UCX's event fd wakes NIXL's thread too late for emulated READs. On a
machine with few cores the reader's polling loop, the sources' progress and
the kernel's TCP all share the CPUs: compare modes, not absolute numbers.
The JSON (``--json``) holds every run's raw numbers, the ``UCX_TLS`` used,
the machine (nproc, load average, date) and the git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench.common import REPO, envelope, module_cmd
from bench.common import write_json as _write_json

PROCS = "bench.source.progress_procs"
FABRICS: dict[str, str | None] = {"one-host": None, "tcp": "tcp"}  # fabric -> UCX_TLS (None: unset)
MODES = ("event", "poll")
START_TIMEOUT_S = 90.0  # a source: numpy pattern, NIXL import, agent, registration
REPLY_TIMEOUT_S = 15.0  # a source's answer to ``cpu``
EXIT_TIMEOUT_S = 30.0


class BenchError(Exception):
    pass


class WrongBytes(BenchError):
    pass


class Child:
    """A helper process: JSON lines from its stdout on a queue (other lines are NIXL's logs), stderr to a file."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, what: str) -> None:
        self.what = what
        self.log_path = log
        self._log = open(log, "wb")
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, cwd=REPO, env=env)
        self._thread = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith("{"):
                try:
                    self._lines.put(json.loads(line))
                except json.JSONDecodeError:
                    pass
        self._lines.put(None)  # end of output: the process is exiting

    def send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise BenchError(f"{self.what} is gone ({e}; rc={self.proc.poll()}):\n{self.tail()}") from e

    def expect(self, timeout_s: float, step: str) -> dict[str, Any]:
        """The next JSON line, within ``timeout_s``; a reader's ``error`` line raises."""
        try:
            obj = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise BenchError(f"{self.what}: no answer in {timeout_s:g} s ({step}):\n{self.tail()}") from None
        if obj is None:
            self._lines.put(None)
            raise BenchError(f"{self.what} ended ({step}; rc={self.proc.poll()}):\n{self.tail()}")
        if obj.get("event") == "error":
            exc = WrongBytes if obj.get("wrong_bytes") else BenchError
            raise exc(f"{self.what}: {obj['error']}")
        return obj

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{self.what} did not exit in {timeout_s:g} s:\n{self.tail()}") from None

    def kill(self) -> None:
        """SIGKILL by PID if still alive; always closes the log."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if not self._log.closed:
            self._log.close()

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


@dataclass(frozen=True)
class Config:
    fabric: str
    sources: int
    block_kib: int

    @property
    def ucx_tls(self) -> str | None:
        return FABRICS[self.fabric]


def child_env(ucx_tls: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    if ucx_tls:
        env["UCX_TLS"] = ucx_tls
    return env


def start_sources(n: int, mode: str, mib: int, env: dict[str, str], logs: Path,
                  children: list[Child]) -> list[dict[str, Any]]:
    """Start ``n`` sources together (appended to ``children`` at once: the caller kills them); their metadata."""
    for i in range(n):
        children.append(Child(module_cmd(f"{PROCS}.source", mode, "--mib", str(mib), "--seed", str(i)),
                              env, logs / f"source-{i}.log", f"source {i} ({mode})"))
    infos = []
    for i, c in enumerate(children[-n:]):
        info = c.expect(START_TIMEOUT_S, "start-up")
        if info["mode"] != mode:
            raise BenchError(f"source {i} asked for {mode} progress runs {info['mode']} (see {c.log_path}):\n"
                             f"{c.tail()}")
        infos.append({**info, "seed": i})
    return infos


def sample_cpu(sources: list[Child]) -> list[tuple[float, float]]:
    """Every source's (CPU seconds so far, its monotonic clock), asked of all before any answer is read."""
    for s in sources:
        s.send("cpu")
    out = []
    for s in sources:
        r = s.expect(REPLY_TIMEOUT_S, "cpu")
        out.append((r["cpu_s"], r["t"]))
    return out


def cpu_pct(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> list[float]:
    """Per source: CPU seconds between two samples over the wall seconds between them, in % of one core."""
    return [100.0 * (a[0] - b[0]) / max(a[1] - b[1], 1e-9) for b, a in zip(before, after)]


def run_once(cfg: Config, mode: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One run: fresh sources and reader; warm-up, timed READs, idle. Returns its raw numbers."""
    env = child_env(cfg.ucx_tls)
    children: list[Child] = []
    try:
        infos = start_sources(cfg.sources, mode, args.mib, env, logs, children)
        sources = list(children)
        reader = Child(module_cmd(f"{PROCS}.reader"), env, logs / "reader.log", f"reader ({mode})")
        children.append(reader)
        reader.send(json.dumps({"sources": [{k: i[k] for k in ("metadata", "base", "nbytes", "seed")} for i in infos],
                                "reps": args.reps, "block_kib": cfg.block_kib, "timeout_s": args.read_timeout_s}))
        ready = reader.expect(START_TIMEOUT_S + args.read_timeout_s, "set-up and warm-up")
        before = sample_cpu(sources)
        reader.send("go")
        done = reader.expect(args.reps * (args.read_timeout_s + 5) + 30, "timed READs")
        after = sample_cpu(sources)
        reader.expect(60, "check of the last READ")
        if (rc := reader.finish(EXIT_TIMEOUT_S)) != 0:
            raise BenchError(f"reader exited with {rc}:\n{reader.tail()}")
        idle0 = sample_cpu(sources)
        time.sleep(args.idle_s)
        idle1 = sample_cpu(sources)
        for s in sources:
            s.send("quit")
        for s in sources:
            s.finish(EXIT_TIMEOUT_S)
    finally:
        for c in children:
            c.kill()
    total = sum(i["nbytes"] for i in infos)
    rep_s = done["rep_s"]
    read_pct, idle_pct = cpu_pct(before, after), cpu_pct(idle0, idle1)
    return {"fabric": cfg.fabric, "ucx_tls": cfg.ucx_tls, "sources": cfg.sources, "block_kib": cfg.block_kib,
            "mode": mode, "pace": infos[0]["pace"], "poll_interval_s": infos[0]["poll_interval_s"],
            "bytes_per_rep": total, "descriptors_per_source": ready["descriptors_per_source"],
            "setup_s": ready["setup_s"], "warmup_s": ready["warmup_s"], "rep_s": rep_s,
            "gbps": total / statistics.median(rep_s) / 1e9,
            "read_window_s": [a[1] - b[1] for b, a in zip(before, after)],
            "read_cpu_s": [a[0] - b[0] for b, a in zip(before, after)],
            "read_cpu_pct": read_pct, "read_cpu_pct_per_source": statistics.fmean(read_pct),
            "idle_window_s": [a[1] - b[1] for b, a in zip(idle0, idle1)],
            "idle_cpu_s": [a[0] - b[0] for b, a in zip(idle0, idle1)],
            "idle_cpu_pct": idle_pct, "idle_cpu_pct_per_source": statistics.fmean(idle_pct),
            "bytes_checked": {"warmup": True, "last_read": True}}


def mode_order(modes: list[str], rnd: int) -> list[str]:
    """The modes in the given order on even rounds, reversed on odd ones."""
    return list(modes) if rnd % 2 == 0 else list(reversed(modes))


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(runs: list[dict[str, Any]], configs: list[Config], modes: list[str]) -> tuple[list[dict], list[dict]]:
    """Rows (one per configuration x mode, over rounds) and the paired event/poll ratios per configuration."""
    rows, ratios = [], []
    for cfg in configs:
        mine = [r for r in runs if (r["fabric"], r["sources"], r["block_kib"]) ==
                (cfg.fabric, cfg.sources, cfg.block_kib)]
        by_mode = {m: sorted((r for r in mine if r["mode"] == m), key=lambda r: r["round"]) for m in modes}
        for m in modes:
            rs = by_mode[m]
            if not rs:
                continue
            rows.append({"fabric": cfg.fabric, "ucx_tls": cfg.ucx_tls, "sources": cfg.sources,
                         "block_kib": cfg.block_kib, "mode": m, "rounds": len(rs), "pace": rs[0]["pace"],
                         "gbps": spread([r["gbps"] for r in rs]),
                         "gbps_per_round": [r["gbps"] for r in rs],
                         "rep_ms_median": statistics.median([statistics.median(r["rep_s"]) * 1e3 for r in rs]),
                         "read_cpu_pct_per_source": spread([r["read_cpu_pct_per_source"] for r in rs]),
                         "idle_cpu_pct_per_source": spread([r["idle_cpu_pct_per_source"] for r in rs]),
                         "bytes_checked": all(all(r["bytes_checked"].values()) for r in rs)})
        if "event" in by_mode and "poll" in by_mode:
            poll = {r["round"]: r["gbps"] for r in by_mode["poll"]}
            per_round = [r["gbps"] / poll[r["round"]] for r in by_mode["event"] if r["round"] in poll]
            if per_round:
                ratios.append({"fabric": cfg.fabric, "sources": cfg.sources, "block_kib": cfg.block_kib,
                               "event_over_poll_gbps": spread(per_round), "per_round": per_round})
    return rows, ratios


def print_table(rows: list[dict], ratios: list[dict], meta: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"{args.mib} MiB per source, {args.reps} timed reps per run (median), {args.rounds} round(s), "
          f"idle {args.idle_s:g} s; {meta['nproc']} CPUs, load avg {meta['loadavg_before'][0]:.2f} -> "
          f"{meta['loadavg_after'][0]:.2f}; NIXL {meta['nixl']}; {meta['commit']}"
          f"{' (dirty tree)' if meta['dirty'] else ''}, {meta['date']}")
    print(f"{'fabric':<9} {'src':>3} {'block':>6} {'mode':<6} {'GB/s':>6} {'min-max':>11} {'ms/rep':>7} "
          f"{'read CPU':>9} {'idle CPU':>9}")
    for r in rows:
        g = r["gbps"]
        print(f"{r['fabric']:<9} {r['sources']:>3} {str(r['block_kib']) + 'K':>6} {r['mode']:<6} "
              f"{g['median']:>6.2f} {'%.2f-%.2f' % (g['min'], g['max']):>11} {r['rep_ms_median']:>7.1f} "
              f"{r['read_cpu_pct_per_source']['median']:>8.1f}% {r['idle_cpu_pct_per_source']['median']:>8.1f}%")
    print("  GB/s: all sources' bytes / a repetition's time (median rep of a run; median and range over rounds);\n"
          "  read / idle CPU: % of one core per source, during the timed READs / with nobody reading (lease open)")
    if ratios:
        print(f"\n{'fabric':<9} {'src':>3} {'block':>6} {'event/poll GB/s':>16} {'range':>11}")
        for q in ratios:
            e = q["event_over_poll_gbps"]
            print(f"{q['fabric']:<9} {q['sources']:>3} {str(q['block_kib']) + 'K':>6} {e['median']:>16.2f} "
                  f"{'%.2f-%.2f' % (e['min'], e['max']):>11}")
        print("  paired within each round (event and poll back to back); median and range over rounds")


def _git(*cmd: str) -> str | None:
    try:
        r = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "?"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    return {"nproc": len(os.sched_getaffinity(0)), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
            "machine": platform.machine(), "kernel": platform.release(), "python": platform.python_version(),
            "nixl": _nixl_version(), "loadavg_before": os.getloadavg(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _git("rev-parse", "--short", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "ucx_tls_environment": os.environ.get("UCX_TLS")}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sources", default="1,2", help="how many sources the reader reads at once, comma-separated")
    p.add_argument("--fabrics", default="one-host,tcp", help="one-host (UCX_TLS unset) and/or tcp (UCX_TLS=tcp)")
    p.add_argument("--modes", default="event,poll", help="progress modes, comma-separated")
    p.add_argument("--mib", type=int, default=64, help="each source's buffer, MiB")
    p.add_argument("--block-kib", default="64", help="descriptor size(s), KiB, comma-separated (e.g. 64,1024)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per run (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the mode going first alternates each round")
    p.add_argument("--idle-s", type=float, default=2.0, help="idle window after the reader exits, seconds")
    p.add_argument("--read-timeout-s", type=float, default=30.0, help="each READ must be DONE within this")
    p.add_argument("--json", type=Path, help="write everything here (parent directories are created)")
    args = p.parse_args()
    try:
        args.source_counts = [int(x) for x in _csv(args.sources)]
        args.block_kibs = [int(x) for x in _csv(args.block_kib)]
    except ValueError:
        p.error("--sources and --block-kib take comma-separated integers")
    args.fabric_list, args.mode_list = _csv(args.fabrics), _csv(args.modes)
    if not args.source_counts or not all(1 <= n <= 8 for n in args.source_counts):
        p.error("--sources: between 1 and 8 each")
    if not args.fabric_list or not set(args.fabric_list) <= set(FABRICS):
        p.error(f"--fabrics: from {', '.join(FABRICS)}")
    if not args.mode_list or not set(args.mode_list) <= set(MODES) or len(set(args.mode_list)) < len(args.mode_list):
        p.error(f"--modes: from {', '.join(MODES)}, each once")
    if not 0 < args.mib <= 1024 or not 1 <= args.reps <= 1000 or not 1 <= args.rounds <= 50 or args.idle_s < 0:
        p.error("need 0 < --mib <= 1024, 1 <= --reps <= 1000, 1 <= --rounds <= 50, --idle-s >= 0")
    for k in args.block_kibs:
        if k <= 0 or k % 4 or (args.mib << 10) % k:
            p.error(f"block size {k} KiB: a multiple of 4 KiB dividing {args.mib} MiB")
    return args


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_json(path: Path | None, doc: dict[str, Any]) -> None:
    """``doc`` in bench.common's envelope at ``path`` (when given); ``doc``'s own fields win."""
    if path is not None:
        _write_json(path, envelope(doc["benchmark"], **{k: v for k, v in doc.items() if k != "benchmark"}))


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _terminated)  # unwinds like Ctrl-C: every child is killed on the way out
    configs = [Config(f, n, k) for f in args.fabric_list for n in args.source_counts for k in args.block_kibs]
    meta = machine()
    doc: dict[str, Any] = {"benchmark": "source_progress", "mib": args.mib, "reps": args.reps,
                           "rounds": args.rounds, "idle_s": args.idle_s, "read_timeout_s": args.read_timeout_s,
                           "modes": args.mode_list, "ucx_tls": {f: FABRICS[f] for f in args.fabric_list},
                           "machine": meta, "runs": []}
    runs: list[dict[str, Any]] = doc["runs"]
    t_start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="rg2-bench-progress-") as tmp:
            for rnd in range(args.rounds):
                for cfg in configs:
                    for mode in mode_order(args.mode_list, rnd):
                        t = time.monotonic()
                        run = {"round": rnd, **run_once(cfg, mode, args, Path(tmp))}
                        runs.append(run)
                        print(f"[round {rnd + 1}/{args.rounds}] {cfg.fabric} {cfg.sources} src {cfg.block_kib}K "
                              f"{mode}: {run['gbps']:.2f} GB/s, read CPU {run['read_cpu_pct_per_source']:.1f}%/src, "
                              f"idle {run['idle_cpu_pct_per_source']:.1f}%/src ({time.monotonic() - t:.1f} s)",
                              file=sys.stderr, flush=True)
    except (BenchError, KeyboardInterrupt) as e:
        wrong = isinstance(e, WrongBytes)
        doc["error"] = f"{'WRONG BYTES: ' if wrong else ''}{e}"
        write_json(args.json, doc)
        print(f"bench_source_progress: FAILED: {doc['error']}", file=sys.stderr)
        return 1 if wrong else (130 if isinstance(e, KeyboardInterrupt) else 2)
    meta["loadavg_after"] = os.getloadavg()
    doc["wall_s"] = time.monotonic() - t_start
    doc["rows"], doc["event_over_poll"] = summarize(runs, configs, args.mode_list)
    write_json(args.json, doc)
    print_table(doc["rows"], doc["event_over_poll"], meta, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
