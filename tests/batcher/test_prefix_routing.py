"""Prefix-aware routing: the rule (``PrefixRouter``), the instances' summaries (``PagePool.summary``
and its wire form), and the live batcher routing batches on fakeredis."""

from __future__ import annotations

import json

import fakeredis
import pytest

from batcher.page_pool import PagePool
from batcher.prefix_groups import shared_by_longer_lived
from batcher.prefix_pages import decode_summary, encode_summary, page_hashes, page_salt
from batcher.prefix_routing import PrefixRouter
from batcher.service import BatcherService
from cohort import bus
from cohort.release_bus import group_set
from cohort.settings import Settings
from cohort.types import Batch, InstanceInfo, ProfiledRequest
from predictor.estimator import AnalyticBatchTime

KEYS = bus.pool_keys("default")
SYSTEM_A = list(range(100, 164))   # 4 full pages
SYSTEM_B = list(range(500, 564))


def req(rid: str, ids: list[int]) -> ProfiledRequest:
    return ProfiledRequest(id=rid, prompt="p", input_tokens=len(ids), predicted_tokens=8, max_tokens=16,
                           arrival=0.0, prompt_ids=ids)


def keys(ids: list[int]) -> list[int]:
    return page_hashes(ids, 16, page_salt("m"))


def test_the_instance_with_the_longest_cached_prefix_is_chosen_among_those_with_room():
    router = PrefixRouter()
    router.sync_instances({"w1": 10_000, "w2": 10_000, "w3": 10_000})
    router.report("w2", frozenset(keys(SYSTEM_A)[:2]))      # half of A's pages
    router.report("w3", frozenset(keys(SYSTEM_A)))          # all of them
    batch = Batch(id="b", created=0.0, requests=[req("r", SYSTEM_A + [1, 2, 3])])
    assert router.cached_tokens(batch, "w3", "m") == 64 and router.cached_tokens(batch, "w2", "m") == 32
    assert router.choose(batch, ["w1", "w2", "w3"], "m") == "w3"
    assert router.choose(batch, ["w1", "w2"], "m") == "w2"          # w3 has no room: never chosen
    assert router.choose(batch, ["w1"], "m") is None                 # nothing cached: the pool queue
    other = Batch(id="c", created=0.0, requests=[req("s", SYSTEM_B)])
    assert router.choose(other, ["w1", "w2", "w3"], "m") is None
    # what a policy leaves out of a request's KV plan: the most any instance holds of its prompt
    assert router.best_cached_tokens(req("best-a", SYSTEM_A + [9]), "m") == 64
    assert router.best_cached_tokens(req("best-b", SYSTEM_B), "m") == 0
    again = Batch(id="d", created=0.0, requests=[req("r2", SYSTEM_A)])
    assert router.choose(again, ["w3"], "other-model") is None       # another salt: other keys


def test_what_was_sent_counts_as_cached_within_the_instance_kv():
    router = PrefixRouter()
    router.sync_instances({"up": 64})                                # 4 pages of KV
    router.record("up", Batch(id="b", created=0.0, requests=[req("r", SYSTEM_A)]), "m")
    assert router.choose(Batch(id="c", created=0.0, requests=[req("s", SYSTEM_A)]), ["up"], "m") == "up"
    router.record("up", Batch(id="d", created=0.0, requests=[req("t", SYSTEM_B)]), "m")  # B pushes A out
    assert router.cached_tokens(Batch(id="e", created=0.0, requests=[req("u", SYSTEM_A)]), "up", "m") == 0
    router.sync_instances({})                                        # gone: its view goes too
    assert router.views == {}


def test_a_pool_summary_holds_used_pages_first_then_the_most_recently_released():
    pool = PagePool(8)
    pages = pool.take(4)
    for i, page in enumerate(pages):
        pool.cache(page, 1000 + i)
    pool.give(pages[:3])             # 1000 released first, then 1001, 1002; 1003 still held
    assert pool.summary(8) == [1003, 1002, 1001, 1000]
    assert pool.summary(2) == [1003, 1002]
    assert decode_summary(encode_summary([2**64 - 1, 5])) == {2**64 - 1, 5}
    assert len(encode_summary(range(4096))) < 45_000


