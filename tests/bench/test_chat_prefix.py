"""The chat workload with shared prefixes (bench.chat_prefix) and the page-key rule
(batcher.prefix_pages): seeded determinism, turns that extend each other token for token, the
gateway's chat rendering, arrivals, the hashes' chaining and the prefix statistics."""

from __future__ import annotations

import numpy as np
import pytest

from batcher.memory import KVMemory
from batcher.prefix_pages import page_hashes, page_salt, shared_prefix_pages
from bench.chat_prefix import ChatPrefixConfig, ChatPrefixWorkload, make_chat_prefix_workload, prefix_stats
from bench.simulator import simulate
from bench.workload import Workload
from cohort.tokenizer import build_prompt, builtin_chat_prompt, prompt_token_ids
from tests.bench.helpers import StepTime

TM = StepTime()
N = 150


@pytest.fixture(scope="module")
def wl(chat_files) -> ChatPrefixWorkload:
    return make_chat_prefix_workload(ChatPrefixConfig(files=chat_files, requests=N, rate=2.0, seed=7), TM)


# --- page hashes --------------------------------------------------------------------------------

def test_only_full_pages_get_a_hash_and_the_hash_is_stable():
    assert page_hashes(range(15)) == []
    assert len(page_hashes(range(47))) == 2 and len(page_hashes(range(48))) == 3
    assert len(page_hashes(range(10), page_tokens=3)) == 3
    # BLAKE2b of fixed bytes: the same in every process and on every machine (no hash() seed)
    assert page_hashes(list(range(16)), salt="m") == [18239553001140002711]
    with pytest.raises(ValueError):
        page_hashes([1, 2], page_tokens=0)


def test_chaining_same_prefix_same_pages_one_token_changes_the_rest():
    a = list(range(1000, 1100))   # 6 full pages of 16
    b = a[:64] + [7] * 36
    ha, hb = page_hashes(a), page_hashes(b)
    assert ha[:4] == hb[:4] and all(x != y for x, y in zip(ha[4:], hb[4:], strict=True))
    assert shared_prefix_pages(ha, hb) == 4
    c = list(a)
    c[37] = 1                     # page 2
    hc = page_hashes(c)
    assert hc[:2] == ha[:2] and all(x != y for x, y in zip(hc[2:], ha[2:], strict=True))
    assert shared_prefix_pages(ha, hc) == 2
    # a page equal in content but after a different prefix is a different page
    assert page_hashes([1] * 16 + [5] * 16)[1] != page_hashes([2] * 16 + [5] * 16)[1]
    assert shared_prefix_pages(ha, ha[:3]) == 3 and shared_prefix_pages([], ha) == 0


def test_salt_separates_models_and_adapters():
    ids = list(range(64))
    base = page_hashes(ids, salt=page_salt("llama"))
    for other in (page_salt("qwen"), page_salt("llama", "lora-1"), ""):
        assert shared_prefix_pages(base, page_hashes(ids, salt=other)) == 0
    assert page_hashes(ids, salt=page_salt("llama")) == base


# --- the workload -------------------------------------------------------------------------------

@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_same_seed_same_trace_other_seed_differs(chat_files):
    def make(seed: int) -> ChatPrefixWorkload:
        return make_chat_prefix_workload(ChatPrefixConfig(files=chat_files, requests=60, rate=2.0, seed=seed), TM)

    a, b, c = make(7), make(7), make(8)
    for f in ("arrival", "input_tokens", "true_tokens", "predicted_tokens", "slo_s", "conversation", "turn",
              "system_id", "shared_tokens"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert a.prompt_ids == b.prompt_ids and a.hashes == b.hashes and a.system_texts == b.system_texts
    assert a.prompt_ids != c.prompt_ids and not np.array_equal(a.arrival, c.arrival)


@pytest.mark.slow  # 1.06 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_turns_extend_the_previous_turn_token_for_token(wl):
    convs = 0
    for c in np.unique(wl.conversation):
        idx = np.flatnonzero(wl.conversation == c)
        assert list(wl.turn[idx]) == list(range(len(idx)))           # turns in order, none missing
        assert len(set(wl.system_id[idx])) == 1
        for prev, cur in zip(idx[:-1], idx[1:], strict=True):
            p = wl.prompt_ids[prev]
            assert wl.prompt_ids[cur][:len(p)] == p and len(wl.prompt_ids[cur]) > len(p)
            assert wl.shared_tokens[cur] >= len(p)
            assert wl.arrival[cur] - wl.arrival[prev] >= wl.config.think_min_s
            convs += len(idx) > 1
    assert convs > 10 and wl.turn.max() >= 3


def test_prompts_are_the_gateways_chat_rendering_and_the_trace_is_a_workload(wl):
    assert isinstance(wl, Workload) and len(wl) == N
    assert (np.diff(wl.arrival) > 0).all() and wl.arrival[0] > 0
    mean_gap = wl.arrival[-1] / N
    assert mean_gap == pytest.approx(1 / 2.0, rel=0.2)
    for i in (0, 1, N // 2, N - 1):
        rec = wl.rows.records[wl.row[i]]
        msgs = wl.messages[i]
        convo = "\n".join(f"{m['role']}: {m['content']}" for m in msgs[1:])
        text = builtin_chat_prompt(msgs[0]["content"], convo)     # what /v1/chat/completions runs
        assert build_prompt(rec.instruction, rec.input) == text     # what the live replay sends
        assert prompt_token_ids([text])[0] == wl.prompt_ids[i]
        assert wl.input_tokens[i] == len(wl.prompt_ids[i])
        assert wl.hashes[i] == page_hashes(wl.prompt_ids[i], 16, page_salt(wl.model))
        assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * int(wl.turn[i]) + ["user"]
    assert (wl.true_tokens >= 1).all() and (wl.true_tokens <= wl.config.max_tokens).all()
    np.testing.assert_array_equal(wl.predicted_tokens, wl.true_tokens)   # oracle
    reqs = wl.requests(oracle=True)
    assert all(len(r.prompt_ids) == r.input_tokens for r in reqs)
    assert reqs[3].emulated_tokens == reqs[3].true_tokens == wl.true_tokens[3]
    assert wl.config.to_dict()["workload"] == "chat_prefix"
    sim = simulate(reqs[:60], "vs", KVMemory(delta_bytes=1, theta_bytes=200_000), TM, instances=2,
                   max_input_tokens=int(wl.input_tokens.max()), max_tokens_limit=wl.config.max_tokens)
    assert sim.metrics["completed"] == 60


def test_prefix_stats_well_above_the_floor_on_defaults(wl):
    s = prefix_stats(wl)
    assert s["page_hit_fraction"] >= 0.6
    assert s["page_hit_fraction"] <= s["shared_token_fraction"] <= 1.0
    assert s["requests"] == N and s["conversations"] == len(np.unique(wl.conversation))
    # per request: tokens in already-seen pages never exceed the exact shared prefix
    seen: set[int] = set()
    for hs, shared in zip(wl.hashes, wl.shared_tokens, strict=True):
        assert sum(h in seen for h in hs) * 16 <= shared
        seen.update(hs)
