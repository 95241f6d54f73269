"""In front of an upstream engine (an OpenAI-compatible server: vLLM, SGLang, `transformers serve`):
talking to it (``api``: probe, request bodies, streams, its published capacity) and, where the
gateway streams a row itself, the gateway's side of that (``direct``). Imports only ``cohort``: the
upstream worker (which admits rows under the engine's KV) and the gateway both stand on it."""
