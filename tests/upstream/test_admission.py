"""Upstream instances without a server: what is read from a server's answers (metrics, refusals,
stream chunks), the pool rule in tokens, and the loop's admission, order, hand-back and cancel
against a scripted server (the real servers run in tests/e2e/test_upstream.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from batcher.memory import KVMemory
from cohort.tokenizer import load_tokenizer
from cohort.types import Batch, InstanceInfo, ProfiledRequest
from upstream.admission import GROUP_SPAN, PRIORITY_SPAN, UpstreamLoop
from upstream.api import (
    Capabilities,
    UpstreamServer,
    block_tokens_from_metrics,
    gauge,
    kv_tokens_from_metrics,
    refused_fields,
)
from upstream.chunks import Chunk, UpstreamDown, parse_chunk
from upstream.rows import AdmissionGroup, PlanReach, Row
from workers.continuous_loop import GroupHandle
from workers.row_text import TextStage

VLLM_METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="320",num_gpu_blocks_override="None"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
"""


def test_what_a_server_publishes_and_refuses():
    assert kv_tokens_from_metrics(VLLM_METRICS) == (320 - 1) * 16  # less the null block
    assert kv_tokens_from_metrics(VLLM_METRICS.replace('override="None"', 'override="40"')) == (40 - 1) * 16
    assert kv_tokens_from_metrics("# nothing here\n") is None
    assert block_tokens_from_metrics(VLLM_METRICS) == 16
    assert gauge(VLLM_METRICS, "vllm:num_requests_waiting") == 3.0
    assert gauge(VLLM_METRICS, "vllm:absent") is None
    assert refused_fields('{"detail":"Unexpected fields in the request: {\'ignore_eos\', \'priority\'}"}') == {
        "ignore_eos", "priority"}


def test_a_chunk_with_token_ids_and_logprobs():
    ch = parse_chunk({"choices": [{"index": 0, "text": " hi", "token_ids": [7, 8], "finish_reason": None,
                                   "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -1.0],
                                                "top_logprobs": [{"token_id:7": -0.5}, {"token_id:8": -1.0}]}}]})
    assert (ch.text, ch.ids, ch.finish) == (" hi", [7, 8], None)
    assert ch.logprobs == [[-0.5, [[7, -0.5]]], [-1.0, [[8, -1.0]]]]
    usage = parse_chunk({"choices": [], "usage": {"completion_tokens": 9}})
    assert usage.completion_tokens == 9 and usage.ids is None


def test_a_pool_mixing_units_plans_with_the_fewest_tokens():
    builtin = InstanceInfo("a", "p", "m", theta_bytes=2048 * 1000, delta_bytes=2048)
    upstream = InstanceInfo("b", "p", "m", theta_bytes=500, delta_bytes=1)
    assert KVMemory.for_pool([builtin, upstream]).theta_tokens == 500
    assert KVMemory.for_pool([builtin]).theta_tokens == 1000


class ScriptedServer:
    """Streams ``max_tokens`` one-token chunks per row; fails every stream after ``fail_after``
    tokens when set. Records each row's request body."""

    base_url = "scripted"

    def __init__(self, fail_after: int | None = None, delay_s: float = 0.002, per_chunk: int = 1) -> None:
        self.caps = Capabilities(token_ids=True)
        self.fail_after, self.delay_s, self.per_chunk = fail_after, delay_s, per_chunk
        self.chunk_tokens = per_chunk
        self.bodies: list[dict] = []
        self.closed: list[str] = []

    def body(self, req, prompt, max_tokens, priority):
        return {"id": req.id, "prompt": prompt, "max_tokens": max_tokens, "priority": priority}

    async def stream(self, body):
        self.bodies.append(body)
        try:
            n, k = body["max_tokens"], self.per_chunk
            for i in range(0, n, k):  # vLLM's stream_interval: k tokens a chunk, the last chunk what is left
                await asyncio.sleep(self.delay_s)
                if self.fail_after is not None and i >= self.fail_after:
                    raise UpstreamDown("connection reset")
                ids = list(range(2000 + i, 2000 + min(n, i + k)))
                yield Chunk(text="".join(f" w{t - 2000}" for t in ids), ids=ids, finish="length" if i + k >= n else None)
        finally:
            self.closed.append(body["id"])

    async def healthy(self):
        return False

    async def metrics(self):
        return None


def _req(rid: str, n: int, **kw) -> ProfiledRequest:
    return ProfiledRequest(id=rid, prompt="hello there", input_tokens=3, predicted_tokens=n, max_tokens=n,
                           arrival=time.time(), **kw)


