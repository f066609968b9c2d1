"""Core ``remote-g2`` subcommands (each module: ``add_arguments`` + ``run``), found by :mod:`remote_g2.cli`.

May import: the core (``rpc`` for ``ping``). The parts' commands live with their part (``registry/server``,
``registry/client``, ``adapters/reference``).
"""
