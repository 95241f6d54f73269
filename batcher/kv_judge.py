"""The one KV judge: does a batch, a decode step, a running set or a row alone fit an instance.

Every "fits" in cohort is answered here, in tokens, over one capacity: the batcher's policies
(a batch's peak under its execution mode, grown incrementally by ``KVPlan``), the gateway (a
request alone, static β·(L+G)), the padded decode loop (its next step), the continuous running
set (its rows plus a joining group, ``batcher.running_set``), the upstream loop (the same, under
the server's KV) and the simulator (the same running set). ``KVMemory.judge`` builds it from Θ/Δ;
the token arithmetic (peaks, page rounding) is ``batcher.elastic``'s.

``KVPlan`` is the batch rule in incremental form: policies grow a batch one request at a time and
ask "does it still fit with p?" thousands of times per dispatch, so the test answers from O(1)
bounds whenever they decide it and falls back to the exact peak (O(β)) only in between.
``grow_bounds`` states those bounds once over NumPy columns (the WMA policy tests every open batch
at once) and ``KVPlan.fits_with`` writes them out for scalars (it runs ~10⁶ times per
simulation); tests check both against ``batcher.elastic.batch_kv_tokens`` by brute force.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batcher.elastic import admission_kv_tokens, batch_kv_tokens, next_step_kv_tokens, peak_and_rank
from batcher.row_cost import DecodeStepCost, row_pays


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` KV entries (ceiling division; 0 tokens need 0 pages)."""
    return -(-tokens // page_size)


@dataclass(frozen=True)
class KVJudge:
    """One instance's (or a pool's smallest) KV capacity and the rules that ask it.

    ``page_tokens``: its KV page (1 for a padded cache); ``max_rows``: most rows running at once
    (vLLM's max_num_seqs); ``marginal_cost``: a joining row must still pay for itself on the
    instance's step cost (``batcher.row_cost.row_pays``; 0 = off); ``overcommit``: the share of
    capacity a running set's plan may exceed it by (0 = none; see ``running_set_fits``)."""

    capacity_tokens: int
    page_tokens: int = 1
    max_rows: int = 1 << 30
    marginal_cost: float = 0.0
    overcommit: float = 0.0

    def fits(self, size: int, input_len: int, gen_len: int) -> bool:
        """β·(L+G) tokens within capacity: the static rule, the gateway's "can it ever run here"
        (one request with its max_tokens) and the worker's profiling grid."""
        return int(size) * (int(input_len) + int(gen_len)) <= self.capacity_tokens

    def batch_fits(self, input_len: int, gen_lens: Sequence[int], elastic: bool) -> bool:
        """A batch with L(B)=input_len and these planned lengths fits, at its peak when elastic."""
        return batch_kv_tokens(input_len, gen_lens, elastic) <= self.capacity_tokens

    def plan(self, elastic: bool) -> KVPlan:
        """An empty incremental batch under this capacity (see ``KVPlan``)."""
        return KVPlan(self.capacity_tokens, elastic)

    def next_step_fits(self, alive_rows: int, cache_len: int) -> bool:
        """The padded decode loop: its rows each append one entry to a cache of ``cache_len``."""
        return next_step_kv_tokens(alive_rows, cache_len) <= self.capacity_tokens

    def alone_fits(self, tokens: int) -> bool:
        """A row of ``tokens`` KV entries fits the page pool with nothing else in it."""
        return pages_for(tokens, self.page_tokens) * self.page_tokens <= self.capacity_tokens

    def running_set_fits(self, contexts: Sequence[int], remaining: Sequence[int],
                         step_cost: DecodeStepCost | None = None, shared: Sequence[int] = ()) -> bool:
        """Whether a continuous instance may run these rows together (its running rows plus a
        joining group, each row's context and planned remaining tokens): their planned KV
        (``batcher.elastic.admission_kv_tokens``) within capacity, at most ``max_rows`` of them,
        and the last row still paying for itself on ``step_cost``: past the point where a step is
        bound by the rows themselves, another row adds little throughput but slows every other row,
        and with shortest-first admission the rows kept out are the long ones (simulator,
        saturated Magnus trace: 0.73 -> 0.70x cb-fcfs mean latency on V100 / ChatGLM-6B, no change
        on H100 / Llama-7B; docs/notes/benchmarks.md). An empty instance is the callers' case: it takes
        any group.

        ``overcommit`` lets the plan exceed the capacity by that share. Only an engine that queues
        and preempts on its own should be judged so (an upstream server with priority scheduling):
        a plan is a peak at planned lengths, which are upper bounds, so the pages are held less
        than planned; a row that does not fit when it arrives waits in the engine's queue in
        cohort's order, and one that outgrows it is the lowest-priority row, the latest admitted,
        preempted and recomputed from its short context — cheaper than holding every row back
        (docs/notes/fleet.md). The built-in engine keeps 0: it has no queue of its own.

        ``shared``: tokens of each row's context held once for rows that share them
        (``batcher.prefix_groups.shared_by_longer_lived``): left out of the KV, not of the step cost
        (each row still attends over its whole context)."""
        kv = [c - s for c, s in zip(contexts, shared, strict=True)] if shared else contexts
        return (len(contexts) <= self.max_rows
                and admission_kv_tokens(kv, remaining, self.page_tokens)
                <= self.capacity_tokens * (1.0 + self.overcommit)
                and row_pays(step_cost, len(contexts), sum(contexts), self.marginal_cost))


def grow_bounds(budget: int, elastic: bool, size: Any, L_B: Any, G_B: Any, g_min: Any, peak: Any, k_peak: Any,
                L: Any, g: Any, mx: Callable[[Any, Any], Any] = max,
                mn: Callable[[Any, Any], Any] = min) -> tuple[Any, Any]:
    """(surely fits, may fit) for adding a request (L, g) to a batch (scalars, or NumPy columns
    with ``mx=np.maximum, mn=np.minimum``).

    The batch is described by β (``size``), L(B), G(B) = its largest planned length, ``g_min``
    its smallest, ``peak`` = its KV peak at L(B) and ``k_peak`` the rank k where that peak is
    reached. With L' = max(L(B), L):

    * static: β'·(L'+G') is exact, both answers are equal;
    * elastic, upper bounds (fits if one holds): the static MEM; and, since every old term
      k·(L'+g_k) ≤ peak + β·(L'−L(B)) and a term pushed one rank down grows by at most L'+g,
      max(peak + β·(L'−L(B)) + [g > g_min]·(L'+g), (β+1)·(L'+g));
    * elastic, lower bound (cannot fit if it fails): the old peak's term at L', and the last
      rank's term (β+1)·(L' + min(g, g_min)).
    """
    Lp = mx(L_B, L)
    static = (size + 1) * (Lp + mx(G_B, g)) <= budget
    if not elastic:
        return static, static
    grown = peak + size * (Lp - L_B)
    upper = mx(grown + (g > g_min) * (Lp + g), (size + 1) * (Lp + g))
    lower = mx(peak + k_peak * (Lp - L_B), (size + 1) * (Lp + mn(g, g_min)))
    return static | (upper <= budget), lower <= budget


class KVPlan:
    """A batch being assembled, kept in the form the memory rule needs to grow it exactly.

    Holds L(B), the planned lengths sorted, the peak KV tokens and where it is reached, so
    ``fits_with`` is O(1) when the bounds decide and O(β) otherwise. Empty plans accept anything
    (a request that cannot fit alone is the gateway's and the worker's to refuse).
    """

    __slots__ = ("budget", "elastic", "L", "lens", "peak", "k_peak")

    def __init__(self, budget: int, elastic: bool) -> None:
        self.budget = int(budget)
        self.elastic = elastic
        self.L = 0
        self.lens: list[int] = []   # planned lengths, ascending
        self.peak = 0
        self.k_peak = 0

    @property
    def size(self) -> int:
        return len(self.lens)

    def _exact(self, L: int, g: int) -> tuple[int, int]:
        """(KV tokens, rank of the peak) of this batch plus (L, g): the definition."""
        Lp = max(self.L, L)
        lens = self.lens
        if not self.elastic:   # β'·(L' + G'), i.e. static_kv_tokens without building the list
            n1 = len(lens) + 1
            return n1 * (Lp + (lens[-1] if lens and lens[-1] > g else g)), n1
        if lens and g <= lens[0] and Lp == self.L:   # g takes the last rank, the others keep theirs
            last = (len(lens) + 1) * (Lp + g)
            return (last, len(lens) + 1) if last > self.peak else (self.peak, self.k_peak)
        return peak_and_rank(Lp, [*lens, g])

    def fits_with(self, L: int, g: int) -> bool:
        """Would the batch plus a request of L(p)=L, planned length g still fit Θ?"""
        lens = self.lens
        if not lens:
            return True
        if not self.elastic:   # the static rule is its own bound: answer in O(1)
            return (len(lens) + 1) * ((self.L if self.L > L else L) + (lens[-1] if lens[-1] > g else g)) <= self.budget
        # grow_bounds' elastic bounds, written out for scalars (this runs ~10⁶ times per simulation)
        n, L_B, g_min, budget = len(lens), self.L, lens[0], self.budget
        Lp = L_B if L_B > L else L
        if (n + 1) * (Lp + (lens[-1] if lens[-1] > g else g)) <= budget:
            return True
        grown = self.peak + n * (Lp - L_B) + ((Lp + g) if g > g_min else 0)
        if grown <= budget and (n + 1) * (Lp + g) <= budget:
            return True
        if self.peak + self.k_peak * (Lp - L_B) > budget or (n + 1) * (Lp + (g if g < g_min else g_min)) > budget:
            return False
        return self._exact(L, g)[0] <= budget

    def add(self, L: int, g: int) -> None:
        """Put the request in (whether it fits is the caller's question, asked before)."""
        self.peak, self.k_peak = self._exact(L, g)
        if L > self.L:
            self.L = L
        insort(self.lens, g)

    def tokens(self) -> int:
        """The batch's KV tokens under this plan's execution mode (its peak when elastic)."""
        return self.peak
