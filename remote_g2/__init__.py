"""remote-g2: cross-worker reuse of host-pinned (G2) KV-cache blocks.

Parts (each a subpackage): ``remote_g2.registry`` (block hash → holders),
``remote_g2.source`` (serves pinned blocks from a worker's G2 pool),
``remote_g2.target`` (reads remote blocks into a worker), ``remote_g2.adapters``
(engines and transfer backends, by name). This core package holds what they
share and imports none of them::

    protocol/   what goes on the wire: the frame envelope, the messages by conversation, their validation
    rpc/        the transports that carry it: ZMQ server/client/mux, the TCP stream lane, local links, addresses
    identity/   what makes two blocks the same: block hashes (ours, vLLM's), the model identity
    memory/     the secondary (G2) pool contract, its C++ index, host buffers
    tp/         a worker's TP group and the head mapping between TP sizes
    commands/   the core's CLI subcommands (``ping``, ``keygen``)

and, as modules: the one exception tree (``errors``), settings from the
environment (``config``), the transfer contract (``transfer``), the adapter
table (``plugins``), logging, metrics export and the CLI.

May import: nothing of remote-g2's parts (registry, source, target,
adapters). Inside the core, ``identity`` imports only the top-level modules,
``protocol`` imports ``identity``, and ``rpc``, ``memory`` and ``tp`` import
``protocol``; nothing imports back up that chain (tests/test_layout.py).
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("remote-g2")
except _metadata.PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