def _run(loop: UpstreamLoop, batches: list[Batch], timeout_s: float = 20.0) -> dict[str, list]:
    """Submit the batches, collect every update until each group is done: {batch id: updates}."""
    for b in batches:
        loop.submit(b, [[101, 7592, 2045] for _ in b.requests])
    got: dict[str, list] = {b.id: [] for b in batches}
    done: set[str] = set()
    deadline = time.time() + timeout_s
    while len(done) < len(batches) and time.time() < deadline:
        for handle, upd in loop.updates(0.2):
            got[handle.batch_id].append(upd)
            if upd.done:
                done.add(handle.batch_id)
    assert done == set(got), f"groups not done: {set(got) - done}"
    return got


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_groups_join_in_order_under_the_servers_kv_and_answer_whole(tok):
    server = ScriptedServer()
    # room for one group's rows at a time: the second waits until the first has ended
    loop = UpstreamLoop(server, tok, capacity_tokens=80, page_tokens=16, poll_s=60)
    a = Batch("ba", [_req("a1", 20), _req("a2", 12)], time.time())
    b = Batch("bb", [_req("b1", 5, priority=2)], time.time())
    got = _run(loop, [a, b])
    finished = {res.request.id: res for ups in got.values() for u in ups for res in u.out.finished}
    assert {k: v.tokens for k, v in finished.items()} == {"a1": 20, "a2": 12, "b1": 5}
    assert finished["b1"].text == " w0 w1 w2 w3 w4"  # the server's text, not a re-decoding
    assert [body["id"] for body in server.bodies] == ["a2", "a1", "b1"]  # shortest predicted first in a group
    # b joined only after a's rows had ended (its KV would not fit beside them)
    assert all(any(u.admitted for u in ups) for ups in got.values())
    # client priority, then admission order, then the rank in the group
    assert [b["priority"] for b in server.bodies] == [GROUP_SPAN, GROUP_SPAN + 1, 2 * PRIORITY_SPAN + 2 * GROUP_SPAN]
    assert server.bodies[0]["prompt"] == [101, 7592, 2045]  # token ids: tokenized once, by cohort
    loop.stop()


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_a_failing_server_hands_rows_back_from_their_streamed_tokens(tok):
    server = ScriptedServer(fail_after=3)
    loop = UpstreamLoop(server, tok, capacity_tokens=10_000, poll_s=60)
    got = _run(loop, [Batch("bf", [_req("f1", 10)], time.time())])
    outs = [u.out for u in got["bf"]]
    evicted = [r for o in outs for r in o.evicted]
    assert [r.id for r in evicted] == ["f1"]
    assert evicted[0].generated_ids == [2000, 2001, 2002] and evicted[0].max_tokens == 7
    assert evicted[0].prompt_ids == [101, 7592, 2045]
    streamed = [i for o in outs for _req_, _text, _n, ids in o.deltas for i in ids]
    assert streamed == [2000, 2001, 2002]  # the stream holds every token the continuation carries
    assert loop.down
    # while down, a new group goes straight back, whole
    again = _run(loop, [Batch("bg", [_req("g1", 4)], time.time())])
    assert [r.id for u in again["bg"] for r in u.out.evicted] == ["g1"]
    assert len(server.bodies) == 1
    loop.stop()


def test_a_cancelled_row_closes_its_stream(tok):
    server = ScriptedServer(delay_s=0.02)
    loop = UpstreamLoop(server, tok, capacity_tokens=10_000, poll_s=60)
    loop.submit(Batch("bc", [_req("c1", 500)], time.time()), [[101, 7592, 2045]])
    deadline = time.time() + 10
    while not server.bodies and time.time() < deadline:
        time.sleep(0.05)
    loop.cancel(["c1"])
    ups = []
    while time.time() < deadline and not any(u.done for u in ups):
        ups += [u for _h, u in loop.updates(0.2)]
    assert any(u.done for u in ups) and server.closed == ["c1"]
    assert not [res for u in ups for res in u.out.finished]
    loop.stop()


@pytest.mark.slow  # 0.32 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_rows_first_token_and_its_end_go_out_at_once_the_rest_coalesce(tok):
    server = ScriptedServer(delay_s=0.05)
    loop = UpstreamLoop(server, tok, capacity_tokens=10_000, poll_s=60, flush_s=5.0)  # coalesce for 5 s
    t0 = time.time()
    loop.submit(Batch("bt", [_req("t1", 6)], t0), [[101, 7592, 2045]])
    first = None
    ups = []
    while time.time() < t0 + 20 and not any(u.done for u in ups):
        for _h, u in loop.updates(0.05):
            ups.append(u)
            if first is None and u.out.deltas:
                first = time.time() - t0
    done_at = time.time() - t0
    assert first is not None and first < 2.0  # not held for flush_s: the client's TTFT waits on it
    assert done_at < 2.0  # the row's end went out at once too, its middle tokens with it
    assert [len(ids) for u in ups for _r, _t, _n, ids in u.out.deltas][0] == 1  # the first token alone
    loop.stop()


