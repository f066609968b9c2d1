"""The registry server: registry messages over :mod:`remote_g2.rpc` in front of a store (:mod:`.service`),
its change feed for mirrors (:mod:`.feed`), metrics (:mod:`.metrics`) and ``remote-g2 serve`` (:mod:`.serve_command`).

May import: :mod:`..stores`, :mod:`..scoring` (``serve --score-bind``), and the core. Never the client side.
"""
