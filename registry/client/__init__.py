"""The registry's client side, inside workers and tools: the typed client (:mod:`.registry_client`), the
publisher that keeps a worker's blocks current (:mod:`.publisher`), the in-process mirror that answers lookups
from memory (:mod:`.mirror`, its copy in :mod:`.mirror_index`), and ``remote-g2 admin`` (:mod:`.admin_command`).

May import: :mod:`..stores` (the mirror's copy is a memory store) and the core. Never the server.
"""
