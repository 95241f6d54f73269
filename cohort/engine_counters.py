"""What workers count for the gateway's metrics, in Redis hashes (``gateway.metrics`` exports them):
tokens generated, prefix-cache lookups and hits per instance, each engine's running totals. Written
in the pipelines that publish a worker's steps; read at scrape time."""

from __future__ import annotations

import json

from cohort.bus import GENERATED_TOKENS, PREFIX, STATS

PREFIX_QUERIES = f"{PREFIX}:prefix_cache:queries"  # hash: instance -> prompt tokens looked up in its prefix cache
PREFIX_HITS = f"{PREFIX}:prefix_cache:hits"        # hash: instance -> of them, found cached


def count_prefix_cache(pipe, instance: str, queries: int, hits: int) -> None:
    """Add an instance's new prefix-cache lookups (``cohort_prefix_cache_*_total``, vLLM's counters)."""
    if queries:
        pipe.hincrby(PREFIX_QUERIES, instance, queries)
    if hits:
        pipe.hincrby(PREFIX_HITS, instance, hits)


ENGINE_STATS = f"{PREFIX}:engine"  # hash: instance -> JSON of its engine's running totals


def engine_stats(pipe, instance: str, counters: dict[str, float]) -> None:
    """An instance's engine totals (steps, seconds, rows per step, rows resident, groups waiting)."""
    pipe.hset(ENGINE_STATS, instance, json.dumps(counters))


def count_generated(pipe, tokens: int) -> None:
    """Count tokens as a worker generates them — in the pipeline that publishes them, so a row
    cancelled or failed later still counts what it cost (``cohort_generated_tokens_total``)."""
    if tokens:
        pipe.hincrby(STATS, GENERATED_TOKENS, tokens)
