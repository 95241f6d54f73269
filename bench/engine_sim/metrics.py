"""``/metrics`` in Prometheus text with vLLM's metric names, so a client reads the simulator
exactly as it reads vLLM (cohort's upstream worker reads ``vllm:cache_config_info`` for the KV
capacity and block size and ``vllm:num_requests_waiting`` for the server's queue).

Written by hand rather than through ``prometheus_client``: a few counters, gauges and three
histograms, observed on every token in the fixed-delay engine, where a registry's locks and label
lookups would be most of the per-token cost. Latencies are in *model* seconds (wall seconds ×
``--speedup``): the numbers the modelled engine would show; ``engine_sim_speedup`` says the factor.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

# vLLM's bucket edges (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Cumulative-on-render bucket counts, a sum and a count."""

    __slots__ = ("edges", "counts", "total", "n")

    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.edges, v)] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for edge, c in zip(self.edges, self.counts, strict=False):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{edge}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


class SimMetrics:
    """The engine's counters; the live gauges (running, waiting, KV usage, prefix-cache totals,
    preemptions) are read from the engine when the page is rendered."""

    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int, speedup: float,
                 gauges: Callable[[], dict[str, float]]) -> None:
        self.model_name = model_name
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.speedup = speedup
        self.gauges = gauges
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        self.aborted = 0
        self.rejected = 0   # 429
        self.errors = 0     # injected 500s

    def request_done(self, prompt_tokens: int, completion_tokens: int, e2e_s: float) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        self.finished += 1
        self.e2e.observe(e2e_s)

    def render(self) -> str:
        lb = f'engine="0",model_name="{self.model_name}"'
        g = self.gauges()
        lines = [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",'
            f'engine="0",num_gpu_blocks="{self.num_gpu_blocks}",num_gpu_blocks_override="None"}} 1.0',
        ]

        def one(name: str, kind: str, value: float) -> None:
            lines.extend((f"# TYPE {name} {kind}", f"{name}{{{lb}}} {float(value)}"))

        one("vllm:num_requests_running", "gauge", g.get("running", 0))
        one("vllm:num_requests_waiting", "gauge", g.get("waiting", 0))
        one("vllm:kv_cache_usage_perc", "gauge", g.get("kv_usage", 0.0))
        one("vllm:prefix_cache_queries_total", "counter", g.get("prefix_queries", 0))
        one("vllm:prefix_cache_hits_total", "counter", g.get("prefix_hits", 0))
        one("vllm:num_preemptions_total", "counter", g.get("preemptions", 0))
        one("vllm:prompt_tokens_total", "counter", self.prompt_tokens)
        one("vllm:generation_tokens_total", "counter", self.generation_tokens)
        lines.extend(("# TYPE vllm:request_success_total counter",
                      f'vllm:request_success_total{{{lb},finished_reason="length"}} {float(self.finished)}'))
        for name, h in (("vllm:time_to_first_token_seconds", self.ttft),
                        ("vllm:inter_token_latency_seconds", self.itl),
                        ("vllm:e2e_request_latency_seconds", self.e2e)):
            lines.append(f"# TYPE {name} histogram")
            lines.extend(h.lines(name, lb))
        one("engine_sim_speedup", "gauge", self.speedup)
        one("engine_sim_requests_aborted_total", "counter", self.aborted)
        one("engine_sim_requests_rejected_total", "counter", self.rejected)
        one("engine_sim_requests_errored_total", "counter", self.errors)
        # steps run, and those that started over 20 ms (wall) late: the box did not keep the model clock
        one("engine_sim_steps_total", "counter", g.get("steps", 0))
        one("engine_sim_late_steps_total", "counter", g.get("lag_steps", 0))
        return "\n".join(lines) + "\n"
