"""KV-cache memory model: Δ per token, Θ, and the one rule every policy uses to decide whether a
batch fits (SPEC "KV memory").

Static execution (the papers) keeps every row until the longest ends: MEM(B) = β·(L(B)+G(B))·Δ.
Elastic execution drops finished rows, so a batch needs its peak max_k k·(L(B)+g_(k))·Δ
(``batcher.elastic``). Planning lengths are ``ProfiledRequest.planned_tokens`` (the upper
quantile when the predictor gives one); the caller passes them in.

``KVPlan`` is that rule in incremental form: policies grow a batch one request at a time and ask
"does it still fit with p?" thousands of times per dispatch, so the test answers from O(1)
bounds whenever they decide it and falls back to the exact peak (O(β)) only in between.
``grow_bounds`` states those bounds once over NumPy columns (the WMA policy tests every open batch
at once) and ``KVPlan.fits_with`` writes them out for scalars (it runs ~10⁶ times per
simulation); tests check both against ``batcher.elastic.batch_kv_tokens`` by brute force.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batcher.elastic import batch_kv_tokens, peak_and_rank

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

    def batch_fits(self, input_len: int, gen_lens: Sequence[int], elastic: bool) -> bool:
        """The planning rule: a batch with L(B)=input_len and these planned lengths fits Θ."""
        return batch_kv_tokens(input_len, gen_lens, elastic) <= self.theta_tokens

    def plan(self, elastic: bool) -> KVPlan:
        """An empty incremental batch under this Θ (see ``KVPlan``)."""
        return KVPlan(self.theta_tokens, elastic)

    def mem(self, size: int, input_len: int, gen_len: int) -> int:
        """MEM(B) in bytes for a batch of ``size`` with L(B)=input_len and G(B)=gen_len."""
        return int(size) * (int(input_len) + int(gen_len)) * self.delta_bytes

    def fits(self, size: int, input_len: int, gen_len: int) -> bool:
        """β·(L+G) tokens within Θ in tokens: the gateway's admission, the worker's profiling grid
        and the static rule all ask this one question."""
        return int(size) * (int(input_len) + int(gen_len)) <= self.theta_tokens

    def tokens_fit(self, tokens: int) -> bool:
        """Whether ``tokens`` of KV fit Θ (the padded decode loop's next-step check)."""
        return int(tokens) <= self.theta_tokens

    def max_fixed_batch_size(self, max_input: int, max_gen: int) -> int:
        """The largest β that fits even when every member has the longest input and max_tokens.

        This is what a static server without length prediction must choose (VS default).
        """
        per_req = (max_input + max_gen) * self.delta_bytes
        return max(1, self.theta_bytes // per_req) if per_req > 0 else 1


def grow_bounds(budget: int, elastic: bool, size: Any, L_B: Any, G_B: Any, g_min: Any, peak: Any, k_peak: Any,
                L: Any, g: Any, mx: Callable[[Any, Any], Any] = max,
                mn: Callable[[Any, Any], Any] = min) -> tuple[Any, Any]:
    """(surely fits, may fit) for adding a request (L, g) to a batch (scalars, or NumPy columns
    with ``mx=np.maximum, mn=np.minimum``).

    The batch is described by β (``size``), L(B), G(B) = its largest planned length, ``g_min``
    its smallest, ``peak`` = its KV peak at L(B) and ``k_peak`` the rank k where that peak is
    reached. With L' = max(L(B), L):

    * static: β'·(L'+G') is exact, both answers are equal;
    * elastic, upper bounds (fits if one holds): the static MEM; and, since every old term
      k·(L'+g_k) ≤ peak + β·(L'−L(B)) and a term pushed one rank down grows by at most L'+g,
      max(peak + β·(L'−L(B)) + [g > g_min]·(L'+g), (β+1)·(L'+g));
    * elastic, lower bound (cannot fit if it fails): the old peak's term at L', and the last
      rank's term (β+1)·(L' + min(g, g_min)).
    """
    Lp = mx(L_B, L)
    static = (size + 1) * (Lp + mx(G_B, g)) <= budget
    if not elastic:
        return static, static
    grown = peak + size * (Lp - L_B)
    upper = mx(grown + (g > g_min) * (Lp + g), (size + 1) * (Lp + g))
    lower = mx(peak + k_peak * (Lp - L_B), (size + 1) * (Lp + mn(g, g_min)))
    return static | (upper <= budget), lower <= budget


class KVPlan:
    """A batch being assembled, kept in the form the memory rule needs to grow it exactly.

    Holds L(B), the planned lengths sorted, the peak KV tokens and where it is reached, so
    ``fits_with`` is O(1) when the bounds decide and O(β) otherwise. Empty plans accept anything
    (a request that cannot fit alone is the gateway's and the worker's to refuse).
    """

    __slots__ = ("budget", "elastic", "L", "lens", "peak", "k_peak")

    def __init__(self, budget: int, elastic: bool) -> None:
        self.budget = int(budget)
        self.elastic = elastic
        self.L = 0
        self.lens: list[int] = []   # planned lengths, ascending
        self.peak = 0
        self.k_peak = 0

    @property
    def size(self) -> int:
        return len(self.lens)

    def _exact(self, L: int, g: int) -> tuple[int, int]:
        """(KV tokens, rank of the peak) of this batch plus (L, g): the definition."""
        Lp = max(self.L, L)
        lens = self.lens
        if not self.elastic:   # β'·(L' + G'), i.e. static_kv_tokens without building the list
            n1 = len(lens) + 1
            return n1 * (Lp + (lens[-1] if lens and lens[-1] > g else g)), n1
        if lens and g <= lens[0] and Lp == self.L:   # g takes the last rank, the others keep theirs
            last = (len(lens) + 1) * (Lp + g)
            return (last, len(lens) + 1) if last > self.peak else (self.peak, self.k_peak)
        return peak_and_rank(Lp, [*lens, g])

    def fits_with(self, L: int, g: int) -> bool:
        """Would the batch plus a request of L(p)=L, planned length g still fit Θ?"""
        lens = self.lens
        if not lens:
            return True
        if not self.elastic:   # the static rule is its own bound: answer in O(1)
            return (len(lens) + 1) * ((self.L if self.L > L else L) + (lens[-1] if lens[-1] > g else g)) <= self.budget
        # grow_bounds' elastic bounds, written out for scalars (this runs ~10⁶ times per simulation)
        n, L_B, g_min, budget = len(lens), self.L, lens[0], self.budget
        Lp = L_B if L_B > L else L
        if (n + 1) * (Lp + (lens[-1] if lens[-1] > g else g)) <= budget:
            return True
        grown = self.peak + n * (Lp - L_B) + ((Lp + g) if g > g_min else 0)
        if grown <= budget and (n + 1) * (Lp + g) <= budget:
            return True
        if self.peak + self.k_peak * (Lp - L_B) > budget or (n + 1) * (Lp + (g if g < g_min else g_min)) > budget:
            return False
        return self._exact(L, g)[0] <= budget

    def add(self, L: int, g: int) -> None:
        """Put the request in (whether it fits is the caller's question, asked before)."""
        self.peak, self.k_peak = self._exact(L, g)
        if L > self.L:
            self.L = L
        insort(self.lens, g)

    def tokens(self) -> int:
        """The batch's KV tokens under this plan's execution mode (its peak when elastic)."""
        return self.peak
