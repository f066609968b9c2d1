"""remote-g2: cross-worker reuse of host-pinned (G2) KV-cache blocks.

Parts (each a subpackage): ``remote_g2.registry`` (block hash → holders),
``remote_g2.source`` (serves pinned blocks from a worker's G2 pool),
``remote_g2.target`` (reads remote blocks into a worker), ``remote_g2.adapters``
(engines and transfer backends, by name). This core package holds what they
share and imports none of them: the wire protocol and RPC, the contracts the
parts are written against (``secondary_pool``, ``transfer``, and the adapter
table ``plugins``), errors, config, hashing, logging, the CLI and the
secondary-pool index.
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("remote-g2")
except _metadata.PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
