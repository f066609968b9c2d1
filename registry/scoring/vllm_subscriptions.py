"""The ``--vllm-kv-events`` setting, checked: which vLLM KV-event publishers the registry server follows.

Each entry names a publisher endpoint (``@`` to bind it, ``>`` or nothing to connect), the worker id its
blocks belong to, and optionally the model an events-only record names (:mod:`.vllm_events` follows them).
A malformed entry is a :class:`~remote_g2.errors.ConfigError` that names it and the expected syntax.
"""

from __future__ import annotations

from dataclasses import dataclass

from remote_g2.errors import ConfigError
from remote_g2.rpc.endpoint_list import endpoint_problem

__all__ = ["Subscription", "parse_subscriptions"]

_SYNTAX = "[@|>]ENDPOINT=WORKER_ID[=MODEL], e.g. @tcp://127.0.0.1:5557=vllm-0"
_MAX_WORKER_ID = 128  # RegisterWorker.worker_id
_MAX_MODEL = 256  # LayoutFingerprint.model_id


@dataclass(frozen=True)
class Subscription:
    """One vLLM publisher endpoint, the worker id its blocks belong to, and whether to bind.

    ``model`` names the model in an events-only record (default: the worker id).
    """

    endpoint: str
    worker_id: str
    bind: bool = False
    model: str | None = None


def parse_subscriptions(text: str) -> list[Subscription]:
    """Parse ``[@|>]ENDPOINT=WORKER_ID[=MODEL][,…]`` (the ``--vllm-kv-events`` flag).

    ``@`` binds the endpoint (vLLM connects to it), ``>`` or nothing connects.
    """
    subs: list[Subscription] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        spec, sep, rest = item.partition("=")
        worker_id, has_model, model = rest.partition("=")
        bind = spec.startswith("@")
        endpoint = spec[1:] if spec.startswith(("@", ">")) else spec
        why = (None if sep else "no =WORKER_ID") or _endpoint_problem(endpoint, bind) \
            or _name_problem("worker id", worker_id, _MAX_WORKER_ID) \
            or (_name_problem("model", model, _MAX_MODEL) if has_model else None)
        if why is None and any(s.worker_id == worker_id for s in subs):
            why = f"worker {worker_id} is listed twice"
        if why is None and any(s.endpoint == endpoint for s in subs):
            why = f"endpoint {endpoint} is listed twice"
        if why is not None:
            raise ConfigError(f"--vllm-kv-events entry {item!r}: {why}; expected {_SYNTAX}")
        subs.append(Subscription(endpoint, worker_id, bind, model if has_model else None))
    if not subs:
        raise ConfigError(f"--vllm-kv-events lists no publisher; expected {_SYNTAX}")
    return subs


def _endpoint_problem(endpoint: str, bind: bool) -> str | None:
    why = endpoint_problem(endpoint, bind=bind)
    if why and why.startswith("cannot connect"):  # (only ever said of a tcp:// endpoint to connect to)
        return f"{why}, or write @{endpoint} to bind it"
    return why


def _name_problem(what: str, name: str, max_len: int) -> str | None:
    if not name:
        return f"the {what} is empty"
    if len(name) > max_len or any(c.isspace() for c in name):
        return f"the {what} {name!r:.40} is longer than {max_len} characters or has blanks"
    return None
