"""remote-g2 for TensorRT-LLM: its host secondary pool as a SecondaryPool, and the executor hooks.

Not run against TensorRT-LLM itself (no GPU on the development machines):
written against its KV cache manager's public API with every method
feature-detected, tested against stand-ins shaped like its classes. See
:mod:`.pool` and ``docs/integrations.md``.

May import: the core, ``source`` and ``target``; TensorRT-LLM only by feature detection.
"""

from remote_g2.lazy_exports import lazy_getattr

__all__ = ["RemoteG2Hooks", "TrtllmApi", "TrtllmSecondaryPool", "detect_api", "start_remote_g2", "tp_from_executor"]

__getattr__ = lazy_getattr(__name__, {"RemoteG2Hooks": ".hooks", "start_remote_g2": ".hooks",
                                      "TrtllmApi": ".pool", "TrtllmSecondaryPool": ".pool", "detect_api": ".pool",
                                      "tp_from_executor": ".pool"})
