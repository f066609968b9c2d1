"""The target side: reading remote G2 blocks into a reusing worker.

So far: :mod:`.tp_mapping` plans each target rank's READs from a source's
``resolve`` reply — same TP, heterogeneous TP (head split / gather, HND
layouts) and MLA — as coalesced descriptor lists, and checks up front that a
pairing can be served. The client that executes plans over NIXL
(``maybe_start_target_client``) is the next piece (issue 5).
"""