def test_a_server_sending_several_tokens_a_chunk_gives_every_token_in_order(tok):
    server = ScriptedServer(per_chunk=4)
    loop = UpstreamLoop(server, tok, capacity_tokens=10_000, poll_s=60)
    got = _run(loop, [Batch("bc", [_req("c1", 10)], time.time())])
    ids = [t for u in got["bc"] for _r, _t, _n, delta in u.out.deltas for t in delta]
    assert ids == list(range(2000, 2010))
    loop.stop()


def test_a_token_ids_server_is_asked_for_chunks_of_the_stream_interval():
    req = _req("s1", 8)
    chunked = UpstreamServer("http://127.0.0.1:9/v1", stream_interval=4)
    chunked.caps = Capabilities(token_ids=True)
    assert chunked.body(req, [1, 2, 3], 8, None)["stream_interval"] == 4
    chunked.caps = Capabilities(token_ids=False)  # one token a chunk is what its text-only path reads
    assert "stream_interval" not in chunked.body(req, "hi", 8, None)
    assert chunked.chunk_tokens == 1
    chunked.caps = Capabilities(token_ids=True, refused={"stream_interval"})
    assert chunked.chunk_tokens == 1  # a server that refuses the field streams a token a chunk
    chunked.caps = Capabilities(token_ids=True)
    assert chunked.chunk_tokens == 4
    per_token = UpstreamServer("http://127.0.0.1:9/v1", stream_interval=1)
    per_token.caps = Capabilities(token_ids=True)
    assert "stream_interval" not in per_token.body(req, [1, 2, 3], 8, None)


def _four_running_and_one_joining(server, tok, **row_kw) -> tuple[UpstreamLoop, AdmissionGroup]:
    """Four rows at 100 and 108 of their 116 tokens on a server of 33 pages of 16, and a fifth
    row's group about to join: planned from what arrived, it fits."""
    loop = UpstreamLoop(server, tok, capacity_tokens=33 * 16, page_tokens=16, poll_s=60)
    running = Batch("ba", [_req(f"a{i}", 116) for i in range(4)], time.time())
    joining = Batch("bb", [_req("b1", 116)], time.time())
    g = AdmissionGroup(running, GroupHandle(loop, "ba", TextStage(tok)))
    for i, req in enumerate(running.requests):  # one row behind the others by a chunk
        loop._rows[req.id] = Row(req, [1, 2, 3, 4], g, new_ids=[0] * (100 if i == 0 else 108), **row_kw)
    nxt = AdmissionGroup(joining, GroupHandle(loop, "bb", TextStage(tok)))
    nxt.rows = [Row(joining.requests[0], [1, 2, 3, 4], nxt)]
    return loop, nxt


def test_admission_counts_the_tokens_a_chunked_stream_has_not_sent_yet(tok):
    # the server sends 8 tokens a chunk, so it may hold up to 7 more of each running row than
    # arrived, and the plan must count them
    server = ScriptedServer(per_chunk=8)
    loop, nxt = _four_running_and_one_joining(server, tok)
    joining = nxt.batch
    assert not loop._fits(nxt)
    server.chunk_tokens = 1  # per-token streams: what arrived is what the server holds
    assert loop._fits(nxt)
    assert Row(joining.requests[0], [1, 2, 3, 4], nxt, new_ids=[0] * 114).held_context(7) == 4 + 114 + 1
    assert Row(joining.requests[0], [1, 2, 3, 4], nxt).held_context(7) == 4  # its first token comes at once
    loop.stop()


def test_admission_counts_what_released_rows_streamed_since_their_gateway_last_reported(tok):
    # the same four rows, streamed by their gateways, which report every 0.25 s: at 40 tokens a
    # second a row holds about 10 more than its last report said 0.25 s later, and the plan counts them
    from upstream.rows import ReportPace
    now = time.monotonic()
    loop, nxt = _four_running_and_one_joining(ScriptedServer(per_chunk=1), tok, released=True, heard_at=now - 0.25)
    joining = nxt.batch
    assert loop._fits(nxt)  # no pace measured yet: what was reported is what the plan counts
    pace = ReportPace()
    pace.add(10, 0.25)
    pace.add(0, 0.25)  # a report without tokens says nothing of the pace
    assert pace.rate == 40.0
    loop.pace = pace
    assert not loop._fits(nxt)
    row = loop._rows["a0"]
    assert pace.unreported(row, row.heard_at + 0.25) == 10
    assert pace.unreported(Row(joining.requests[0], [1], nxt, heard_at=now - 5), now) == 0  # not released: it arrives at once
    queued = Row(joining.requests[0], [1], nxt, released=True, heard_at=now - 5)
    assert pace.unreported(queued, now) == 0  # released, nothing reported yet: maybe still in the engine's queue
    loop.stop()


