"""remote-g2 for vLLM: the ``RemoteG2Connector`` KV connector (see :mod:`.connector`).

vLLM loads it by module path (``kv_connector_module_path="remote_g2.adapters.vllm"``,
``kv_connector="RemoteG2Connector"``). The connector is imported on first
use, so :mod:`.kv_blocks` (block copies between vLLM's KV tensors and a G2
pool, torch only) and :mod:`.settings` import without vLLM installed.

May import: the core, ``source``, ``target``, ``registry`` and ``adapters``' own transfers and pools.
"""

from remote_g2.lazy_exports import lazy_getattr

__all__ = ["ConnectorSettings", "RemoteG2Connector", "RemoteG2ConnectorMetadata"]

__getattr__ = lazy_getattr(__name__, {name: ".settings" if name == "ConnectorSettings" else ".connector"
                                      for name in __all__})
