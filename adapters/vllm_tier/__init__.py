"""remote-g2 as a secondary tier of vLLM's own KV offloading (OffloadingConnector + TieringOffloadingSpec).

vLLM owns the copies between the GPU and its primary CPU tier; this package adds the fleet-wide part:

* :mod:`.tier`: ``RemoteG2Tier``, the ``SecondaryTierManager`` (``secondary_tiers`` entry, by ``module_path``):
  lookups through the registry's in-process mirror, loads from peers, publishing, serving peers;
* :mod:`.identity`: the fingerprint a chunk is shared under (weights, options, dtype, chunk size, row layout);
* :mod:`.serving`: peers' resolve/release (leases validated by row generations, or pinned through vLLM's
  ``ParentManager``), over this process's NIXL agent;
* :mod:`.fetching`: resolve at the holder, one NIXL READ into the rows vLLM reserved, release (validates);
* :mod:`.spec`: ``RemoteG2OffloadingSpec`` (vLLM's tiering spec, with a CPU copy worker where vLLM has none);
* :mod:`.cpu_worker`: ``CPUCopyOffloadingWorker`` (that worker).

May import: ``remote_g2`` (messages, registry, source's NIXL agent, the vLLM connector's identity), vLLM.
Importing this package imports nothing of vLLM; its modules do.
"""
