"""``remote-g2 ping [ENDPOINT]``: does a server answer, which server, how fast."""

from __future__ import annotations

import argparse
import time

from remote_g2.cli import print_json, print_table
from remote_g2.config import ClientSettings
from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.rpc.client import RpcClient


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoint", nargs="?", help="server endpoint (default: $REMOTE_G2_REGISTRY or tcp://127.0.0.1:7450)")
    p.add_argument("--count", type=int, default=1, help="pings to send (default 1)")
    p.add_argument("--timeout-ms", type=float, default=None, help="per-ping timeout")
    p.add_argument("--curve-server-key", default=None, help="server public key file or Z85 text")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    settings = ClientSettings.from_env()
    endpoint = args.endpoint or settings.registry_endpoint
    key = args.curve_server_key or settings.curve_server_key
    curve = CurveClientConfig.for_server(key) if key else None
    timeout = args.timeout_ms or settings.rpc_timeout_ms
    rows = []
    with RpcClient(endpoint, timeout_ms=timeout, curve=curve) as client:
        for _ in range(max(1, args.count)):
            t0 = time.perf_counter()
            pong = client.ping()
            rows.append({"endpoint": endpoint, "server": pong.server, "version": pong.version,
                         "uptime_s": round(pong.uptime_s, 3), "rtt_ms": round((time.perf_counter() - t0) * 1e3, 3)})
    if args.json:
        print_json(rows if len(rows) > 1 else rows[0])
    else:
        print_table(["endpoint", "server", "version", "uptime_s", "rtt_ms"],
                    [[r["endpoint"], r["server"], r["version"], r["uptime_s"], r["rtt_ms"]] for r in rows])
    return 0
