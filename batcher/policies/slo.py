"""SLO-ODBS (UELLM) and its variants SLO-DBS (w2 = 0) and ODBS (w1 = 0), as SPEC defines them.

Offline, the algorithm sorts the pending requests by SLO ascending (ties: predicted length) and
makes one greedy pass: candidate q joins the current batch c (n members, O_c its largest
predicted length) if c is empty, or if

    w1·T_l + w2·T_o ≤ Threshold   and   c ∪ {q} fits Θ,
    T_o = |G'(q) − O_c| · (n + 1) · L2                      (output-length dissimilarity: padding)
    T_l = L1 · Σ_{p ∈ c∪{q}} max(0, T̂(c ∪ {q}) − slack(p))   (predicted SLO overrun, seconds)

otherwise c is closed and q opens the next batch. Closed batches run earliest-deadline first.
"Fits" is the memory rule of ``batcher.memory`` on planned lengths (MEM(c ∪ {q}) ≤ Θ under
static execution, the KV peak under elastic execution).

Online (this class): when an instance is idle, the pass runs over all pending requests with
slack(p) = deadline(p) − now. A request's SLO *now* is its remaining slack, so "SLO ascending"
is deadline ascending; then the first batch of the pass holds the request with the earliest
deadline, i.e. it is the batch EDF dispatches first, and the pass can stop when that batch
closes (the later batches would be rebuilt at the next pop anyway, with new arrivals and a
new ``now``). Pending requests are kept sorted (bisect), and members' slacks arrive in
ascending order, so Σ max(0, T̂ − slack) is a prefix-sum lookup: a pop costs O(β log β)
estimator calls rather than O(queue · β).

Constants. L2 = 1.2 and Threshold = 15000 are the authors' code; SPEC leaves L1 open. L1
converts seconds of overrun into the units of T_o (token·requests); we use L1 = 10 (one
request-second of predicted overrun weighs as much as a ~8-token length mismatch in a batch of
one) and w1 = w2 = 1 for SLO-ODBS, so a batch closes after ~1,500 request-seconds of predicted
overrun or the length-mismatch budget, whichever comes first. Larger L1 makes batches collapse
to a few requests as soon as the queue is behind (late requests make every join overrun), which
is a death spiral under load (at 60 req/s throughput falls from 33.8 req/s at L1 = 10 to 12.5
at L1 = 100); smaller makes the SLO term inert (docs/notes/benchmarks.md, "Choice of L1", has the
sweep). Batches are restricted to one batch key (requests of other keys are skipped, not used to
close the batch). Our batch cap is Θ (the authors' code uses a constant 10 or 18).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from itertools import count

from batcher.policies.base import NextOpen, Policy, PolicyContext
from cohort.types import Batch, ProfiledRequest, new_id

L1_DEFAULT = 10.0
L2_DEFAULT = 1.2
THRESHOLD_DEFAULT = 15000.0


class SLOODBSPolicy(Policy):
    """Greedy SLO/length batching; ``w1``/``w2`` pick the variant (see module docstring)."""

    order = "deadline"

    def __init__(self, ctx: PolicyContext, w1: float = 1.0, w2: float = 1.0, l1: float = L1_DEFAULT,
                 l2: float = L2_DEFAULT, slo_threshold: float = THRESHOLD_DEFAULT,
                 max_batch_size: int | None = None) -> None:
        super().__init__(ctx)
        if w1 < 0 or w2 < 0:
            raise ValueError("weights must be >= 0")
        self.w1, self.w2, self.l1, self.l2 = float(w1), float(w2), float(l1), float(l2)
        self.threshold = float(slo_threshold)
        self.max_batch_size = max_batch_size
        self._seq = count()
        # (deadline, predicted length, seq, request): "SLO ascending, ties by predicted length"
        self._pending: list[tuple[float, int, int, ProfiledRequest]] = []

    def add(self, req: ProfiledRequest, now: float) -> None:
        insort(self._pending, (req.deadline, req.predicted_tokens, next(self._seq), req))

    def cost(self, members: list[ProfiledRequest], q: ProfiledRequest, now: float) -> tuple[float, float]:
        """(T_l, T_o) of adding q to ``members`` — the literal formulas, for tests and inspection."""
        n = len(members)
        O_c = max(r.predicted_tokens for r in members)
        t_o = abs(q.predicted_tokens - O_c) * (n + 1) * self.l2
        grown = members + [q]
        t_hat = self.ctx.estimator.estimate(n + 1, max(r.input_tokens for r in grown),
                                            max(r.predicted_tokens for r in grown))
        t_l = self.l1 * sum(max(0.0, t_hat - (r.deadline - now)) for r in grown)
        return t_l, t_o

    def _first_batch(self, now: float) -> tuple[list[int], list[ProfiledRequest]]:
        """The greedy pass up to the first batch it closes: (positions in _pending, members)."""
        pend = self._pending
        head = pend[0][3]
        key = head.batch_key
        plan = self.ctx.plan()
        plan.add(head.input_tokens, head.planned_tokens)
        est = self.ctx.estimator.estimate
        w1, w2, l1, l2, thr = self.w1, self.w2, self.l1, self.l2, self.threshold
        cap = self.max_batch_size
        pos, members = [0], [head]
        L_c, O_c = head.input_tokens, head.predicted_tokens
        slacks = [head.deadline - now]   # ascending: pending is sorted by deadline
        prefix = [0.0, slacks[0]]        # prefix[k] = Σ slacks[:k]
        for j in range(1, len(pend)):
            q = pend[j][3]
            if q.batch_key != key:
                continue
            n = len(members)
            if cap is not None and n >= cap:
                break
            L, G = max(L_c, q.input_tokens), max(O_c, q.predicted_tokens)
            if not plan.fits_with(q.input_tokens, q.planned_tokens):
                break
            total = 0.0
            if w2:
                total += w2 * abs(q.predicted_tokens - O_c) * (n + 1) * l2
            if w1:
                t_hat = est(n + 1, L, G)
                s_q = q.deadline - now
                k = bisect_left(slacks, t_hat)  # members with slack < T̂ overrun by T̂ − slack
                over = k * t_hat - prefix[k] + max(0.0, t_hat - s_q)
                total += w1 * l1 * over
            if total > thr:
                break
            pos.append(j)
            members.append(q)
            plan.add(q.input_tokens, q.planned_tokens)
            L_c, O_c = L, G
            slacks.append(q.deadline - now)
            prefix.append(prefix[-1] + slacks[-1])
        return pos, members

    def _next_open(self, now: float) -> NextOpen | None:
        if not self._pending:
            return None
        return NextOpen((self._pending[0][0],), lambda: self._take(now))

    def _take(self, now: float) -> Batch:
        """Remove the first batch of the greedy pass from the queue and return it."""
        pos, members = self._first_batch(now)
        if pos[-1] == len(pos) - 1:   # a prefix: the common case (one batch key)
            del self._pending[:len(pos)]
        else:
            taken = set(pos)
            self._pending = [e for i, e in enumerate(self._pending) if i not in taken]
        return Batch(id=new_id("b"), requests=members, created=now)


class SLODBSPolicy(SLOODBSPolicy):
    """SLO-DBS: only the SLO-overrun term (w2 = 0)."""

    def __init__(self, ctx: PolicyContext, w1: float = 1.0, **kw: float) -> None:
        kw.pop("w2", None)
        super().__init__(ctx, w1=w1, w2=0.0, **kw)


class ODBSPolicy(SLOODBSPolicy):
    """ODBS: only the output-length term (w1 = 0)."""

    def __init__(self, ctx: PolicyContext, w2: float = 1.0, **kw: float) -> None:
        kw.pop("w1", None)
        super().__init__(ctx, w1=0.0, w2=w2, **kw)