@pytest.fixture
def r():
    return fakeredis.FakeRedis(decode_responses=True)


def register(r, name: str) -> None:
    info = InstanceInfo(name=name, pool="default", model="m", theta_bytes=10**6, delta_bytes=1)
    r.hset(bus.INSTANCES, name, json.dumps(info.to_dict()))
    r.set(bus.alive_key(name), "1", ex=60)


def arrive(r, rid: str, ids: list[int]) -> None:
    r.lpush(KEYS.incoming, json.dumps(req(rid, ids).to_dict()))


def service(r, tmp_path, sent: list, **kw) -> BatcherService:
    s = Settings(database_url=f"sqlite:///{tmp_path}/log.db", policy="spf", execution="continuous",
                 continuous={"lookahead": 1, "group_frac": 1.0}, **kw)
    return BatcherService(s, r, AnalyticBatchTime(), send_task=lambda batch, target=None: sent.append((batch, target)))


def two_instances(r, tmp_path, **kw) -> tuple[BatcherService, list]:
    """w1 and w2 in one pool; w2 reports holding SYSTEM_A's pages."""
    register(r, "w1")
    register(r, "w2")
    r.set(bus.prefix_summary_key("w2"), encode_summary(keys(SYSTEM_A)))
    sent: list = []
    return service(r, tmp_path, sent, **kw), sent


def test_the_batcher_routes_to_the_reporting_instance_else_the_least_loaded(r, tmp_path):
    svc, sent = two_instances(r, tmp_path)
    arrive(r, "a1", SYSTEM_A + [7] * 20)
    svc.step(now=1.0)
    assert [t for _, t in sent] == ["w2"]                 # w2 holds A's pages
    arrive(r, "b1", SYSTEM_B)
    svc.step(now=2.0)
    assert sent[-1][1] == "w1"                            # nobody holds B: the least loaded
    r.set(bus.claim_key(sent[1][0].id), "w1")
    r.set(bus.admitted_key(sent[1][0].id), "1")
    arrive(r, "a2", SYSTEM_A)
    svc.step(now=3.0)
    assert sent[-1][0].requests[0].id == "a2" and sent[-1][1] == "w1"  # w2's one slot is taken: not pinned
    r.set(bus.admitted_key(sent[0][0].id), "1")
    r.set(bus.admitted_key(sent[2][0].id), "1")
    arrive(r, "b2", SYSTEM_B + [9] * 16)
    svc.step(now=4.0)
    assert sent[-1][0].requests[0].id == "b2" and sent[-1][1] == "w1"   # where B went before


def test_a_batch_routed_to_an_instance_that_dies_before_claiming_it_is_requeued(r, tmp_path):
    svc, sent = two_instances(r, tmp_path)
    arrive(r, "a1", SYSTEM_A)
    svc.step(now=1.0)
    (first, target), = sent
    assert target == "w2"
    r.lpush(bus.queue_for_instance("w2"), "a message nobody will take")
    r.zadd(group_set("default", "w2"), {"a group nobody will take": 0})  # an upstream's own set
    r.delete(bus.alive_key("w2"))                         # w2 dies with the batch on its own queue
    svc.step(now=3.0)
    assert not r.exists(bus.queue_for_instance("w2"))     # its queue is gone with it
    assert not r.exists(group_set("default", "w2"))
    assert r.get(bus.claim_key(first.id)) == bus.CANCELLED
    again, where = sent[-1]
    assert again.id != first.id and [q.id for q in again.requests] == ["a1"] and where != "w2"


def test_routing_off_sends_everything_to_the_pool_queue(r, tmp_path):
    svc, sent = two_instances(r, tmp_path, prefix_routing=False)
    arrive(r, "a1", SYSTEM_A)
    svc.step(now=1.0)
    assert [t for _, t in sent] == [None] and svc.placement is None


