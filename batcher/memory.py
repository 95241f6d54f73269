"""KV-cache memory facts: Δ per token and Θ of an instance or a pool (SPEC "KV memory").

Static execution (the papers) keeps every row until the longest ends: MEM(B) = β·(L(B)+G(B))·Δ.
Elastic execution drops finished rows, so a batch needs its peak max_k k·(L(B)+g_(k))·Δ
(``batcher.elastic``). Whether anything fits Θ is one object's question, ``batcher.kv_judge``:
``KVMemory.judge`` hands it out in tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from batcher.kv_judge import KVJudge

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
        """A pool's memory (InstanceInfo-like items): the fewest KV tokens any instance holds, at
        the largest Δ, because a batch must fit whichever instance takes it. In tokens, so an
        upstream instance (whose Δ may be a unit: ``workers.upstream_start``) mixes with built-in ones."""
        items = list(instances)
        delta = max(i.delta_bytes for i in items)
        tokens = min(i.theta_bytes // i.delta_bytes if i.delta_bytes > 0 else i.theta_bytes for i in items)
        return cls(delta_bytes=delta, theta_bytes=tokens * delta)

    @property
    def theta_tokens(self) -> int:
        """Θ in tokens: t·Δ ≤ Θ ⇔ t ≤ ⌊Θ/Δ⌋ for whole token counts, so the budget is exact."""
        return self.theta_bytes // self.delta_bytes if self.delta_bytes > 0 else 1 << 62

    def judge(self, page_tokens: int = 1, max_rows: int = 1 << 30, marginal_cost: float = 0.0) -> KVJudge:
        """The one KV judge over this Θ (``batcher.kv_judge``): every "does it fit" asks it."""
        return KVJudge(self.theta_tokens, page_tokens, max_rows, marginal_cost)

    def mem(self, size: int, input_len: int, gen_len: int) -> int:
        """MEM(B) in bytes for a batch of ``size`` with L(B)=input_len and G(B)=gen_len."""
        return int(size) * (int(input_len) + int(gen_len)) * self.delta_bytes

    def max_fixed_batch_size(self, max_input: int, max_gen: int) -> int:
        """The largest β that fits even when every member has the longest input and max_tokens.

        This is what a static server without length prediction must choose (VS default).
        """
        per_req = (max_input + max_gen) * self.delta_bytes
        return max(1, self.theta_bytes // per_req) if per_req > 0 else 1
