"""The RPC transports every part talks over: ZMQ ROUTER/DEALER, the TCP stream lane, the mux, worker-internal links.

Owns: :mod:`.server` (the ROUTER server: :mod:`.dispatch` turns frames into handler calls and replies,
:mod:`.serving` reads the socket directly, pooled or driven), :mod:`.client` (DEALER client), :mod:`.stream`
(the ``tcp+stream://`` lane), :mod:`.mux` (many calls in flight from one thread), :mod:`.local_link` (leader
<-> TP rank Unix sockets), :mod:`.curve` (CURVE auth), :mod:`.connection_identity` / :mod:`.connection_watch`
(who is calling, is it up), and addressing: :mod:`.net_address` (what a server advertises),
:mod:`.endpoint_list` (failover lists), :mod:`.ipc_paths` (a worker's private IPC sockets).

May import: :mod:`remote_g2.protocol`, and the core's ``errors``, ``log``, ``config``, ``metrics_export``.
Never a part (registry, source, target, adapters).
"""
