"""Where the registry keeps its map: the storage contract (:mod:`.contract`), the embedded store for one box
(:mod:`.memory`, on the C++ :mod:`.holder_index`), Redis / Sentinel / Cluster (:mod:`.redis_store`, the
stores and the key layout; its command objects :mod:`.redis_workers`, :mod:`.redis_lookups` and
:mod:`.redis_sweeps` on one shared :mod:`.redis_keyspace`; nodes in :mod:`.redis_nodes`, Lua scripts, ``lua/``,
in :mod:`.redis_scripts`), and the choice between them by URL (:mod:`.factory`).

May import: the core only.
"""
