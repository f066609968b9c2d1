"""The registry server: registry messages over :mod:`remote_g2.rpc` in front of a store (:mod:`.service`),
its change feed for mirrors (:mod:`.feed`) and ``remote-g2 serve`` (:mod:`.serve_command`).

May import: :mod:`..stores`, :mod:`..client` (the server's own mirror), :mod:`..scoring` (``serve
--score-bind``), :mod:`..metrics`, and the core. Nothing in the registry imports it.
"""
