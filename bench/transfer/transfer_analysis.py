"""What ``bench.transfer.bench_transfer`` measured, per mode: end to end, raw NIXL, memcpy, the sustained stream.

:func:`breakdown` cuts each timed request into phases from every rank's timestamps; :func:`summarize` turns one
block size's raw result (the target's series ``full`` and ``one``, its ``first_contact`` and ``stream``) into the
row the JSON and the tables show: medians, GB/s, e2e/raw ratios against the goals, the fixed cost, late starts.
Pure functions of the results: nothing here starts a process or prints.
"""

from __future__ import annotations

import statistics
from typing import Any

TP = 2  # ranks of each worker, source and target (the breakdown reads rank 0's and rank 1's steps)
LATE_START_MS = 1.0  # a rank whose READ starts this long after the resolve: it waited for a CPU, not for us


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def breakdown(series: dict[str, Any], events: list[list[list[Any]]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each timed request of ``series`` cut into phases (seconds) from every rank's timestamps, and their medians.

    The critical path (they add up to the end-to-end time): ``lookup`` (registry
    RPC), ``handoff`` (start_load until the coordinator picks it up), ``resolve``
    (until the resolve RPC returned; with peer resolve, rank 0's ``peer_resolve``
    while the other ranks ask their own peers meanwhile), ``reads`` (until the leader has heard from
    the last rank: fan-out, both ranks' READs, reports), ``finish`` (until the
    outcome is posted; the release RPC is inside it only when the lease's expiry
    came too close, else it runs after the report), ``notice`` (until the
    polling loop saw it). The rest are details.
    """
    rows: list[dict[str, float]] = []
    for req in series["e2e"]:
        t0, t1 = req["t0"], req["t_end"]

        def inside(rank: int, what: str) -> list[list[Any]]:
            return [e for e in events[rank] if e[0] == what and t0 <= e[1] <= t1]

        try:
            begin = inside(0, "begin")[0]
            resolve = (inside(0, "rpc:Resolve") or inside(0, "rpc:PeerResolve"))[0]  # rank 0's share (peer)
            handed = inside(0, "link_send:TargetLoad"), inside(1, "link_recv:TargetLoad")
            release = (inside(0, "rpc:Release") or [[None, None, None]])[0]
            complete = inside(0, "complete")[0]
            done = inside(0, "rank_done")
            reads = [inside(r, "start_read")[0] for r in range(TP)]
            plans = [inside(r, "plan")[0] for r in range(TP)]
            submits = [inside(r, "submit")[0] for r in range(TP)]
            reported = inside(1, "link_send:TargetDone"), inside(0, "link_recv:TargetDone")
        except IndexError:
            continue  # a timestamp fell outside the window; skip this request
        last_done = max(e[1] for e in done)
        row = {
            "e2e": t1 - t0,
            "lookup": req["t_lookup"] - t0,
            "handoff": begin[1] - req["t_lookup"],
            "resolve": resolve[2] - begin[1],
            "reads": last_done - resolve[2],
            "finish": complete[2] - last_done,
            "notice": t1 - complete[2],
            # details
            "resolve_rpc": resolve[2] - resolve[1],
            "release_rpc": (release[2] - release[1]) if release[1] is not None else None,
            # a link message: from the sender's send() until the receiver's receive() returned it
            "link_to_rank1": (handed[1][0][2] - handed[0][0][1]) if all(handed) else None,
            # of which: until rank 1's loop called receive() (its wake-up), and the receive itself (decoding)
            "rank1_up": (handed[1][0][1] - handed[0][0][1]) if all(handed) else None,
            "rank1_decode": (handed[1][0][2] - handed[1][0][1]) if all(handed) else None,
            "rank0_handed": submits[0][1] - resolve[2],
            "rank0_wake": reads[0][1] - submits[0][1],
            "rank0_plan": plans[0][2] - plans[0][1],  # of which: ReadPlanner.plan, in place
            "rank0_read": reads[0][2] - reads[0][1],
            "rank1_handed": submits[1][1] - resolve[2],
            "rank1_wake": reads[1][1] - submits[1][1],
            "rank1_plan": plans[1][2] - plans[1][1],
            "rank1_read": reads[1][2] - reads[1][1],
            "link_from_rank1": (reported[1][0][2] - reported[0][0][1]) if all(reported) else None,
            # rank 1 from the end of its READ post to sending its report (state check, handle release)
            "rank1_wrapup": (reported[0][0][1] - reads[1][2]) if reported[0] else None,
            "read_span": max(r[2] for r in reads) - min(r[1] for r in reads),
            "reads_overlap": min(r[2] for r in reads) - max(r[1] for r in reads),
            "after_reads": last_done - max(r[2] for r in reads),
        }
        row["outside_reads"] = row["e2e"] - row["read_span"]
        # what only a first contact should pay: the source's metadata (its RPC, NIXL loading it), per slower rank
        row["metadata_rpc"] = max(sum(e[2] - e[1] for e in inside(r, "rpc:GetMetadata")) for r in range(TP))
        row["add_peer"] = max(sum(e[2] - e[1] for e in inside(r, "add_peer")) for r in range(TP))
        rows.append(row)
    if not rows:
        return {"requests": 0}, rows
    keys = rows[0].keys()
    return {"requests": len(rows), **{k: _med([r[k] for r in rows]) for k in keys}}, rows


def bytes_read(res: dict[str, Any]) -> int:
    """Every byte the target read from the source in a run: requests and raw READs, warm-ups and streams."""
    total = res["first_contact_bytes"]
    for kind in ("full", "one"):
        series = res[kind]
        total += series["bytes"] * (2 + len(series["e2e"]) + len(series["raw"]))  # + warm-up request and READ
    if st := res.get("stream"):
        total += st["bytes"] * (len(st["e2e"]) + len(st["raw"]))
    return total


def summarize(kib: int, res: dict[str, Any], goals: dict[str, Any]) -> dict[str, Any]:
    full, one = res["full"], res["one"]
    nbytes = full["bytes"]
    e2e = [r["s"] for r in full["e2e"]]
    raw = [r["s"] for r in full["raw"]]
    mem = [r["s"] for r in full["memcpy"]]
    e2e_s, raw_s, mem_s = statistics.median(e2e), statistics.median(raw), statistics.median(mem)
    ratio = raw_s / e2e_s
    one_e2e = [r["s"] for r in one["e2e"]]
    one_raw = [r["s"] for r in one["raw"]]
    out = {
        "block_kib": kib,
        "blocks_per_rank": full["blocks"],
        "descriptors_per_rank": full["raw"][0]["descriptors"],
        "bytes_per_request": nbytes,
        "e2e_s": e2e_s, "e2e_gb_per_s": nbytes / e2e_s / 1e9,
        "raw_s": raw_s, "raw_gb_per_s": nbytes / raw_s / 1e9,
        "memcpy_s": mem_s, "memcpy_gb_per_s": nbytes / mem_s / 1e9,
        "ratio_e2e_over_raw": ratio, "ratio_paired_median": statistics.median(b / a for a, b in zip(e2e, raw)),
        "ratio_paired_range": [min(b / a for a, b in zip(e2e, raw)), max(b / a for a, b in zip(e2e, raw))],
        "target_ratio": goals["ratio"], "target_met": ratio >= goals["ratio"],
        "fixed_cost_s": statistics.median(a - b for a, b in zip(e2e, raw)),
        "outside_reads_s": res["breakdown"]["full"].get("outside_reads"),
        "first_request_s": full["warmup_e2e"]["s"],  # the first full-size one (the target is connected by then)
        "first_contact_s": res["first_contact"]["s"],  # the target's first request: 1 block, a new source
        "first_contact_ms": {p: (None if v is None else (v * 1e3 if p != "requests" else v))
                             for p, v in res["breakdown"]["first_contact"].items()},
        "one_block_e2e_s": statistics.median(one_e2e),
        "one_block_raw_s": statistics.median(one_raw),
        "one_block_fixed_s": statistics.median(a - b for a, b in zip(one_e2e, one_raw)),
        "one_block_ratio": statistics.median(one_e2e) / statistics.median(one_raw),
        "one_block_goal": goals["one_block"],
        "one_block_goal_met": (None if goals["one_block"] is None
                               else statistics.median(one_e2e) / statistics.median(one_raw) <= goals["one_block"]),
        "runs": {"e2e_s": e2e, "raw_s": raw, "memcpy_s": mem, "raw_rank_s": [r["rank_s"] for r in full["raw"]],
                 "raw_start_late_s": [r.get("start_late_s") for r in full["raw"]],
                 "memcpy_rank_s": [r["rank_s"] for r in full["memcpy"]], "one_e2e_s": one_e2e,
                 "one_raw_s": one_raw},
        "stream": _stream_summary(res.get("stream"), goals["ratio"]),
        "source_endpoint": res.get("source_endpoint"),
        "bytes_read": bytes_read(res),
        "source_link_sent": res.get("source_link_sent"),
        "client_stats": res.get("client_stats"),
        "loadavg_after": res.get("loadavg_after"),
        "pins_after": res.get("pins_after"),
        "breakdown_ms": {k: {p: (None if v is None else (v * 1e3 if p != "requests" else v))
                             for p, v in b.items()} for k, b in res["breakdown"].items() if k != "first_contact"},
        "breakdown_rows_ms": {k: [{p: None if v is None else v * 1e3 for p, v in row.items()} for row in rows]
                              for k, rows in res["breakdown_rows"].items()},
    }
    out["late_starts"] = late_starts(out["breakdown_rows_ms"]["full"])
    return out


def stream_busy(stream: dict[str, Any], events: list[list[list[Any]]]) -> list[list[float]]:
    """Per e2e stream round, each rank's share of the round spent inside its READ posts (copying)."""
    out = []
    for rnd in stream["e2e"]:
        t0, t1 = rnd["t0"], rnd["t_end"]
        out.append([sum(e[2] - e[1] for e in evs if e[0] == "start_read" and t0 <= e[1] <= t1) / (t1 - t0)
                    for evs in events])
    return out


def _stream_summary(st: dict[str, Any] | None, goal: float) -> dict[str, Any] | None:
    """Sustained GB/s of the e2e and raw streams (medians over rounds) and their ratio."""
    if not st or not st["e2e"]:
        return None
    e2e = [r["s"] for r in st["e2e"]]
    raw = [r["s"] for r in st["raw"]]
    e2e_s, raw_s = statistics.median(e2e), statistics.median(raw)
    return {"requests": st["requests"], "depth": st["depth"], "bytes": st["bytes"],
            "e2e_s": e2e_s, "e2e_gb_per_s": st["bytes"] / e2e_s / 1e9,
            "raw_s": raw_s, "raw_gb_per_s": st["bytes"] / raw_s / 1e9,
            "ratio_e2e_over_raw": raw_s / e2e_s, "target_met": raw_s / e2e_s >= goal,
            # each rank's fraction of a round spent copying (inside its READ posts), median over rounds
            "rank_busy": [statistics.median(b[r] for b in st["busy"]) for r in range(len(st["busy"][0]))]
            if st.get("busy") else None,
            "runs": {"e2e_s": e2e, "raw_s": raw}}


def late_starts(rows_ms: list[dict[str, Any]]) -> dict[str, int]:
    """How many full-size requests had a rank start its READ ``LATE_START_MS`` or more after the resolve returned."""
    count = sum(max(row[f"rank{r}_handed"] + row[f"rank{r}_wake"] for r in range(TP)) >= LATE_START_MS
                for row in rows_ms)
    return {"count": count, "of": len(rows_ms)}
