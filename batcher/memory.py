"""KV-cache memory model: Δ per token and MEM(B) = β · (L(B) + G(B)) · Δ (SPEC "KV memory")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2,
                "bfloat16": 2, "bf16": 2, "int8": 1, "float8": 1}


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int | None = None) -> int:
    """Δ = 2 · layers · kv_heads · head_dim · dtype_bytes, read from an HF config dict.

    Handles Llama/Qwen/Mistral naming (num_hidden_layers, num_key_value_heads) and
    ChatGLM naming (num_layers, multi_query_group_num, kv_channels).
    """
    layers = config.get("num_hidden_layers") or config.get("num_layers") or config.get("n_layer")
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd")
    if not (layers and heads and hidden):
        raise ValueError("model config lacks layers/heads/hidden size; cannot compute Δ")
    if config.get("multi_query_attention") and config.get("multi_query_group_num"):
        kv_heads = config["multi_query_group_num"]
    else:
        kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config.get("kv_channels") or hidden // heads
    if dtype_bytes is None:
        dtype_bytes = _DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "float32")
                                       .replace("torch.", ""), 4)
    return int(2 * layers * kv_heads * head_dim * dtype_bytes)


@dataclass(frozen=True)
class KVMemory:
    """Δ and Θ of one instance (or the smallest Θ of a pool)."""

    delta_bytes: int
    theta_bytes: int

    @classmethod
    def for_pool(cls, instances: Iterable[Any]) -> KVMemory:
        """A pool's memory (InstanceInfo-like items): the largest Δ and the smallest Θ, because a
        batch must fit whichever instance takes it."""
        items = list(instances)
        return cls(delta_bytes=max(i.delta_bytes for i in items), theta_bytes=min(i.theta_bytes for i in items))

    def mem(self, size: int, input_len: int, gen_len: int) -> int:
        """MEM(B) in bytes for a batch of ``size`` with L(B)=input_len and G(B)=gen_len."""
        return int(size) * (int(input_len) + int(gen_len)) * self.delta_bytes

    def fits(self, size: int, input_len: int, gen_len: int) -> bool:
        return self.mem(size, input_len, gen_len) <= self.theta_bytes

    def max_fixed_batch_size(self, max_input: int, max_gen: int) -> int:
        """The largest β that fits even when every member has the longest input and max_tokens.

        This is what a static server without length prediction must choose (VS default).
        """
        per_req = (max_input + max_gen) * self.delta_bytes
        return max(1, self.theta_bytes // per_req) if per_req > 0 else 1
