"""``remote-g2 keygen DIR``: write a CURVE key pair (``NAME.key``, ``NAME.key_secret``)."""

from __future__ import annotations

import argparse

from remote_g2.cli import print_json
from remote_g2.rpc.curve import generate_keypair


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="where to write the key files (created if missing)")
    p.add_argument("--name", default="server", help="file name stem (default: server)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    public, secret = generate_keypair(args.directory, args.name)
    if args.json:
        print_json({"public_key_file": str(public), "secret_key_file": str(secret)})
    else:
        print(f"public key (give to clients): {public}")
        print(f"secret key (keep on the server, mode 0600): {secret}")
    return 0
