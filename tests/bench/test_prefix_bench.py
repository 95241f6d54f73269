"""`cohort bench prefix` in the simulator: on a small chat trace every setting answers every
request; the cache finds most of the shared prompt tokens and lowers TTFT; prefix-aware routing
finds at least as many as least-loaded routing."""

from __future__ import annotations

import pytest

from bench.chat_prefix import ChatPrefixConfig
from bench.prefix_bench import prefix_sim, sim_runs


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_the_simulated_grid_on_a_small_chat_trace(chat_files):
    cfg = ChatPrefixConfig(files=chat_files, requests=240, rate=60.0, seed=3, max_tokens=128, n_system_prompts=6)
    out = prefix_sim(cfg, policy="spf", instances=2, kv_tokens=6000, affinity=16)
    runs = out["runs"]
    assert list(runs) == [label for label, *_ in sim_runs("spf", 16)]
    assert all(m["completed"] == 240 and m["failed"] == 0 for m in runs.values())
    off, least, aware = runs["spf no cache"], runs["spf cache, least-loaded"], runs["spf cache, prefix-aware"]
    assert off["prefix_hit_rate"] == 0.0 and runs["cb-fcfs"]["prefix_hit_rate"] == 0.0
    assert least["prefix_hit_rate"] > 0.4 and aware["prefix_hit_rate"] >= least["prefix_hit_rate"]
    assert least["mean_ttft_s"] < off["mean_ttft_s"]
    assert out["config"]["trace"]["page_hit_fraction"] >= aware["prefix_hit_rate"] - 1e-9


@pytest.mark.slow
def test_at_capacity_offers_the_measured_least_loaded_capacity(chat_files):
    cfg = ChatPrefixConfig(files=chat_files, requests=160, rate=60.0, seed=3, max_tokens=128, n_system_prompts=6)
    out = prefix_sim(cfg, policy="spf", instances=2, kv_tokens=6000, affinity=16, at_capacity=0.5)
    probe = out["config"]["capacity_probe"]
    assert probe["setting"] == "spf cache, least-loaded" and probe["offered_rps"] == 60.0
    assert 0 < probe["capacity_rps"] < 60.0   # the probe overloads it
    assert out["config"]["workload"]["rate"] == pytest.approx(0.5 * probe["capacity_rps"])
    least = out["runs"]["spf cache, least-loaded"]
    assert least["completed"] == 160
    # at half its capacity it keeps up with the offered rate, which the probe's overload could not
    assert least["request_throughput"] < probe["capacity_rps"]
    assert least["mean_ttft_s"] < 5.0
