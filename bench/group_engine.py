"""cohort's policies under continuous execution in the simulator: the live worker's running set.

The batching policy (WMA/Magnus, S3, SLO-ODBS, HRRN, VS…) forms and orders batches, each planned
with the policy's own KV rule under an admission budget (a share of Θ); a batch is an *admission
group*. Each instance is a ``batcher.running_set.RunningSet`` — the class the worker's engine
drives — so admission (the KV judge on planned lengths, the row cap, the marginal-cost rule),
decode-first step planning under the token budget, eviction (``eviction_order``, least urgent
first) and resumption (an evicted row waits on its instance and resumes before anything new
joins) are the worker's, line for line. What the simulator adds is what the hardware does: each
step is costed on the roofline (``RooflineBatchTime.step_seconds``: each row's own prompt
chunk and context), a victim is swapped to the host pool over the preset's PCIe link or dropped
for recompute (``batcher.preemption.choose_preemption``), and each row stops at its true length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batcher.policies.base import Policy
from batcher.preemption import SwapLink, choose_preemption, swap_seconds
from batcher.prefix_groups import prompt_pages
from batcher.row_cost import DecodeStepCost
from batcher.running_set import Admission, RunningSet, RunRow, StepPlan
from bench.continuous import EngineLimits, SimInstance, StepStats, account_step
from bench.roofline import RooflineBatchTime
from cohort.settings import PreemptionMode
from cohort.types import Batch, ProfiledRequest


class GroupScheduler:
    """The policy's queue: requests go in, admission groups come out in its order."""

    def __init__(self, policy: Policy, limits: EngineLimits, max_preemptions: int = 8,
                 step_cost: DecodeStepCost | None = None, marginal_cost: float = 0.0,
                 prefix_caching: bool = False, affinity: int = 0) -> None:
        self.pol = policy
        self.limits = limits
        self.max_preemptions = max_preemptions
        self.step_cost, self.marginal_cost = step_cost, marginal_cost  # batcher.row_cost
        self.prefix_caching = prefix_caching  # each instance keeps its prompts' pages (batcher.page_pool)
        # prefix-aware routing: an instance with room takes, of the next ``affinity`` groups in the
        # policy's order, the first whose prompt starts with a page it holds (else the next one)
        self.affinity = affinity
        self.ahead: list[Batch] = []          # groups popped from the policy, not yet taken
        self._pages: dict[str, list[int]] = {}
        self.queued = 0                      # requests in the policy or ``ahead``, not yet on an instance
        self.declined: set[int] = set()      # instances a pop left every group to (they hold the prefixes)

    def add(self, req: ProfiledRequest, now: float) -> None:
        self.pol.add(req, now)
        self.queued += 1

    def has_work(self) -> bool:
        return self.queued > 0

    def pages(self, req: ProfiledRequest) -> list[int]:
        """The request's prompt page hashes, computed once."""
        got = self._pages.get(req.id)
        if got is None:
            got = self._pages[req.id] = prompt_pages(req, self.limits.page_tokens, SALT)
        return got

    def pop(self, now: float, cached: Callable[[list[int]], int] | None = None,
            elsewhere: Callable[[list[int]], tuple[int, int]] | None = None) -> Batch | None:
        """The next group for an instance. With ``affinity``: of the next few groups, those whose
        first prompt has no longer prefix cached (pages) on another instance with room
        (``elsewhere``: (pages, that instance's key)) than on this one (``cached``), the one with the
        longest here, else the first of them; None when each is better placed elsewhere, and
        ``declined`` names those instances (each pulls at its next step boundary; a sleeping one
        must be woken). So a group goes where its prefix is among the instances with room: the live
        router's rule (``batcher.prefix_routing``), and one hot prompt cannot pin an instance."""
        while len(self.ahead) < max(1, self.affinity) and self.queued > sum(g.size for g in self.ahead):
            group = self.pol.pop(now)
            if group is None:
                break
            self.ahead.append(group)
        if not self.ahead:
            return None
        pick = 0
        if self.affinity and cached is not None:
            best, pick, better = -1, -1, set()
            for i, g in enumerate(self.ahead):
                pages = self.pages(g.requests[0]) if g.requests else []
                here = cached(pages)
                there, key = elsewhere(pages) if elsewhere is not None else (0, -1)
                if there > here:
                    better.add(key)
                elif here > best:
                    best, pick = here, i
            if pick < 0:
                self.declined |= better
                return None
        group = self.ahead.pop(pick)
        self.queued -= group.size
        return group

    def take_pages(self, req: ProfiledRequest) -> list[int]:
        """The request's prompt page hashes for its running-set row, forgotten here."""
        got = self._pages.pop(req.id, None)
        return got if got is not None else prompt_pages(req, self.limits.page_tokens, SALT)


