"""What goes on the wire: the frame envelope (:mod:`.wire`), the typed messages (:mod:`.messages`),
and the strict validation of their bodies (:mod:`.schema`). No sockets here: :mod:`remote_g2.rpc` carries these.

May import: the core's ``errors``, ``identity.hashing``. Never :mod:`remote_g2.rpc` or a part.
"""
