"""Where the registry keeps its map: the storage contract (:mod:`.contract`), the embedded store for one box
(:mod:`.memory`, on the C++ :mod:`.holder_index`), Redis / Sentinel / Cluster (:mod:`.redis_store`, with its
key layout and nodes in :mod:`.redis_nodes` and its Lua scripts, ``lua/``, in :mod:`.redis_scripts`), and the
choice between them by URL (:mod:`.factory`).

May import: the core only.
"""
