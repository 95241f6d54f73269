"""The live batcher: one active process that turns incoming requests into batches and hands a
batch to the pool's Celery queue (an upstream-only pool's: a sorted set) only when an instance has room.

Its state sits in Redis (``pending`` requests, ``inflight`` batches), so a restart recovers it.
It also watches for lost work: a batch whose instance stopped heart-beating is re-queued (up to
``max_requeues`` times, then its requests fail explicitly); an OOM batch is split in two and both
halves go back to the waiting queue; an OOM batch of one fails with a clear error. Under elastic
execution the worker answers rows itself as they finish and hands preempted rows back as continuations,
which wait here like new requests (same id, same stream). A request the gateway cancelled is
dropped from the waiting set and from any batch before it is dispatched.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from batcher.intake import Intake
from batcher.memory import KVMemory
from batcher.oom import UnsplittableBatch, split_batch
from batcher.placement import Placement
from batcher.policies import Policy, PolicyContext, group_share, make_policy, planning_memory
from batcher.resume import resume_points
from cohort import bus
from cohort.logdb import fail_stale_queued, finish_request, get_db_engine
from cohort.protocol import BatchOutcome, CompletionEvent, FailureCode, StreamEvent, dumps
from cohort.release_bus import group_set, hand_over, queued_text
from cohort.settings import Settings
from cohort.types import Batch, InstanceInfo, ProfiledRequest, new_id

log = logging.getLogger("cohort.batcher")
SWEEP_EVERY_S = 60.0
# Lost batches are found by heartbeats that expire in seconds; checking them every round (two
# pipelines over every in-flight batch) was a quarter of the batcher's CPU in a burst.
LOST_CHECK_EVERY_S = 0.25


@dataclass
class Inflight:
    batch: Batch
    dispatched: float
    admitted: bool = False  # its rows run on an instance (continuous: the group joined the running rows)
    target: str | None = None  # the instance it was routed to (None: the pool's queue)
    owner: str | None = None   # the instance that claimed it, once seen


@dataclass
class BatcherService(Intake):
    """Owns one pool's policy. ``step`` does one round of work and is what tests drive."""

    settings: Settings
    redis: redis.Redis
    estimator: object
    # hands a batch to the pool's queue, or to one instance's (taskq.celery_app.batch_sender)
    send_task: Callable[[Batch, str | None], None]
    policy: Policy | None = None
    placement: Placement | None = None  # prefix-aware routing (COHORT_PREFIX_ROUTING)
    inflight: dict[str, Inflight] = field(default_factory=dict)
    instances: dict[str, InstanceInfo] = field(default_factory=dict)
    _last_refresh: float = 0.0
    _last_sweep: float = 0.0
    _last_lost_check: float = 0.0
    _waiting: dict[str, ProfiledRequest] = field(default_factory=dict)  # in the policy, not dispatched
    _cancelled: dict[str, float] = field(default_factory=dict)  # withdrawn, maybe still in the policy
    _worst_sent: tuple = (None, -1)  # the least urgent priority last published, and when (whole seconds)
    _hunger: tuple = (None, 0.0)  # whether requests waited at the last announcement, and when (monotonic)

    def __post_init__(self) -> None:
        if self.settings.prefix_routing and self.placement is None:
            self.placement = Placement(self.settings, self.redis)

    @property
    def keys(self) -> bus.PoolKeys:
        return bus.pool_keys(self.settings.pool)

    # --- setup ----------------------------------------------------------------------------
    def _make_policy(self, memory: KVMemory) -> Policy:
        s = self.settings
        ctx = PolicyContext(memory=memory, estimator=self.estimator, max_input_tokens=s.max_input_tokens,
                            max_tokens_limit=s.max_tokens_limit, elastic=s.execution != "static",
                            prefix_page_tokens=s.continuous.page_tokens * (s.execution == "continuous" and s.prefix_caching))
        ctx.cached_tokens = self.placement and (lambda r: self.placement.router.best_cached_tokens(r, self.placement.model))
        return make_policy(s.policy, ctx, **s.policy_params())

    def refresh_instances(self, now: float) -> None:
        """Alive instances of our pool; Θ of the pool = the smallest Θ (a batch must fit anywhere)."""
        infos = {name: InstanceInfo.from_dict(json.loads(js)) for name, js in self.redis.hgetall(bus.INSTANCES).items()}
        mine = {name: info for name, info in infos.items() if info.pool == self.settings.pool}
        beating = bus.alive(self.redis, mine)
        if not all(beating.get(n) for n in mine) and self._redis_restarted():
            beating = dict.fromkeys(mine, True)  # the silent ones get a TTL to beat again
        alive: dict[str, InstanceInfo] = {}
        for name, info in mine.items():
            if beating.get(name):
                alive[name] = info
            else:  # its heartbeat expired: the registration goes too (a restarted worker re-registers)
                self.redis.hdel(bus.INSTANCES, name)
        if alive:
            s = self.settings
            share = group_share(s.execution, all(i.upstream for i in alive.values()), s.continuous.group_frac,
                                s.upstream_group_frac)
            memory = planning_memory(s.policy, KVMemory.for_pool(alive.values()), s.memory_headroom, share)
            if self.policy is None:
                self.policy = self._make_policy(memory)
                self._recover(now)
            elif memory != self.policy.ctx.memory:
                self.policy.set_memory(memory)
        if set(alive) != set(self.instances):
            log.info("instances in pool %s: %s", self.settings.pool, sorted(alive) or "none")
        if self.placement is not None:
            self.placement.sync(alive, [n for n in self.instances if n not in alive], now)
        self.instances = alive
        self._last_refresh = now

    def _recover(self, now: float) -> None:
        """Reload what a previous batcher left in Redis."""
        pending = [ProfiledRequest.from_dict(json.loads(v)) for v in self.redis.hvals(self.keys.pending)]
        for req in sorted(pending, key=lambda r: r.arrival):
            self._add(req, now)
        for js in self.redis.hvals(self.keys.inflight):
            d = json.loads(js)
            b = Batch.from_dict(d["batch"])
            self.inflight[b.id] = Inflight(b, d["dispatched"], target=d.get("target"))
        if pending or self.inflight:
            log.info("recovered %d pending requests and %d in-flight batches", len(pending), len(self.inflight))

    # --- one round ------------------------------------------------------------------------
    def step(self, now: float | None = None, wait_s: float = 0.0) -> bool:
        """One round: wait for a producer's wake (at most ``wait_s``; a token left while the last round
        ran ends it at once), take in arrivals, cancels and completions, check for lost batches,
        dispatch, say whether requests still wait. The reads are one round trip (``_read``). True
        when a list held more than one round takes: the next round should not wait."""
        if self.policy is None:
            if wait_s > 0:
                bus.wait_for_work(self.redis, self.settings.pool, wait_s)
            self.refresh_instances(time.time() if now is None else now)
            if self.policy is None:
                return False  # no instance has registered yet: requests wait in Redis
            wait_s = 0.0
        arrivals, cancels, completions, more = self._read(wait_s)
        now = time.time() if now is None else now
        if now - self._last_refresh > 1.0:
            self.refresh_instances(now)
        taken = self._take_arrivals(now, arrivals)  # sent with the dispatch, or before the cancels
        if cancels and taken is not None:
            taken.execute()  # a cancel of an arrival of this round takes it out of ``pending`` after it went in
            taken = None
        self._take_cancels(cancels)
        pipe = self.redis.pipeline() if taken is None else taken
        self._take_completions(now, completions, pipe)
        if now - self._last_lost_check >= LOST_CHECK_EVERY_S:
            self._last_lost_check = now
            self._check_lost(now)
        self._dispatch(now, pipe)
        self._announce_hunger()
        if now - self._last_sweep > SWEEP_EVERY_S:
            self._sweep(now)
        return more

    def _sweep(self, now: float) -> None:
        """Fail log-DB rows left ``queued`` past the gateway's timeout (see logdb.fail_stale_queued)."""
        self._last_sweep = now
        cutoff = now - self.settings.request_timeout_s - SWEEP_EVERY_S
        n = fail_stale_queued(get_db_engine(self.settings.database_url), cutoff,
                              "never scheduled: lost before the batcher received it")
        if n:
            log.warning("marked %d request record(s) failed that stayed queued past the timeout", n)

    def _add(self, req: ProfiledRequest, now: float) -> None:
        self.policy.add(req, now)
        self._waiting[req.id] = req

    def _shed(self) -> None:
        """Overload shedding: when more requests wait than ``max_pending`` (the gateway admits a
        request into a full queue when it is more urgent than the least urgent one waiting), the
        least urgent — highest priority number, then the newest — are answered 429 and dropped.
        Also publishes the least urgent priority waiting, which the gateway's admission reads."""
        excess = len(self._waiting) - self.settings.max_pending
        if excess > 0:
            victims = sorted(self._waiting.values(), key=lambda r: (-r.priority, -r.arrival))[:excess]
            self._note_cancelled([r.id for r in victims])  # out of their batch at dispatch
            pipe = self.redis.pipeline()
            for r in victims:  # and out of a worker's, if one runs them after all
                bus.cancel(pipe, r.id, self.settings.pool)
            pipe.execute()
            self.redis.hincrby(bus.STATS, "shed", len(victims))
            self._fail(victims, FailureCode.QUEUE_FULL, "the queue is full and more urgent requests needed "
                       "the room: this request was shed; retry later")
        self._publish_worst()

    def _publish_worst(self, pipe=None) -> None:
        """The least urgent priority waiting, for the gateway's admission (absent: none waits); sent
        when it changed (and at least every second: a batcher that took over writes it anew), in
        ``pipe`` when the round has one going."""
        worst = max((r.priority for r in self._waiting.values()), default=None)
        if (worst, int(time.monotonic())) == self._worst_sent:
            return
        self._worst_sent = (worst, int(time.monotonic()))
        target = self.redis if pipe is None else pipe
        if worst is None:
            target.delete(self.keys.worst_priority)
        else:
            target.set(self.keys.worst_priority, worst)

    def _take_completions(self, now: float, msgs: list[str], pipe) -> bool:
        """The round's completions. ``pipe``: the round's transaction retires their batches and trims
        the list, with the dispatch (not two round trips more); a crash before it re-reads them."""
        for js in msgs:
            ev = CompletionEvent.from_json(js)
            fl = self.inflight.pop(ev.batch_id, None)
            if fl is None:
                pipe.hdel(self.keys.inflight, ev.batch_id)
                continue  # a superseded copy finished after we re-queued it; its results are harmless
            if self.placement is not None and ev.instance:  # who ran it, if no lost-batch check saw the claim
                self.placement.claimed(fl, ev.instance)
            answered = set(ev.answered)
            rest = [r for r in fl.batch.requests if r.id not in answered]
            if ev.outcome is BatchOutcome.OOM:
                self._split_oom(fl.batch, rest, now)
            elif ev.outcome is BatchOutcome.FAILED:
                back = {c.id for c in ev.continuations}
                self._fail([r for r in rest if r.id not in back], FailureCode.BATCH_FAILED,
                           f"the worker failed this batch: {ev.error}")
            if ev.continuations:
                self.redis.hincrby(bus.STATS, "preemptions", len(ev.continuations))
                self._requeue_requests(ev.continuations, now, replaces=ev.batch_id)
            else:
                pipe.hdel(self.keys.inflight, ev.batch_id)
        if msgs:
            pipe.ltrim(self.keys.completions, 0, -len(msgs) - 1)
        return bool(msgs)

    def _back_to_pending(self, requests: list[ProfiledRequest], replaces: str) -> None:
        """Back to ``pending`` in the transaction that retires their in-flight batch: a crash loses none."""
        pipe = self.redis.pipeline()
        pipe.hset(self.keys.pending, mapping={r.id: dumps(r.to_dict()) for r in requests})
        pipe.hdel(self.keys.inflight, replaces)
        pipe.execute()

    def _requeue_requests(self, requests: list[ProfiledRequest], now: float, replaces: str) -> None:
        """Preempted rows wait again like new requests (arrival kept: HRRN and FCFS see their wait)."""
        self._back_to_pending(requests, replaces)
        for r in requests:
            self._add(r, now)

    def _requeue(self, batches: list[Batch], now: float, replaces: str) -> None:
        """Give whole batches back to the policy (OOM halves, a lost worker's batch)."""
        self._back_to_pending([r for b in batches for r in b.requests], replaces)
        for b in batches:
            self.policy.requeue(b, now)
            self._waiting.update({r.id: r for r in b.requests})

    def _split_oom(self, batch: Batch, rest: list[ProfiledRequest], now: float) -> None:
        """Split recovery: the rows not yet answered, in two halves, both restart."""
        self.redis.hincrby(bus.STATS, "oom_splits", 1)
        if not rest:
            self.redis.hdel(self.keys.inflight, batch.id)
            return
        batch = Batch(id=batch.id, requests=rest, created=batch.created, attempt=batch.attempt, splits=batch.splits)
        try:
            a, b = split_batch(batch)
        except UnsplittableBatch as e:
            self._fail(batch.requests, FailureCode.OUT_OF_MEMORY,
                       f"{e}; input {batch.input_len} tokens + max_tokens {batch.requests[0].max_tokens}")
            self.redis.hdel(self.keys.inflight, batch.id)
            return
        log.warning("batch %s (β=%d) ran out of memory; split into %d + %d and re-queued",
                    batch.id, batch.size, a.size, b.size)
        self._requeue([a, b], now, replaces=batch.id)

    def _check_lost(self, now: float) -> bool:
        """Re-queue batches whose instance died: mid-batch (claimed, heartbeat gone), or after
        Celery delivered the task but before the worker claimed it (unclaimed for two heartbeat
        TTLs and no longer waiting in the queue)."""
        lost, queued = [], None
        owners = bus.unfinished_claims(self.redis, list(self.inflight))  # one round trip each
        alive = bus.alive(self.redis, owners.values())
        if not all(alive.values()) and self._redis_restarted():
            alive = dict.fromkeys(alive, True)
        for bid, owner in owners.items():
            fl = self.inflight[bid]
            if self.placement is not None:
                self.placement.claimed(fl, owner)
            if owner and owner != bus.CANCELLED and not alive[owner]:
                lost.append((bid, owner))
            elif owner is None and fl.target is not None and fl.target not in self.instances:
                lost.append((bid, f"{fl.target} (routed, unclaimed)"))
            elif owner is None and now - fl.dispatched > 2 * self.settings.instance_ttl_s:
                queued = queued_text(self.redis, self.settings.pool, {f.target for f in self.inflight.values()}) \
                    if queued is None else queued
                if bid not in queued:
                    lost.append((bid, "(unclaimed)"))
        for bid, owner in lost:
            fl = self.inflight.pop(bid)
            self.redis.set(bus.claim_key(bid), bus.CANCELLED,  # a redelivery is a no-op
                           ex=bus.marker_ttl_s(self.settings.visibility_timeout_s))
            self.redis.hincrby(bus.STATS, "requeues", 1)
            b = fl.batch
            if b.attempt + 1 > self.settings.max_requeues:
                self._fail(b.requests, FailureCode.WORKER_LOST, f"instance {owner} died while running this batch, "
                           f"{b.attempt + 1} times; giving up")
                self.redis.hdel(self.keys.inflight, bid)
                continue
            rest = resume_points(self.redis, get_db_engine(self.settings.database_url), b.requests)
            log.warning("instance %s died running batch %s; %d of %d request(s) re-queued (attempt %d)", owner,
                        bid, len(rest), b.size, b.attempt + 1)
            if not rest:
                self.redis.hdel(self.keys.inflight, bid)
                continue
            self._requeue([Batch(id=new_id("b"), requests=rest, created=b.created,
                                 attempt=b.attempt + 1, splits=b.splits)], now, replaces=bid)
        return bool(lost)

    def _redis_restarted(self) -> bool:
        """Redis started less than a heartbeat TTL ago: a missing heartbeat proves nothing yet (the
        instance's client may still be reconnecting), so no instance is declared dead — a re-queued
        batch would run twice, new requests meet 503s. Asked only when a heartbeat is missing."""
        return bus.redis_uptime_s(self.redis) < self.settings.instance_ttl_s

    def _has_room(self) -> bool:
        """Whether a batch may go out now. Static and elastic: an instance is idle. Continuous: fewer
        than ``continuous.lookahead`` batches per instance wait to be admitted (so a group is there
        at each step boundary where its plan fits: a dispatch round trip takes several steps) and
        running batches stay below ``continuous.max_groups`` per instance; the worker decides when
        a group joins (``workers.continuous``), and the round's read learnt which it admitted."""
        n = len(self.instances)
        if self.settings.execution != "continuous":
            return len(self.inflight) < n
        if len(self.inflight) >= n * self.settings.continuous.max_groups:
            return False
        return sum(not fl.admitted for fl in self.inflight.values()) < n * self.settings.continuous.lookahead

    def _dispatch(self, now: float, pipe=None) -> bool:
        """Every batch the instances have room for, recorded in flight in one transaction (with the
        least urgent priority left waiting; after ``pipe``'s commands, the round's arrivals, when
        given); then, for pools served through Celery, the tasks."""
        sent: list[tuple[Batch, str | None, bool]] = []
        pipe = self.redis.pipeline() if pipe is None else pipe
        listed = bool(self.instances) and all(i.upstream for i in self.instances.values())  # no Celery
        while self._has_room():
            batch = self.policy.pop(now)
            if batch is None:
                break
            if gone := [r.id for r in batch.requests if self._cancelled.pop(r.id, None) is not None]:
                pipe.hdel(self.keys.pending, *gone)  # withdrawn while it waited: never reaches a worker
                batch.requests = [r for r in batch.requests if r.id not in gone]
                if not batch.requests:
                    continue
            target, cached = (None, False) if self.placement is None else \
                self.placement.target(batch, list(self.inflight.values()))
            self._send(pipe, batch, now, target, listed)
            sent.append((batch, target, cached))
        if sent:
            self._publish_worst(pipe)  # what left changes the least urgent priority still waiting
        if len(pipe):
            pipe.execute()
        for batch, target, cached in sent:
            if not listed:  # after the transaction: a worker's completion always finds its batch in flight
                self.send_task(batch, target)
            where = "" if target is None else f" to {target} ({'its prefix is cached there' if cached else 'least loaded'})"
            log.info("dispatched batch %s: β=%d L=%d G'=%d%s", batch.id, batch.size, batch.input_len,
                     batch.predicted_gen_len, where)
        return bool(sent)

    def _send(self, pipe, batch: Batch, now: float, target: str | None, listed: bool) -> None:
        """Queue a batch's dispatch in the round's transaction: in flight, out of ``pending``, and,
        when ``listed`` (an upstream-only pool: no Celery task), on its sorted set."""
        payload = batch.to_dict()
        pipe.hset(self.keys.inflight, batch.id, dumps({"batch": payload, "dispatched": now, "target": target}))
        pipe.hdel(self.keys.pending, *[r.id for r in batch.requests])
        pipe.hincrby(bus.STATS, "batches_dispatched", 1)
        if listed:
            hand_over(pipe, group_set(self.settings.pool, target), min(r.priority for r in batch.requests),
                      self.policy.handover_key(batch, now), dumps(payload))
        self.inflight[batch.id] = Inflight(batch, now, target=target)
        for r in batch.requests:
            self._waiting.pop(r.id, None)

    def _fail(self, requests: list[ProfiledRequest], code: FailureCode, message: str) -> None:
        """Answer each request with an explicit error; nothing accepted is ever dropped silently."""
        if not requests:
            return
        self.redis.hincrby(bus.STATS, "requests_failed", len(requests))
        db = get_db_engine(self.settings.database_url)
        for r in requests:  # record first, then answer: a client that sees the error finds the record
            finish_request(db, r.id, status="failed", error=message)
            bus.publish_now(self.redis, r.id, StreamEvent.error(code, message))
            self.redis.hdel(self.keys.pending, r.id)
            self._waiting.pop(r.id, None)
        log.error("failed %d request(s): %s", len(requests), message)
