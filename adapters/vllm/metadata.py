"""What the vLLM connector's scheduler and workers tell each other every step (vLLM carries it).

:class:`RemoteG2ConnectorMetadata` goes scheduler → every worker with the
step's plan; :class:`RemoteG2WorkerMetadata` comes back from the workers,
aggregated by vLLM over the TP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .lora_identity import LoraIdentity, PathVersion

__all__ = ["LoadPlan", "RemoteG2ConnectorMetadata", "RemoteG2WorkerMetadata"]


@dataclass
class LoadPlan:
    """One request's remote load, as the scheduler planned it."""

    request_id: str
    hashes: list[bytes]
    block_ids: list[int]  # vLLM destination blocks, one per hash
    source: tuple[str, str, int] | None = None  # the scheduler's match: worker id, endpoint, TP size


@dataclass
class RemoteG2ConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler → worker: loads to start, full prompt blocks to save (of which request),
    requests vLLM preempted (their blocks may be reused in this very step), and whether the step runs no
    forward at all (``idle``: every request waits, e.g. for its remote KV).

    A step that saves blocks of LoRA requests names each save block's adapter (``save_lora``, parallel to
    ``save_hashes``; "" for none) and each adapter's file versions as digested (``lora_files``): the workers
    check them after the forward and save no block of an adapter whose files changed (:mod:`.lora_identity`).
    """

    loads: list[LoadPlan] = field(default_factory=list)
    save_hashes: list[bytes] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)
    save_request_ids: list[str] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    idle: bool = False
    save_lora: list[str] = field(default_factory=list)  # empty: the step saves no block of a LoRA request
    lora_files: dict[str, tuple[PathVersion, ...]] = field(default_factory=dict)

    def add_lora_saves(self, start: int, adapter: LoraIdentity | None, n: int) -> None:
        """Name ``adapter`` (None: none) as the adapter of the ``n`` save blocks from position ``start`` on."""
        self.save_lora += [""] * (start - len(self.save_lora))
        if adapter is None or adapter.key is None:
            self.save_lora += [""] * n
            return
        key = adapter.key.hex()
        self.save_lora += [key] * n
        self.lora_files[key] = adapter.versions


@dataclass
class RemoteG2WorkerMetadata(KVConnectorWorkerMetadata):
    """One step's news, worker → scheduler: requests whose remote load failed at the source.

    Not loads refused for want of a landing slot (this worker's own shortage): only these put the
    source in its cooldown.
    """

    source_failures: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, RemoteG2WorkerMetadata)
        return RemoteG2WorkerMetadata(self.source_failures | other.source_failures)
