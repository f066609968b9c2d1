"""Pluggable adapters, chosen by name in the adapter table (:mod:`remote_g2.plugins`, the one place naming them).

* engines: :mod:`.reference` (our reference engine and its demo), :mod:`.vllm`, :mod:`.trtllm`;
* transfers (:class:`~remote_g2.transfer.TransferAdapter`): :mod:`.nixl_transfer`, :mod:`.memcpy_transfer`;
* pools (:class:`~remote_g2.memory.secondary_pool.SecondaryPool`): :mod:`.host_pool` — ``HostPool``, a
  ``PoolIndex`` over one host buffer.

May import: the core and the parts they wire together (``source``, ``target``,
``registry``); nothing in those parts or in the core imports this package.
"""