class _Held:
    """An in-flight batch as placement reads it (``batcher.placement.Placed``)."""

    def __init__(self, batch: Batch, target: str, admitted: bool = True) -> None:
        self.batch, self.target, self.admitted, self.owner = batch, target, admitted, None


def _batch(bid: str, prompt: int, planned: int) -> Batch:
    return Batch(id=bid, requests=[ProfiledRequest(id=f"{bid}-r", prompt="p", input_tokens=prompt,
                                                   predicted_tokens=planned, max_tokens=1024, arrival=0.0)],
                 created=0.0)


def test_a_batch_goes_where_it_fits_beside_what_runs_not_to_the_fewest_batches(r, tmp_path):
    """768 tokens of KV each: w1 runs one long row (400 + 300 planned), w2 two short ones. A batch
    of 100 + 300 does not fit beside w1's row (1,100 tokens when both end): it goes to w2, though
    w2 holds more batches. A short one (30 + 40) fits beside the long row (it ends first). One that
    fits nowhere goes to the pool's queue (None)."""
    from batcher.placement import Placement

    s = Settings(database_url=f"sqlite:///{tmp_path}/log.db", execution="continuous")
    place = Placement(s, r)
    alive = {n: InstanceInfo(name=n, pool="default", model="m", theta_bytes=768, delta_bytes=1) for n in ("w1", "w2")}
    place.sync(alive, [], now=0.0)
    held = [_Held(_batch("long", 400, 300), "w1"), _Held(_batch("s1", 20, 10), "w2"), _Held(_batch("s2", 20, 10), "w2")]
    assert place.with_room(held) == ["w1", "w2"]           # by batches alone, w1 is the less loaded
    assert place.with_room(held, _batch("short", 30, 40)) == ["w1", "w2"]
    mid = _batch("mid", 100, 300)
    assert place.with_room(held, mid) == ["w2"] and place.target(mid, held) == ("w2", False)
    big = _batch("big", 300, 480)
    assert place.with_room(held, big) == [] and place.target(big, held) == (None, False)
    assert place.with_room([], big) == ["w1", "w2"]        # an instance holding nothing takes anything
    waiting = [_Held(_batch("long", 400, 300), "w1"), _Held(_batch("queued", 100, 300), "w2", admitted=False)]
    assert place.with_room(waiting, mid) == []             # a waiting batch holds its room too


