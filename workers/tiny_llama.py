"""The built-in model's shape (the small random-weight Llama that tests and the default serve).

Its own module, without torch: an upstream worker sizes its KV per token from it when it fronts
the built-in model on another server, and must not load transformers' model code to do so."""

from __future__ import annotations

TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=8192, rope_theta=10000.0)
