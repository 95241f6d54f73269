"""The upstream path: cohort in front of an OpenAI-compatible engine (vLLM, SGLang,
`transformers serve`).

* ``api``: talking to an engine (probe, request bodies, streams, its published capacity and queue);
* ``direct``: the gateway's side, streaming a released row from its engine to the client;
* ``admission``, ``rows``, ``release``: the upstream worker's side, which admits groups under the
  engine's KV, releases rows to the gateways that stream them, watches the engine's health and sends
  a broken stream's continuation to another engine.

``api`` and ``direct`` import only ``cohort`` (the gateway stands on them); the worker's side plugs
into the worker's loop interface (``workers.continuous_loop``) and is started by
``workers.upstream_start``."""
