"""Pluggable adapters, chosen by name (see :mod:`.registry`, the one place naming them all).

* :mod:`.secondary_pool` — the ``SecondaryPool`` contract a rank's G2 pool meets;
* :mod:`.host_pool` — ``HostPool``, a ``PoolIndex`` over one host buffer;
* :mod:`.registry` — ``load_adapter(kind, name)``, lazy, with module-path override.
"""
