"""Which of UCX's modules a NIXL agent of ours loads: never a second copy of the verbs stack.

NIXL's wheel bundles UCX together with its own ``libibverbs``, ``libmlx5`` and
``libnl-3`` / ``libnl-route-3``. One bundled UCX module, ``ib_efa``, links
against the host's ``libefa.so.1`` instead, and on a host with rdma-core
installed (every RDMA host; ``libibverbs1`` and ``ibverbs-providers`` on
Debian) that pulls in the host's ``libibverbs`` and ``libnl`` beside the
bundled ones. Both copies of ``libnl-route-3`` then run their destructors
at exit and the second crashes in ``rtnl_tc_unregister``: every process
that created a UCX agent dies with SIGSEGV after its work, even one that
created nothing else (``exit`` status 139 where 0 was due).

:func:`keep_one_verbs_stack` leaves that module out (``UCX_MODULES=^efa``)
unless the operator chose ``UCX_MODULES`` already. UCX's verbs transports
(``rc``, ``ud``, ``dc`` through the bundled ``libmlx5``), ``cma``, ``tcp`` and
shared memory are unaffected. On an AWS EFA host, where that module is the
way to the NIC, set ``UCX_MODULES=all`` yourself (UCX's own default; an
empty value loads no module at all) and end processes with ``os._exit``
after their last transfer.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_UCX_MODULES", "keep_one_verbs_stack"]

#: UCX's module filter when the environment names none: every module but the one that loads the host's verbs stack.
DEFAULT_UCX_MODULES = "^efa"


def keep_one_verbs_stack() -> str:
    """Set ``UCX_MODULES`` to :data:`DEFAULT_UCX_MODULES` unless it is set; returns the value in force.

    Call it before the first NIXL agent with the UCX backend is made: UCX reads the variable when it loads its
    modules, once per process."""
    return os.environ.setdefault("UCX_MODULES", DEFAULT_UCX_MODULES)