def test_a_prefix_holder_has_room_as_far_past_its_kv_as_its_worker_admits(r, tmp_path):
    """768 tokens of KV each, each instance running one row of 400 + 300 planned. A batch of
    100 + 300 plans 1,100 tokens beside it: past either KV, within an upstream's 768 x 1.5
    (``COHORT_UPSTREAM_KV_OVERCOMMIT``, the most its worker admits past the plan). Sharing the
    upstream's prompt, it goes there, to wait for that worker's admission beside its prefix, unless
    a batch already waits there. With a prompt no instance holds, or holds less than half of, it
    waits on the pool's queue (None); with the overcommit at 0, or on a built-in instance (it has
    no queue of its own), the holder has no room."""
    from batcher.placement import Placement

    long_a, other = SYSTEM_A * 6, list(range(3000, 3100))
    def place_on(upstream: bool, overcommit: float) -> Placement:
        s = Settings(database_url=f"sqlite:///{tmp_path}/log.db", execution="continuous",
                     upstream_kv_overcommit=overcommit)
        place = Placement(s, r)
        device = "upstream:http://127.0.0.1:8000" if upstream else "cpu"
        place.sync({n: InstanceInfo(name=n, pool="default", model="m", theta_bytes=768, delta_bytes=1, device=device)
                    for n in ("w1", "w2")}, [], now=0.0)
        return place

    def held(place: Placement) -> list[_Held]:
        first, second = _chat_batch("a", long_a[:384] + [1] * 16, 300), _chat_batch("b", other * 4, 300)
        for b, n in ((first, "w1"), (second, "w2")):
            place.router.record(n, b, "m")
        return [_Held(first, "w1"), _Held(second, "w2")]

    place = place_on(upstream=True, overcommit=0.5)
    running = held(place)
    joining = _chat_batch("a2", long_a[:96] + [2] * 4, 300)       # 100 tokens, 96 of them w1's prompt
    assert place.with_room(running, joining) == []
    assert place.with_room(running, joining, stretch=True) == ["w1", "w2"]
    assert place.target(joining, running) == ("w1", True)
    assert place.target(_chat_batch("c", list(range(5000, 5100)), 300), running) == (None, False)
    # past the plan only as the next batch its worker admits: not behind one already waiting there
    tiny = _chat_batch("q", [3] * 4, 2)
    assert place.target(_chat_batch("a4", long_a[:96] + [2] * 4, 300), [*running, _Held(tiny, "w1")]) == ("w1", True)
    queued = [*running, _Held(tiny, "w1", admitted=False)]
    assert place.target(_chat_batch("a5", long_a[:96] + [2] * 4, 300), queued) == (None, False)
    # one page of 100 tokens held (a task's instruction, not a system prompt): not worth the wait
    assert place.target(_chat_batch("d", long_a[:16] + list(range(6000, 6084)), 300), running) == (None, False)
    for upstream, overcommit in ((True, 0.0), (False, 0.5)):
        place = place_on(upstream, overcommit)
        running = held(place)
        assert place.target(_chat_batch("a3", long_a[:96] + [2] * 4, 300), running) == (None, False)


def test_placement_plans_each_instance_in_its_own_pages(r, tmp_path):
    """Two instances of 900 KV tokens holding the same row (300 + 300 planned); w1's engine pages
    hold 128 tokens (vLLM's CPU build), w2's 16. A batch of 200 + 150 fits beside that row in pages
    of 16 (816 tokens planned: half a page a row, 8 each) and not in pages of 128 (928: 64 each)."""
    from batcher.placement import Placement

    place = Placement(Settings(database_url=f"sqlite:///{tmp_path}/log.db", execution="continuous"), r)
    alive = {n: InstanceInfo(name=n, pool="default", model="m", theta_bytes=900, delta_bytes=1, page_tokens=p)
             for n, p in (("w1", 128), ("w2", 16))}
    place.sync(alive, [], now=0.0)
    held = [_Held(_batch("a", 300, 300), "w1"), _Held(_batch("b", 300, 300), "w2")]
    assert place.with_room(held, _batch("new", 200, 150)) == ["w2"]
    assert place.pages == {"w1": 128, "w2": 16}
    unknown = {"w3": InstanceInfo(name="w3", pool="default", model="m", theta_bytes=1024, delta_bytes=1)}
    place.sync(unknown, ["w1", "w2"], now=1.0)
    assert place.pages == {"w3": 16}  # an instance that does not say: COHORT_CONTINUOUS__PAGE_TOKENS


def test_pages_that_rows_share_are_charged_once_to_the_longest_lived():
    """A (planned 300 more) and B (100) share A's prompt's four pages, C (500) shares nothing:
    B's four pages are A's, which runs longer and keeps them to its end; with B planned longer
    than A, A's would be B's instead. Chained keys: a page after a difference is never shared."""
    from batcher.kv_judge import KVJudge

    a, b, c = keys(SYSTEM_A), keys(SYSTEM_A + list(range(900, 916))), keys(SYSTEM_B)
    sizes = [64, 80, 64]
    assert shared_by_longer_lived([a, b, c], [300, 100, 500], sizes, 16) == [0, 64, 0]
    # A's last page holds its last token, which it computes again: it finds 3 of its 4 pages in B
    assert shared_by_longer_lived([a, b, c], [100, 300, 500], sizes, 16) == [48, 0, 0]
    forked = keys([7] + SYSTEM_A[1:])                              # differs in its first token
    assert shared_by_longer_lived([a, forked], [300, 100], [64, 64], 16) == [0, 0]
    # the KV leaves the shared tokens out, the row count and step cost do not
    judge = KVJudge(capacity_tokens=930, page_tokens=16)
    contexts, left = [64, 80, 64], [300, 250, 500]
    shared = shared_by_longer_lived([a, b, c], left, sizes, 16)
    assert shared == [0, 64, 0]
    assert not judge.running_set_fits(contexts, left)              # peak as B ends: 208 + 3 x 250 + 3 x 8 = 982
    assert judge.running_set_fits(contexts, left, shared=shared)   # 64 fewer: 918
    assert not KVJudge(930, 16, max_rows=2).running_set_fits(contexts, left, shared=shared)


