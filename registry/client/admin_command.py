"""``remote-g2 admin``: who holds which blocks, which workers are live, and operator actions.

Subcommands: ``workers``, ``worker ID``, ``models``, ``who-has HASH…``, ``prefix HASH…``,
``stats``, ``feed``, ``drain ID``, ``score``. Hashes are hex (``0x`` optional). Every subcommand
takes ``--json``. An unreachable registry (or store) exits 1 with one line.

``score`` asks the scoring API (``serve --score-bind``, over HTTP: ``--url``)
what a router would: which workers hold how much of a prompt's prefix
(token ids, or block hashes), with the same answer as ``POST /v1/score``.

``models`` groups the workers by model identity (the part of a fingerprint's
``model_id`` after its last ``#``: what matching compares) and names a label
(the part before it) that more than one identity is served under: during a
rolling update, old and new weights under one path. An instance without an
identity (it shares nothing: docs/integrations.md) is a row of its own,
``none (KIND)``, its ``no_identity`` the kind in ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from remote_g2.cli import print_json, print_table
from remote_g2.config import ClientSettings
from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.errors import ConfigError
from remote_g2.identity.hashing import hash_from_hex
from remote_g2.protocol.messages import WorkerRecord
from remote_g2.identity.model_identity import model_label, unshared_kind

from .registry_client import RegistryClient


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", default=None, help="registry endpoint, or several separated by commas "
                   "(a failover list; default: $REMOTE_G2_REGISTRY or tcp://127.0.0.1:7450)")
    p.add_argument("--timeout-s", type=float, default=None, help="RPC timeout (default 5 s)")
    p.add_argument("--curve-server-key", default=None, help="registry public key file or Z85 text")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    sub = p.add_subparsers(dest="admin_command", metavar="SUBCOMMAND", required=True)
    w = sub.add_parser("workers", parents=[common], help="list workers")
    w.add_argument("--all", action="store_true", help="include workers whose lease lapsed (not yet swept)")
    sub.add_parser("worker", parents=[common], help="one worker's record").add_argument("worker_id")
    m = sub.add_parser("models", parents=[common], help="model identities the workers hold, and who shares each")
    m.add_argument("--all", action="store_true", help="include workers whose lease lapsed (not yet swept)")
    who = sub.add_parser("who-has", parents=[common], help="holders of each hash")
    who.add_argument("hashes", nargs="+", metavar="HASH")
    who.add_argument("--all", action="store_true", help="include dead holders")
    pre = sub.add_parser("prefix", parents=[common], help="best owner of the longest prefix of HASH…")
    pre.add_argument("hashes", nargs="+", metavar="HASH")
    pre.add_argument("--requester", default=None, help="worker id asking (excluded; its layout is matched)")
    pre.add_argument("--compat-key", default=None, help="layout compat key to match")
    pre.add_argument("--holders", action="store_true", help="also list every holder")
    sub.add_parser("stats", parents=[common], help="registry counters")
    sub.add_parser("feed", parents=[common], help="where this server publishes its change feed, and its position")
    sub.add_parser("drain", parents=[common], help="forget a worker and its blocks").add_argument("worker_id")
    sc = sub.add_parser("score", parents=[common], help="which workers hold how much of a prompt (the scoring API)")
    sc.add_argument("--url", default=None, help="the scoring API (serve --score-bind; default: $REMOTE_G2_SCORE_URL "
                    "or http://127.0.0.1:7460)")
    sc.add_argument("--model", default=None, help="the model the prompt is for (a worker's model label or id)")
    what = sc.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", default=None, help="token ids, comma-separated")
    what.add_argument("--tokens-file", default=None, help="a JSON list of token ids ('-': stdin)")
    what.add_argument("--hashes", nargs="+", default=None, metavar="HASH", help="block hashes (hex)")
    sc.add_argument("--lora-name", default=None)
    sc.add_argument("--lora-path", default=None, help="the adapter's path as the workers loaded it (vLLM hashes it)")
    sc.add_argument("--cache-salt", default=None)
    sc.add_argument("--workers", default=None, help="only these worker ids, comma-separated")
    sc.add_argument("--token-file", default=None, help="the API's bearer token (or $REMOTE_G2_SCORE_TOKEN)")
    sc.add_argument("--ca-file", default=None, help="https: the CA that signed the API's certificate")
    sc.add_argument("--cert", default=None, help="https: this client's certificate, where the API requires one")
    sc.add_argument("--key", default=None, help="its private key")


def _hashes(texts: list[str]) -> list[bytes]:
    try:
        return [hash_from_hex(t) for t in texts]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _worker_json(w: WorkerRecord) -> dict[str, Any]:
    fp = w.fingerprint
    return {
        "worker_id": w.worker_id, "kind": w.kind or "source", "endpoint": w.endpoint, "tp_size": w.tp_size,
        "epoch": w.epoch, "live": w.live,
        "blocks": w.blocks, "load": w.load, "last_seq": w.last_seq, "lease_expires_in_ms": w.lease_expires_in_ms,
        "registered_at_ms": w.registered_at_ms,
        "fingerprint": {f: getattr(fp, f) for f in fp.__dataclass_fields__}, "compat_key": fp.compat_key(),
    }


def _print_workers(workers: list[WorkerRecord]) -> None:
    print_table(
        ["worker_id", "kind", "endpoint", "tp", "epoch", "live", "blocks", "load", "lease_ms", "model", "compat_key"],
        [[w.worker_id, w.kind or "source", w.endpoint, w.tp_size, w.epoch, "yes" if w.live else "NO", w.blocks,
          w.load, w.lease_expires_in_ms, w.fingerprint.model_id, w.fingerprint.compat_key()] for w in workers],
    )


_MAX_IDS = 4  # worker ids a models row names before "+N more"


def _models_doc(workers: list[WorkerRecord]) -> dict[str, Any]:
    groups: dict[str, list[WorkerRecord]] = {}
    for w in workers:
        groups.setdefault(w.fingerprint.model_identity, []).append(w)
    models = []
    for identity, ws in groups.items():
        ws = sorted(ws, key=lambda w: w.worker_id)
        models.append({
            "identity": identity,
            "no_identity": unshared_kind(ws[0].fingerprint.model_id),  # why it has none; None: it shares
            "labels": sorted({lb for w in ws if (lb := model_label(w.fingerprint.model_id)) is not None}),
            "workers": [{"worker_id": w.worker_id, "live": w.live, "tp_size": w.tp_size, "blocks": w.blocks,
                         "dtype": w.fingerprint.dtype, "label": model_label(w.fingerprint.model_id),
                         "endpoint": w.endpoint} for w in ws],
            "live_workers": sum(1 for w in ws if w.live),
            "blocks": sum(w.blocks for w in ws if w.live),
        })
    models.sort(key=lambda m: (-m["blocks"], m["identity"]))
    by_label: dict[str, set[str]] = {}
    for m in models:
        if m["no_identity"] is not None:  # not weights under a name: an instance that shares nothing
            continue
        for label in m["labels"]:
            by_label.setdefault(label, set()).add(m["identity"])
    # an id without a label is all identity: two such ids are two names, not one name split
    split = {label: sorted(ids) for label, ids in sorted(by_label.items()) if len(ids) > 1}
    return {"models": models, "split_labels": split}


def _ids_cell(workers: list[dict[str, Any]]) -> str:
    names = [w["worker_id"] + ("" if w["live"] else " (dead)") for w in workers]
    more = len(names) - _MAX_IDS
    return ", ".join(names) if more <= 0 else ", ".join(names[:_MAX_IDS - 1]) + f" +{more + 1} more"


def _distinct(values: list[Any]) -> str:
    return ", ".join(str(v) for v in sorted(set(values)))


def run(args: argparse.Namespace) -> int:
    if args.admin_command == "score":
        return _score(args)
    settings = ClientSettings.from_env()
    endpoint = args.registry or settings.registry_endpoint
    key = args.curve_server_key or settings.curve_server_key
    timeout_s = args.timeout_s or settings.rpc_timeout_ms / 1000
    with RegistryClient(endpoint, timeout_s=timeout_s,
                        curve=CurveClientConfig.for_server(key) if key else None) as client:
        return _COMMANDS[args.admin_command](client, args)


def _workers(client: RegistryClient, args: argparse.Namespace) -> int:
    workers = client.list_workers(include_dead=args.all)
    if args.json:
        print_json([_worker_json(w) for w in workers])
    elif workers:
        _print_workers(workers)
    else:
        print("no workers registered")
    return 0


def _worker(client: RegistryClient, args: argparse.Namespace) -> int:
    w = client.worker_info(args.worker_id)
    if w is None:
        if args.json:
            print_json(None)
        else:
            print(f"unknown worker {args.worker_id!r}")
        return 1
    if args.json:
        print_json(_worker_json(w))
    else:
        _print_workers([w])
        fp = w.fingerprint
        print(f"\nlayout: {fp.model_id} {fp.dtype} {fp.kv_layout} layers={fp.num_layers} kv_heads={fp.num_kv_heads} "
              f"head_dim={fp.head_dim} tokens/block={fp.tokens_per_block} mla={fp.is_mla}")
    return 0


def _models(client: RegistryClient, args: argparse.Namespace) -> int:
    doc = _models_doc(client.list_workers(include_dead=args.all))
    if args.json:
        print_json(doc)
        return 0
    if not doc["models"]:
        print("no workers registered")
        return 0
    print_table(
        ["identity", "labels", "live/total", "worker_ids", "tp", "dtype", "blocks"],
        [[m["identity"] if m["no_identity"] is None else f"none ({m['no_identity']}): shares nothing",
          ", ".join(m["labels"]) or "-", f"{m['live_workers']}/{len(m['workers'])}",
          _ids_cell(m["workers"]), _distinct([w["tp_size"] for w in m["workers"]]),
          _distinct([w["dtype"] for w in m["workers"]]), m["blocks"]] for m in doc["models"]],
    )
    if doc["split_labels"]:
        print()
    for label, ids in doc["split_labels"].items():
        print(f"label {label}: {len(ids)} identities (different weights under one name: a rolling update, "
              f"or diverged copies): {', '.join(ids)}")
    return 0


def _who_has(client: RegistryClient, args: argparse.Namespace) -> int:
    hashes = _hashes(args.hashes)
    holders = client.who_has(hashes, include_dead=args.all)
    if args.json:
        print_json({h.hex(): holders[h] for h in hashes})
    else:
        print_table(["hash", "holders"], [[h.hex(), ", ".join(holders[h]) or "-"] for h in hashes])
    return 0


def _prefix(client: RegistryClient, args: argparse.Namespace) -> int:
    hashes = _hashes(args.hashes)
    t0 = time.perf_counter()
    r = client.lookup(hashes, requester=args.requester, compat_key=args.compat_key, want_all_holders=args.holders)
    ms = (time.perf_counter() - t0) * 1e3
    best = r.best
    doc: dict[str, Any] = {"worker_id": best.worker_id if best else None, "endpoint": best.endpoint if best else None,
                           "tp_size": best.tp_size if best else None, "matched": r.matched, "asked": len(hashes),
                           "reason": r.reason}
    if args.holders:
        doc["holders"] = [{"worker_id": x.worker_id, "endpoint": x.endpoint, "tp_size": x.tp_size,
                           "matched": x.matched} for x in r.holders]
    if args.json:
        print_json(doc)
        return 0
    if best is None:
        print(f"no owner for this prefix: {r.reason}  ({ms:.2f} ms)")
    else:
        print(f"best: {best.worker_id} at {best.endpoint} (tp={best.tp_size}) matches {r.matched}/{len(hashes)} "
              f"blocks  ({ms:.2f} ms)")
    if args.holders and r.holders:
        print()
        print_table(["worker_id", "endpoint", "tp", "matched"],
                    [[x.worker_id, x.endpoint, x.tp_size, x.matched] for x in r.holders])
    return 0


def _stats(client: RegistryClient, args: argparse.Namespace) -> int:
    s = client.stats()
    doc = {f: getattr(s, f) for f in s.__dataclass_fields__}
    doc["hit_ratio"] = round(s.lookup_hits / s.lookups, 4) if s.lookups else None
    if args.json:
        print_json(doc)
    else:
        print_table(["metric", "value"], [[k, doc[k]] for k in sorted(doc)])
    return 0


def _feed(client: RegistryClient, args: argparse.Namespace) -> int:
    f, mirror = client.feed_info(), client.stats().mirror
    doc = {"endpoint": f.endpoint or None, "instance": f.instance or None, "seq": f.seq,
           "lease_ttl_ms": f.lease_ttl_ms, "mirror": mirror}
    if args.json:
        print_json(doc)
    elif not f.endpoint:
        print(f"{client.endpoint} publishes no change feed (started with --feed-bind none); mirrors cannot follow it")
    else:
        print_table(["feed", "instance", "last seq", "lease ttl ms", "this server's mirror"],
                    [[f.endpoint, f.instance, f.seq, f.lease_ttl_ms, mirror]])
    return 0


def _drain(client: RegistryClient, args: argparse.Namespace) -> int:
    r = client.drain_worker(args.worker_id)
    if args.json:
        print_json({"worker_id": args.worker_id, "existed": r.existed, "removed_blocks": r.removed_blocks})
    elif r.existed:
        print(f"drained {args.worker_id}: {r.removed_blocks} block entries removed")
    else:
        print(f"unknown worker {args.worker_id!r}; nothing to drain")
    return 0 if r.existed else 1


_COMMANDS = {"workers": _workers, "worker": _worker, "models": _models, "who-has": _who_has, "prefix": _prefix,
             "stats": _stats, "feed": _feed, "drain": _drain}


DEFAULT_SCORE_URL = "http://127.0.0.1:7460"


def _score_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model}
    if args.hashes is not None:
        body["block_hashes"] = [h.removeprefix("0x") for h in args.hashes]
    else:
        try:
            if args.tokens is not None:
                tokens = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
            else:
                with (sys.stdin if args.tokens_file == "-" else open(args.tokens_file, encoding="utf-8")) as f:
                    tokens = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"token ids: {e}") from None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ConfigError("token ids: expected a list of ints")
        body["token_ids"] = tokens
    for key in ("lora_name", "lora_path", "cache_salt"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.workers:
        body["workers"] = [w for w in args.workers.split(",") if w]
    return body


def _score(args: argparse.Namespace) -> int:
    """``admin score``: POST /v1/score and print the answer (exit 1 with the API's error line)."""
    import os
    import urllib.error
    import urllib.request

    url = (args.url or os.environ.get("REMOTE_G2_SCORE_URL") or DEFAULT_SCORE_URL).rstrip("/") + "/v1/score"
    headers = {"Content-Type": "application/json"}
    token = os.environ.get("REMOTE_G2_SCORE_TOKEN")
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"--token-file: {e}") from None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(_score_body(args)).encode(), headers=headers)
    context = None
    if url.startswith("https://"):
        import ssl

        try:
            context = ssl.create_default_context(cafile=args.ca_file)
            if args.cert:
                context.load_cert_chain(args.cert, args.key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"score: TLS: {e}") from None
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=args.timeout_s or 10.0, context=context) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read())["error"]
            print(f"score: HTTP {e.code} {err['reason']}: {err['message']}", file=sys.stderr)
        except (ValueError, KeyError, TypeError):
            print(f"score: HTTP {e.code} from {url}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"score: cannot reach {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1
    ms = (time.perf_counter() - t0) * 1e3
    if args.json:
        print_json(doc)
        return 0
    workers = doc["workers"]
    if not workers:
        print(f"no live worker serves {doc.get('model')!r}  ({ms:.1f} ms)")
        return 0
    print_table(["worker_id", "tp", "blocks", "tokens", "g2", "fetch_ms", "prefill_saved_ms", "load", "endpoint"],
                [[w["worker_id"], w["tp_size"], w["matched_blocks"], w["matched_tokens"], w["tier"].get("g2", 0),
                  "-" if w["fetch_ms"] is None else w["fetch_ms"],
                  "-" if w["prefill_saved_ms"] is None else w["prefill_saved_ms"], w["load"], w["endpoint"]]
                 for w in workers])
    best = doc["best"]
    tokens = f" of {doc['num_tokens']} tokens" if doc.get("num_tokens") is not None else ""
    print(f"\nbest: {best} ({workers[0]['matched_tokens']} tokens cached{tokens})  ({ms:.1f} ms)" if best
          else f"\nno worker holds a prefix of it{tokens}  ({ms:.1f} ms)")
    return 0