SALT = "sim"   # one model in a simulation: every prompt's pages are keyed under it


@dataclass
class _Sim:
    """What the simulator knows of a row beyond its scheduling record: its trace index, request,
    tokens generated so far, and the KV it left on the host when swapped out."""

    j: int
    req: ProfiledRequest
    gen: int = 0
    host: tuple[int, int] | None = None   # (KV entries, pages) on the host pool while swapped


class GroupEngine:
    """Runs one instance's steps with cohort's running set; ``bench.continuous_run`` owns time."""

    def __init__(self, tm: RooflineBatchTime, groups: GroupScheduler, limits: EngineLimits, stats: StepStats,
                 settle: Callable[[int, float, bool], None], first_token: Callable[[int, float], None],
                 preemption: PreemptionMode = "recompute", link: SwapLink | None = None,
                 dispatched: Callable[[int, float], None] | None = None,
                 step_observer: Callable[[int, int, int, float], None] | None = None) -> None:
        if preemption != "recompute" and link is None:
            raise ValueError("swap and adaptive preemption need the host link (GPU preset's PCIe bandwidth)")
        self.tm, self.groups, self.limits, self.stats = tm, groups, limits, stats
        self.settle, self.first_token, self.dispatched = settle, first_token, dispatched
        self.preemption, self.link, self.step_observer = preemption, link, step_observer
        self.sets: dict[int, RunningSet] = {}
        self.rows: dict[str, _Sim] = {}
        self.transfer = 0.0   # PCIe seconds of the step being built
        # every admission and eviction in order, (time, instance, "admit" | "evict", id): what a
        # test compares with the worker's engine on the same trace
        self.log: list[tuple[float, int, str, str]] = []
        if groups.prefix_caching and groups.affinity:  # groups go where their prefix is: the live router's view
            groups.pol.ctx.cached_tokens = self._best_cached

    def _best_cached(self, req: ProfiledRequest) -> int:
        """Prompt tokens of ``req`` cached on the instance holding the most of them (the policy's
        ``PolicyContext.cached_tokens``, as the live batcher's router answers it)."""
        pages = self.groups.pages(req)
        return self.limits.page_tokens * max((self._affinity(key)(pages) for key in self.sets), default=0)

    def running_set(self, inst: SimInstance) -> RunningSet:
        key = id(inst)
        if key not in self.sets:
            g = self.groups
            self.sets[key] = RunningSet(inst.total_pages, self.limits.page_tokens, self.limits.max_batched_tokens,
                                        g.max_preemptions, self.limits.max_num_seqs, g.marginal_cost,
                                        prefix_caching=g.prefix_caching)
            self.sets[key].step_cost = g.step_cost   # the roofline's step, or one learnt from the steps
        return self.sets[key]

    def _bytes_s(self, pages: int, to_host: bool) -> float:
        assert self.link is not None
        nbytes = pages * self.limits.page_tokens * self.tm.delta_bytes
        return nbytes / (self.link.to_host_bytes_per_s if to_host else self.link.to_device_bytes_per_s)

    def prefix_stats(self) -> dict[str, float]:
        """Prompt tokens looked up in the instances' prefix caches and found there (vLLM's counters)."""
        queries = sum(rs.pool.queries for rs in self.sets.values())
        hits = sum(rs.pool.hits for rs in self.sets.values())
        return {"prefix_queries": queries, "prefix_hits": hits, "prefix_hit_rate": hits / queries if queries else 0.0}

    def _affinity(self, key: int) -> Callable[[list[int]], int]:
        """How well a prompt (its page keys) suits instance ``key``: its cached leading pages there."""
        pool = self.sets[key].pool
        return lambda h: len(pool.lookup(h))

    def _elsewhere(self, here: int) -> Callable[[list[int]], tuple[int, int]]:
        """(most pages of a prompt cached on another instance with room, that instance's key): room
        is no group waiting on it and a row to spare, so it pulls at its next step boundary."""
        others = [(key, self._affinity(key)) for key, rs in self.sets.items()
                  if key != here and not rs.waiting and len(rs.rows) < rs.max_rows]

        def best(h: list[int]) -> tuple[int, int]:
            return max(((score(h), key) for key, score in others), default=(0, -1))
        return best

    # --- a step boundary ------------------------------------------------------------------
    def _admit(self, inst: SimInstance, rs: RunningSet, now: float, index: dict[str, int]) -> None:
        """Resumed rows, then groups from the policy while each fits (one that does not waits here)."""
        while True:
            if not rs.waiting and (group := self.groups.pop(now, self._affinity(id(inst)),
                                                            self._elsewhere(id(inst)))) is not None:
                for q in group.requests:
                    self.rows[q.id] = _Sim(index[q.id], q)
                rs.add_group(group.id, [RunRow(q.id, q.input_tokens, predicted_remaining=q.predicted_tokens,
                                               planned_remaining=max(1, q.planned_tokens),
                                               preemptions=q.preemptions, priority=q.priority,
                                               hashes=self.groups.take_pages(q)
                                               if self.groups.prefix_caching else [])
                                        for q in group.requests])
            adm = rs.admit_waiting()
            self._admitted(inst, rs, adm, now)
            if rs.waiting or not adm.groups:
                return

    def _admitted(self, inst: SimInstance, rs: RunningSet, adm: Admission, now: float) -> None:
        for rid, _why in adm.failed:
            self.settle(self.rows.pop(rid).j, now, False)
        for rid in adm.resumed:
            sim = self.rows[rid]
            if sim.host is not None:             # its KV comes back over the link
                kv, pages = sim.host
                inst.host_free += pages
                self.transfer += self._bytes_s(pages, False)
                rs.rows[rid].computed = kv
                sim.host = None
        for gid in adm.groups:
            self.log.append((now, id(inst), "admit", gid))
            rows = [r for r in rs.rows.values() if r.group_id == gid]
            self.stats.groups += 1
            self.stats.group_sizes.append(len(rows))
            for r in rows:
                if self.dispatched:
                    self.dispatched(self.rows[r.row_id].j, now)

    def _recompute_s(self, rs: RunningSet, kv: int) -> float:
        """What re-prefilling ``kv`` entries adds to a step of the rows running beside it: f(rows +
        its tokens) − f(rows) on the step cost, cohort's true marginal, not a lone prefill."""
        k = float(kv)
        d_rows = float(len(rs.rows))
        d_reads = float(sum(r.computed + 1 for r in rs.rows.values()))
        base = self.tm.step_seconds(0.0, 0.0, 0.0, d_rows, d_reads)
        return self.tm.step_seconds(k, k * k / 2.0, 0.0, d_rows, d_reads) - base

    def _evicted(self, inst: SimInstance, rs: RunningSet, plan: StepPlan, now: float) -> None:
        failed = {rid for rid, _why in plan.failed}
        for rid in plan.evicted:
            self.stats.preemptions += 1
            self.log.append((now, id(inst), "evict", rid))
            sim = self.rows[rid]
            pages, kv = plan.victims[rid]
            if rid in failed:
                self.settle(self.rows.pop(rid).j, now, False)
                continue
            if self.preemption != "recompute" and kv >= sim.req.input_tokens:
                assert self.link is not None
                tokens = len(pages) * self.limits.page_tokens
                host_tokens = inst.host_free * self.limits.page_tokens
                if self.preemption == "swap" and tokens > host_tokens:
                    self.stats.swap_fallbacks += 1
                swap_s = swap_seconds(tokens, int(self.tm.delta_bytes), self.link)
                if choose_preemption(self.preemption, swap_s, self._recompute_s(rs, kv), host_tokens,
                                     tokens) == "swap":
                    self.stats.swaps += 1
                    self.transfer += self._bytes_s(len(pages), True)
                    inst.host_free -= len(pages)
                    sim.host = (kv, len(pages))
                    continue
            self.stats.recomputes += 1
            self.stats.recomputed_gen += sim.gen
            self.stats.dropped_kv += kv

    # --- one step -------------------------------------------------------------------------
    def step(self, inst: SimInstance, now: float, index: dict[str, int]) -> float | None:
        """Run one step starting at ``now``; returns its end, or None when there is nothing to run."""
        rs = self.running_set(inst)
        self._admit(inst, rs, now, index)
        plan = rs.plan_step()
        self._evicted(inst, rs, plan, now)
        if not plan.prefill and not plan.decode:
            return None
        p_tok = p_pairs = p_reads = d_rows = d_reads = 0.0
        for _rid, start, n in plan.prefill:
            p_tok += n
            p_pairs += n * (start + n / 2.0)
            p_reads += start
        for rid in plan.decode:
            d_rows += 1
            d_reads += rs.rows[rid].computed + 1
        end = account_step(self.tm, self.stats, now, self.transfer, len(plan.prefill) + len(plan.decode),
                           self.step_observer, p_tok, p_pairs, p_reads, d_rows, d_reads)
        self.transfer = 0.0
        st = self.stats
        for rid in rs.commit(plan):
            sim = self.rows[rid]
            if sim.gen == 0:
                self.first_token(sim.j, end)
            sim.gen += 1
            st.decoded += 1
            if sim.gen >= (sim.req.true_tokens or 1):
                rs.release(rid)
                self.settle(self.rows.pop(rid).j, end, True)
            else:
                rs.produced(rid, max(0, sim.req.predicted_tokens - sim.gen), max(1, sim.req.planned_tokens - sim.gen))
        inst.busy_until = end
        return end
