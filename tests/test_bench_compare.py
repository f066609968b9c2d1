"""``bench.compare``: its arithmetic and its table on made-up numbers, then one real comparison of HEAD with itself.

The pure parts: HEAD / BASE paired per round (rounds where a side is missing
left out), the verdict against the threshold in both directions, ``lost`` and
``new`` metrics, every bench's metrics read from JSON shaped like the
benches' own (a missing key is a missing metric), the table. The smoke test
builds the HEAD commit as BASE in a worktree under a temporary ``--work-dir``
(its C++ extensions compiled: most of the test's time), checks that BASE's
venv imports the project from that worktree, runs a tiny registry bench on
both sides, then again with ``--head`` the same commit (both sides reuse the
build); the worktree is removed at the end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import _need_redis_binaries

from bench.compare import compare

REPO = Path(__file__).resolve().parent.parent
HIGHER, LOWER = compare.Direction.HIGHER, compare.Direction.LOWER

TRANSFER_ROW = {"block_kib": 64, "ratio_e2e_over_raw": 0.8, "e2e_s": 0.05, "one_block_e2e_s": 0.002}
REGISTRY = {"ingest": {"events_per_s": 300_000.0}, "latency_server": {"p50_ms": 0.4, "p99_ms": 2.0},
            "latency_mirrored_server": {"p50_ms": 0.2}, "throughput_server_per_s": 5000.0,
            "throughput_ratio": 0.6, "throughput_mirrored_server_per_s": 9000.0, "throughput_ratio_mirrored": 1.1}
E2E = {"ttft_remote_s": 0.05, "ttft_local_s": 0.03, "ttft_recompute_s": 0.9, "remote_over_local": 1.7}


def test_paired_ratios_leave_out_rounds_a_side_missed() -> None:
    assert compare.paired_ratios([1.0, 2.0, None, 4.0, 0.0], [2.0, None, 3.0, 2.0, 1.0]) == [2.0, 0.5]


@pytest.mark.parametrize(("ratios", "better", "expected"), [
    ([1.10, 1.20], HIGHER, "better"),
    ([1.10, 1.20], LOWER, "worse"),
    ([0.80, 0.90], HIGHER, "worse"),
    ([0.80, 0.90], LOWER, "better"),
    ([0.90, 1.10], HIGHER, "same"),  # the spread straddles 1
    ([1.02, 1.04], LOWER, "same"),  # within the threshold
    ([1.04, 1.30], LOWER, "same"),  # one round inside the threshold is enough doubt
    ([], HIGHER, "missing"),
])
def test_verdict_needs_the_whole_spread_beyond_the_threshold(ratios: list[float], better: Any,
                                                             expected: str) -> None:
    assert compare.verdict(ratios, better, 0.05) == expected


def test_summary_row_has_medians_spread_and_the_metrics_direction() -> None:
    row = compare.summarize_metric("registry.lookup_p50_ms", [0.4, 0.5, 0.6], [0.5, 0.6, 0.9], 0.05)
    assert (row["base_median"], row["head_median"], row["better"]) == (0.5, 0.6, "lower")
    assert row["ratios"] == pytest.approx([1.25, 1.2, 1.5])
    assert (row["ratio_min"], row["ratio_median"], row["ratio_max"]) == pytest.approx((1.2, 1.25, 1.5))
    assert row["verdict"] == "worse"


def test_a_metric_only_one_side_reported_is_lost_or_new() -> None:
    lost = compare.summarize_metric("e2e.ttft_remote_s", [0.1, 0.2], [None, None], 0.05)
    new = compare.summarize_metric("e2e.ttft_remote_s", [None, None], [0.1, None], 0.05)
    assert (lost["verdict"], new["verdict"]) == ("lost", "new")
    assert lost["ratio_median"] is None and new["base_median"] is None
    assert compare.regressions([lost, new]) == ["e2e.ttft_remote_s"]


def test_summarize_pairs_runs_by_round_and_side() -> None:
    runs = [{"side": side, "round": r, "metrics": {"registry.lookups_per_s": value}}
            for side, r, value in (("base", 0, 100.0), ("head", 0, 90.0), ("head", 1, 80.0), ("base", 1, 100.0))]
    runs.append({"side": "head", "round": 1, "metrics": {"registry.lookup_p50_ms": 0.3}})
    rows = {row["metric"]: row for row in compare.summarize(runs, 2, 0.05)}
    assert rows["registry.lookups_per_s"]["ratios"] == pytest.approx([0.9, 0.8])
    assert rows["registry.lookups_per_s"]["verdict"] == "worse"
    assert rows["registry.lookup_p50_ms"]["head_values"] == [None, 0.3]
    assert rows["registry.lookup_p50_ms"]["verdict"] == "new"


@pytest.mark.parametrize("key", ["rows", "results"])
def test_fetch_metrics_come_per_block_size_from_rows_or_results(key: str) -> None:
    doc = {key: [TRANSFER_ROW, {**TRANSFER_ROW, "block_kib": 1024, "ratio_e2e_over_raw": 0.9}]}
    found = compare.extract_metrics("fetch", doc)
    assert found["fetch.ratio_e2e_over_raw@64KiB"] == 0.8 and found["fetch.ratio_e2e_over_raw@1024KiB"] == 0.9
    assert found["fetch.one_block_e2e_s@1024KiB"] == 0.002 and len(found) == 6
    assert compare.direction_of("fetch.e2e_s@64KiB") is LOWER
    assert compare.direction_of("fetch.ratio_e2e_over_raw@64KiB") is HIGHER


def test_registry_e2e_and_score_metrics_come_from_their_json() -> None:
    assert compare.extract_metrics("registry", REGISTRY) == {
        "registry.ingest_events_per_s": 300_000.0, "registry.lookup_p50_ms": 0.4,
        "registry.mirror_lookup_p50_ms": 0.2, "registry.lookups_per_s": 5000.0, "registry.lookups_over_raw": 0.6,
        "registry.mirror_lookups_per_s": 9000.0, "registry.mirror_lookups_over_raw": 1.1}
    assert compare.extract_metrics("e2e", E2E) == {f"e2e.{k}": v for k, v in E2E.items()}
    score = {"bench": "score", "p50_ms": 0.5, "p99_ms": 0.6, "scores_per_server_cpu_s": 2500, "hash_ms_p50": 0.15,
             "goals": {"p50_ms": 1.0}}
    assert compare.extract_metrics("score", score) == {
        "score.scores_per_server_cpu_s": 2500.0, "score.p50_ms": 0.5, "score.p99_ms": 0.6, "score.hash_ms_p50": 0.15}


def test_vllm_metrics_pair_one_commits_connector_with_anothers_tier() -> None:
    """bench_vllm_overhead's JSON: a run with the tier reports tier / plain; one with the connector only (or from
    before the bench had modes) connector / plain, under the same metric, so the two pair."""
    def ratio(median: float) -> dict:
        return {"median": median, "min": median, "max": median, "rounds": [median]}

    plain = {"summary": {"request, plain": {"n": 20, "p50_ms": 19.0, "p99_ms": 22.0}}}
    tier = {**plain, "paired": {"tier/plain request p50": ratio(1.13), "tier/plain request p99": ratio(1.2),
                                "tier/plain batch p50": ratio(1.1), "cputier/plain request p50": ratio(1.08)}}
    both = {**plain, "paired": {"connector/plain request p50": ratio(1.3), **tier["paired"]}}
    legacy = {**plain, "paired": {"request p50": ratio(1.1), "request p99": ratio(1.05), "batch p50": ratio(1.06)}}
    assert compare.extract_metrics("vllm", tier) == {
        "vllm.sharing_over_plain_request_p50": 1.13, "vllm.sharing_over_plain_request_p99": 1.2,
        "vllm.sharing_over_plain_batch": 1.1, "vllm.plain_request_p50_ms": 19.0}
    assert compare.extract_metrics("vllm", both)["vllm.sharing_over_plain_request_p50"] == 1.13
    assert compare.extract_metrics("vllm", legacy)["vllm.sharing_over_plain_batch"] == 1.06
    older = {"summary": {"request, plain vLLM": {"p50_ms": 24.6}}}  # (the plain run's row, as 1330aac named it)
    assert compare.extract_metrics("vllm", older) == {"vllm.plain_request_p50_ms": 24.6}
    assert compare.extract_metrics("vllm", {"paired": {"cputier/plain request p50": ratio(1.0)}}) == {}
    assert compare.direction_of("vllm.sharing_over_plain_batch") is LOWER


def test_each_shared_venv_gets_a_side_venv_of_its_own() -> None:
    from bench.compare.sides import SharedVenv

    names = [SharedVenv(Path(p), ()).side_venv_name() for p in ("/r/.venv", "/r/.venv-vllm", "/opt/py311", "/r/venv")]
    assert names == ["venv", "venv-vllm", "venv-py311", "venv"]


def test_a_key_the_json_lacks_is_a_missing_metric_not_an_error() -> None:
    doc = {k: v for k, v in REGISTRY.items() if k not in ("latency_server", "throughput_ratio")}
    found = compare.extract_metrics("registry", doc)
    assert "registry.lookup_p50_ms" not in found and "registry.lookups_over_raw" not in found
    assert len(found) == 5
    assert compare.extract_metrics("fetch", {"rows": [{"block_kib": 64}]}) == {}
    assert compare.extract_metrics("e2e", {"ttft_remote_s": "n/a"}) == {}


def test_every_metric_has_a_direction() -> None:
    for bench in compare.BENCHES.values():
        assert bench.metrics and all(isinstance(m.better, compare.Direction) for m in bench.metrics)


def test_table_shows_each_metric_with_its_verdict_and_the_failures() -> None:
    summary = [compare.summarize_metric("registry.lookups_per_s", [5000.0, 5200.0], [4000.0, 4100.0], 0.05),
               compare.summarize_metric("e2e.ttft_remote_s", [0.05, 0.06], [None, None], 0.05)]
    failures = [{"side": "head", "bench": "e2e", "round": 0, "error": "exit 1: boom (r1-e2e-head.err)"}]
    table = compare.render_table(summary, failures, "BASE vs HEAD")
    lines = table.splitlines()
    assert lines[0] == "BASE vs HEAD"
    assert lines[1].split() == ["metric", "better", "BASE", "med", "HEAD", "med", "HEAD/BASE", "min–max", "verdict"]
    assert lines[3].split() == ["registry.lookups_per_s", "higher", "5,100", "4,050", "0.794", "0.788–0.800",
                                "worse"]
    assert lines[4].split() == ["e2e.ttft_remote_s", "lower", "0.055", "-", "-", "-", "lost"]
    assert "FAILED: head e2e round 1: exit 1" in table
    assert len({len(line) for line in lines[1:3]}) == 1  # the rule under the header is as wide as it


def test_options_for_both_sides_one_side_and_one_bench() -> None:
    a = compare.parse_args(["HEAD~1", "--benches", "registry,e2e", "--env", "A=1", "--head-env", "B=x=y",
                            "--bench-args", "registry=--clients 1 --rounds 1"])
    assert a.benches == ["registry", "e2e"] and a.env == [("A", "1")] and a.head_env == [("B", "x=y")]
    assert a.bench_args == {"registry": ["--clients", "1", "--rounds", "1"]}
    assert a.side_bench_args == {"base": {}, "head": {}}
    a = compare.parse_args(["1330aac", "--benches", "vllm", "--head-bench-args", "vllm=--modes plain,tier"])
    assert a.benches == ["vllm"] and a.side_bench_args == {"base": {}, "head": {"vllm": ["--modes", "plain,tier"]}}
    assert compare.parse_args(["HEAD~1"]).benches == ["fetch", "registry", "e2e", "score"]  # (vllm only if named)
    with pytest.raises(SystemExit):
        compare.parse_args(["HEAD~1", "--base-bench-args", "nope=--x"])
    with pytest.raises(SystemExit):
        compare.parse_args(["HEAD~1", "--benches", "nope"])
    with pytest.raises(SystemExit):
        compare.parse_args(["HEAD~1", "--env", "NOEQUALS"])


def test_a_bench_the_side_lacks_is_a_failed_run_without_metrics(tmp_path: Path) -> None:
    side = compare.Side("base", "old", "ab" * 20, tmp_path, tmp_path, Path(sys.executable), {})
    run = compare.run_bench(side, "e2e", 0, compare.parse_args(["old"]), tmp_path)
    assert run["error"] == "bench.transfer.bench_e2e (or bench/bench_e2e.py) does not exist at abababa"
    assert (run["rc"], run["metrics"]) == (None, {})
    assert run["command"][:2] == [sys.executable, str(tmp_path / "bench" / "bench_e2e.py")]


def test_each_side_runs_a_bench_by_its_own_layout(tmp_path: Path) -> None:
    """A tree with the benches as packages runs the module; one from before (BASE) runs its script."""
    python = Path(sys.executable)
    new, old = tmp_path / "new", tmp_path / "old"
    (new / "bench" / "transfer").mkdir(parents=True)
    (new / "bench" / "transfer" / "bench_e2e.py").write_text("")
    (old / "bench").mkdir(parents=True)
    (old / "bench" / "bench_e2e.py").write_text("")
    e2e = compare.BENCHES["e2e"]
    assert e2e.command(new, python) == [str(python), "-m", "bench.transfer.bench_e2e"]
    assert e2e.command(old, python) == [str(python), str(old / "bench" / "bench_e2e.py")]
    assert e2e.command(REPO, python) == [str(python), "-m", "bench.transfer.bench_e2e"]  # (this checkout)


# ---------------------------------------------------------------- one real comparison


TINY_REGISTRY = ["--benches", "registry", "--rounds", "1", "--registry-blocks", "20000", "--lookups", "200",
                 "--registry-seconds", "0.5", "--bench-args", "registry=--rounds 1 --clients 1"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def _compare(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "bench.compare", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc


def _imported_files(python: Path, cwd: Path) -> dict[str, str]:
    code = ("import json, remote_g2, source, registry, target, adapters, remote_g2._pool_index as p; "
            "print(json.dumps({m.__name__: m.__file__ for m in (remote_g2, source, registry, target, adapters, p)}))")
    proc = subprocess.run([str(python), "-I", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_compare_head_commit_with_itself_in_a_worktree(tmp_path: Path) -> None:
    _need_redis_binaries()
    if shutil.which("cmake") is None:
        pytest.skip("cmake not on PATH: BASE's C++ extensions cannot be built")
    sha = _git("rev-parse", "HEAD")
    work = tmp_path / "work"
    root, tree = work / sha, work / sha / "src"
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    try:
        proc = _compare(sha, *TINY_REGISTRY, "--work-dir", str(work), "--json", str(first))
        result = json.loads(first.read_text())
        assert result["base"]["sha"] == result["head"]["sha"] == sha
        assert result["base"]["build"]["reused"] is False and (tree / ".git").is_file()
        assert result["head"]["tree"] == str(REPO) and result["head"]["python"] == sys.executable
        assert all(f is None or f.startswith(str(root)) for f in result["base"]["imports"].values())
        files = _imported_files(root / "venv" / "bin" / "python", tmp_path)
        assert all(f.startswith(str(tree)) for name, f in files.items() if name != "remote_g2._pool_index"), files
        assert files["remote_g2._pool_index"].startswith(str(root / "venv")), files
        assert (root / "venv" / "bin" / "mpiexec").exists()

        (row,) = [r for r in result["summary"] if r["metric"] == "registry.lookup_p50_ms"]
        assert len(row["ratios"]) == 1 and row["ratio_median"] > 0 and row["verdict"] in ("better", "worse", "same")
        assert [(r["side"], r["rc"], r["error"]) for r in result["runs"]] == [("base", 0, None), ("head", 0, None)]
        runner = compare.BENCHES["registry"].command(tree, root / "venv" / "bin" / "python")  # (BASE's layout)
        assert runner is not None and result["runs"][0]["command"][:len(runner)] == runner
        assert {"nproc", "loadavg", "date"} <= set(result["machine"])
        assert "HEAD/BASE" in proc.stdout and "registry.lookup_p50_ms" in proc.stdout
        assert f"building BASE {sha[:7]}" in proc.stderr

        _compare(sha, "--head", sha, *TINY_REGISTRY, "--work-dir", str(work), "--json", str(second))
        again = json.loads(second.read_text())
        assert again["base"]["build"]["reused"] is True and again["head"]["build"]["reused"] is True
        assert again["head"]["tree"] == str(tree) and again["head"]["has_uncommitted_changes"] is False
        assert any(r["metric"] == "registry.lookup_p50_ms" and r["ratios"] for r in again["summary"])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)
