"""remote-g2 as a secondary tier of vLLM's own KV offloading (OffloadingConnector + TieringOffloadingSpec).

* :mod:`.spec`: ``RemoteG2OffloadingSpec`` (the spec, with a CPU copy worker where vLLM has none);
* :mod:`.cpu_worker`: ``CPUCopyOffloadingWorker`` (that worker).

The tier itself is added by another change. Importing this package imports nothing of vLLM; its modules do.
"""
