"""Host memory and the secondary (G2) pool: the engine-facing pool contract (:mod:`.secondary_pool`), its
C++ index with atomic find-and-pin (:mod:`.pool_index`), huge-page buffers (:mod:`.host_memory`), the
first-fit allocator (:mod:`.first_fit`) and in-process extent copies (:mod:`.extent_copy`).

May import: the core's ``errors``, ``log``, ``identity``. Never :mod:`remote_g2.rpc` or a part.
"""
