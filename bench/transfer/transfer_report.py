"""The tables ``bench.transfer.bench_transfer`` prints: one line per block size, first contact, sustained rate,
where a request's time goes, late starts; from the rows of :func:`~bench.transfer.transfer_analysis.summarize`."""

from __future__ import annotations

import argparse
import os
from typing import Any

from bench.transfer.transfer_analysis import LATE_START_MS, TP


def print_tables(rows: list[dict[str, Any]], args: argparse.Namespace, setting: dict[str, Any]) -> None:
    """Every table, to stdout: ``rows`` as ``summarize`` made them, ``setting`` the run's (hosts, goals)."""
    goal = setting["goals"]["ratio"]
    g = f">={goal:.2f}"
    if setting["netns"]:
        print(f"across network namespaces (registry {setting['netns']['registry']}, source "
              f"{setting['netns']['source']}, target {setting['netns']['target']}), UCX_TLS={setting['ucx_tls']}; "
              f"raw: the source drives its bare agent every {args.raw_progress_us:g} µs during raw READs")
    print(f"TP={TP}->{TP}, {args.mib} MiB per request ({args.mib // TP} MiB per rank), median of {args.reps}; "
          f"source blocks {args.source_layout} in {args.pool_pages} pages; ranks bound: {args.bind}; "
          f"peer resolve {args.peer_resolve}"
          + (f" over {args.peer_transport}; " if args.peer_resolve == "on" else "; ")
          + f"NIXL {nixl_version()} UCX; "
          f"{os.cpu_count()} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}")
    hdr = (f"{'block':>6} {'desc/rk':>7} {'e2e ms':>7} {'e2e GB/s':>8} {'raw ms':>7} {'raw GB/s':>8} "
           f"{'memcpy':>7} {'e2e/raw':>7} {'paired':>6} {'range':>9} {g:>6} {'fixed ms':>8} {'1st ms':>7} "
           f"{'1blk e2e':>8} {'1blk raw':>8} {'1blk x':>6}")
    print(hdr)
    for r in rows:
        print(f"{str(r['block_kib']) + 'K':>6} {max(r['descriptors_per_rank']):>7} {r['e2e_s'] * 1e3:>7.2f} "
              f"{r['e2e_gb_per_s']:>8.2f} {r['raw_s'] * 1e3:>7.2f} {r['raw_gb_per_s']:>8.2f} "
              f"{r['memcpy_gb_per_s']:>7.2f} {r['ratio_e2e_over_raw']:>7.2f} {r['ratio_paired_median']:>6.2f} "
              f"{'%.2f-%.2f' % tuple(r['ratio_paired_range']):>9} "
              f"{'yes' if r['target_met'] else 'NO':>6} {r['fixed_cost_s'] * 1e3:>8.2f} "
              f"{r['first_contact_s'] * 1e3:>7.1f} {r['one_block_e2e_s'] * 1e3:>8.2f} "
              f"{r['one_block_raw_s'] * 1e3:>8.3f} {r['one_block_ratio']:>6.2f}")
    one_goal = setting["goals"]["one_block"]
    print("  e2e/raw: ratio of the medians (the target); paired: median of the per-round ratios, range: their\n"
          "  lowest and highest (how much this machine moved during the run); memcpy: GB/s;\n"
          "  fixed: median of (e2e - raw) per round; 1st: the target's first contact with the source (its first\n"
          "  request, 1 block: loads the source's metadata, connects);\n"
          "  1blk: a 1-block request, ms; 1blk x: e2e / raw" + (f" (goal <= {one_goal:g})" if one_goal else ""))
    print("\nfirst contact (the target's first request, 1 block, from a source it never talked to), ms:")
    fc_keys = ["e2e", "lookup", "handoff", "resolve", "reads", "finish", "notice", "metadata_rpc", "add_peer",
               "rank0_read", "rank1_read"]
    print(f"{'block':>6}" + "".join(f"{k:>13}" for k in fc_keys) + f"{'full 1st':>10}")
    for r in rows:
        fc = r["first_contact_ms"]
        print(f"{str(r['block_kib']) + 'K':>6}" + "".join(
            f"{'-' if fc.get(k) is None else f'{fc[k]:.2f}':>13}" for k in fc_keys)
            + f"{r['first_request_s'] * 1e3:>10.1f}")
    print("  metadata_rpc / add_peer: the slower rank's GetMetadata RPC (0: the resolve brought the metadata) /\n"
          "  NIXL loading it (inside resolve/reads); full 1st: the first full-size request after that")
    for r in rows:
        if r.get("source_link_sent") is not None:
            print(f"{r['block_kib']}K: the source host sent {r['source_link_sent'] / 1e9:.2f} GB over its link; the "
                  f"target read {r['bytes_read'] / 1e9:.2f} GB from it "
                  f"({r['source_link_sent'] / r['bytes_read']:.2f}x)")
    streams = [(r["block_kib"], r["stream"]) for r in rows if r.get("stream")]
    if streams:
        st0 = streams[0][1]
        print(f"\nsustained: {st0['requests']} requests of {args.mib} MiB per round, up to {st0['depth']} in flight, "
              f"median of {args.stream_rounds} rounds")
        print(f"{'block':>6} {'e2e GB/s':>8} {'raw GB/s':>8} {'e2e/raw':>7} {g:>6} {'copying':>12}")
        for kib, st in streams:
            busy = "/".join(f"{b:.2f}" for b in st["rank_busy"]) if st.get("rank_busy") else "-"
            print(f"{str(kib) + 'K':>6} {st['e2e_gb_per_s']:>8.2f} {st['raw_gb_per_s']:>8.2f} "
                  f"{st['ratio_e2e_over_raw']:>7.2f} {'yes' if st['target_met'] else 'NO':>6} {busy:>12}")
        print("  raw: the same READs with as many posted at once (each rank its own), from one shared instant;\n"
              "  copying: each rank's share of an e2e round spent inside its READ posts")
    phases = ["lookup", "handoff", "resolve", "reads", "finish", "notice"]
    details = ["resolve_rpc", "release_rpc", "link_to_rank1", "rank1_up", "rank1_decode", "rank0_handed", "rank0_wake",
               "rank0_plan", "rank0_read", "rank1_handed", "rank1_wake", "rank1_plan", "rank1_read", "rank1_wrapup",
               "link_from_rank1", "reads_overlap", "after_reads", "outside_reads"]
    print("\nwhere a request's time goes (median ms; the first six add up to e2e)"
          + (": over TCP a READ's post returns at once, its bytes move during after_reads/rank1_wrapup"
             if setting["netns"] else ":"))
    print(f"{'':>12}" + "".join(f"{str(r['block_kib']) + 'K ' + k:>12}" for r in rows for k in ("full", "1-blk")))
    for p in ["e2e", *phases, *details]:
        cells = []
        for r in rows:
            for k in ("full", "one"):
                v = r["breakdown_ms"][k].get(p)
                cells.append(f"{'-' if v is None else f'{v:.3f}':>12}")
        print(f"{p:>12}" + "".join(cells))
    late = [f"{r['block_kib']}K {r['late_starts']['count']} of {r['late_starts']['of']}" for r in rows]
    print(f"\nlate starts (a rank's READ began {LATE_START_MS:g} ms or more after the resolve returned): "
          + ", ".join(late) + "\n  on a 2-vCPU VM a woken thread can wait behind the other rank's copy on its CPU "
          "(docs/target.md)")


def nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "?"
