"""What goes on the wire: the frame envelope (:mod:`.wire`), the typed messages (:mod:`.messages`, the one
table, filled from one module per conversation: :mod:`.core_messages`, :mod:`.registry_messages`,
:mod:`.source_messages`, :mod:`.sibling_messages`, :mod:`.target_rank_messages`, with the table's machinery in
:mod:`.spec` and the rank types they share in :mod:`.rank_types`), and the strict validation of their bodies
(:mod:`.schema`). No sockets here: :mod:`remote_g2.rpc` carries these.

May import: the core's ``errors``, ``identity.model_identity``. Never :mod:`remote_g2.rpc` or a part.
"""
