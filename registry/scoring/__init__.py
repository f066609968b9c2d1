"""The router-facing service: which worker holds the longest cached prefix of a prompt.

:mod:`.scorer` scores a request against the registry's store (and a mirror), :mod:`.json_wire` reads and writes
its JSON, :mod:`.http_server` / :mod:`.connection` / :mod:`.admission` serve it over HTTP/1.1 with budgets and
tokens, and :mod:`.engine_caches` / :mod:`.vllm_events` / :mod:`.vllm_event_decode` follow vLLM workers' own
cache tiers from their KV events (which publishers: :mod:`.vllm_subscriptions`).

May import: :mod:`..stores`, :mod:`..metrics` and the core. Never the server or the client side: the scorer
takes the server's mirror as a :class:`~.scorer.PrefixIndex`.
"""