def test_an_engine_that_queues_may_be_planned_past_its_kv_by_the_overcommit():
    from batcher.kv_judge import KVJudge
    rows = ([60, 60], [40, 40])  # planned peak 200 tokens + half a page per row = 216
    assert not KVJudge(200, 16).running_set_fits(*rows)
    assert KVJudge(200, 16, overcommit=0.1).running_set_fits(*rows)
    assert not KVJudge(200, 16, overcommit=0.05).running_set_fits(*rows)


def test_an_overcommitted_loop_sends_the_next_group_beside_the_running_one(tok):
    server = ScriptedServer(delay_s=0.02)
    # the first test's KV: without overcommit b waits for a's rows; with 1.0 it joins beside them
    loop = UpstreamLoop(server, tok, capacity_tokens=80, page_tokens=16, poll_s=60, overcommit=1.0)
    loop.reach = PlanReach(planned=300.0, generated=100.0)  # plans have been 3x what rows generated: capped at 1.0
    a = Batch("ba", [_req("a1", 20), _req("a2", 12)], time.time())
    b = Batch("bb", [_req("b1", 5)], time.time())
    loop.submit(a, [[101, 7592, 2045]] * 2)
    loop.submit(b, [[101, 7592, 2045]])
    deadline = time.time() + 5
    while len(server.bodies) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert len(server.bodies) == 3 and len(server.closed) == 0  # all three stream at once
    _run(loop, [])
    loop.stop()


@pytest.mark.slow  # 0.87 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_full_instance_waits_before_it_takes_the_next_group(tok):
    server = ScriptedServer(delay_s=0.02)
    loop = UpstreamLoop(server, tok, capacity_tokens=80, page_tokens=16, poll_s=60, take_wait_s=10.0)
    t0 = time.time()
    loop.submit(Batch("ba", [_req("a1", 40)], t0), [[101, 7592, 2045]])
    took_a = time.time() - t0
    loop.submit(Batch("bb", [_req("b1", 40)], t0), [[101, 7592, 2045]])  # waits until a1 has ended
    took_b = time.time() - t0
    assert took_a < 0.3  # room: a joined at once, the caller takes the next group
    assert "a1" in server.closed and 0.5 < took_b < 5.0  # no room beside a1 until it ended (40 tokens x 20 ms)
    loop.stop()


def test_the_overcommit_follows_how_far_plans_reached_past_the_rows(tok):
    loop = UpstreamLoop(ScriptedServer(), tok, capacity_tokens=80, page_tokens=16, poll_s=60, overcommit=0.5)
    exact = [_req(f"e{i}", 10) for i in range(3)]  # planned = max_tokens = what each generates
    _run(loop, [Batch("be", exact, time.time())])
    assert loop.reach.overcommit(0.5) == 0.0  # exact plans: never past the engine's KV
    # planned 40 (its bound and max_tokens), streams 4
    far = [replace(_req(f"f{i}", 4, predicted_upper=40), max_tokens=40, emulated_tokens=4) for i in range(30)]
    _run(loop, [Batch("bf", far, time.time())])
    assert loop.reach.overcommit(0.5) == 0.5  # plans ran far past the rows: up to the cap
    loop.stop()


def test_a_group_sharing_a_running_rows_prompt_is_planned_without_the_shared_pages(tok):
    """A server of 40 pages of 16 runs one row of a 400-token prompt (100 tokens planned, 10 in).
    A joining row of the same prompt plus 16 tokens (100 planned) needs 416 + 100 of its own beside
    the running row's 410 + 90, past 640; the server holds the 400 tokens they share once (charged to
    the joining row, which runs longer), so it fits. A row of another prompt of that length does not."""
    loop = UpstreamLoop(ScriptedServer(), tok, capacity_tokens=40 * 16, page_tokens=16, poll_s=60)
    system = list(range(1000, 1400))
    running = Batch("ba", [_req("a1", 100)], time.time())
    g = AdmissionGroup(running, GroupHandle(loop, "ba", TextStage(tok)))
    loop._rows["a1"] = Row(running.requests[0], system, g, new_ids=[0] * 10)

    def joining(ids: list[int]) -> AdmissionGroup:
        b = Batch("bb", [_req("b1", 100)], time.time())
        nxt = AdmissionGroup(b, GroupHandle(loop, "bb", TextStage(tok)))
        nxt.rows = [Row(b.requests[0], ids, nxt)]
        return nxt

    assert loop._fits(joining(system + list(range(16))))
    assert not loop._fits(joining(list(range(5000, 5416))))
    loop.stop()