def _chat_batch(bid: str, ids: list[int], planned: int) -> Batch:
    return Batch(id=bid, requests=[ProfiledRequest(id=f"{bid}-r", prompt="p", input_tokens=len(ids), prompt_ids=ids,
                                                   predicted_tokens=planned, max_tokens=1024, arrival=0.0)],
                 created=0.0)


def test_a_batch_that_shares_an_instances_running_prompt_fits_beside_it(r, tmp_path):
    """Two instances of 640 KV tokens, each running one row of a 320-token prompt planned 200 more
    (w1: system prompt A's, w2: B's). A second row of prompt A (plus 16 tokens) planned 100 more
    needs 336 + 100 tokens of its own, too many beside either row; but beside w1's row it shares
    A's 320 tokens, which that row holds anyway: it fits there, and only there."""
    from batcher.placement import Placement

    long_a, long_b = SYSTEM_A * 5, SYSTEM_B * 5                     # 20 pages each
    place = Placement(Settings(database_url=f"sqlite:///{tmp_path}/log.db", execution="continuous"), r)
    alive = {n: InstanceInfo(name=n, pool="default", model="m", theta_bytes=640, delta_bytes=1) for n in ("w1", "w2")}
    place.sync(alive, [], now=0.0)
    held = [_Held(_chat_batch("a", long_a, 200), "w1"), _Held(_chat_batch("b", long_b, 200), "w2")]
    joining = _chat_batch("a2", long_a + list(range(900, 916)), 100)
    assert place.with_room(held, joining) == ["w1"]
    unshared = _chat_batch("c", list(range(2000, 2336)), 100)
    assert place.with_room(held, unshared) == []
    # a request's n choices: identical prompts, each computing its last token's page again
    same = [_chat_batch(f"n{i}", SYSTEM_A, 10).requests[0] for i in range(3)]
    assert shared_by_longer_lived([place._pages(q, 16) for q in same], [30, 20, 10], [64] * 3, 16) == [0, 48, 48]


def test_placement_forgets_the_pages_of_requests_no_longer_in_flight(r, tmp_path):
    from batcher import placement as pl

    place = pl.Placement(Settings(database_url=f"sqlite:///{tmp_path}/log.db", execution="continuous"), r)
    alive = {"w1": InstanceInfo(name="w1", pool="default", model="m", theta_bytes=100_000, delta_bytes=1)}
    place.sync(alive, [], now=0.0)
    rows = [_chat_batch(f"old{i}", SYSTEM_A, 10).requests[0] for i in range(pl.PAGES_KEPT_SPARE + 10)]
    held = [_Held(Batch(id="big", requests=rows, created=0.0), "w1")]
    place.with_room(held, _chat_batch("new", SYSTEM_A, 10))
    assert len(place._row_pages) == pl.PAGES_KEPT_SPARE + 11   # every one in flight is judged and kept
    now = [_Held(_chat_batch("kept", SYSTEM_B, 10), "w1")]
    place.with_room(now, _chat_batch("next", SYSTEM_B, 10))
    assert {k[0] for k in place._row_pages} == {"kept-r", "next-r"}
