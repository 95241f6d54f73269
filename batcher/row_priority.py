"""Background rows give way to urgent ones inside the continuous engine.

Why: a batch job's rows (``offline.runner``, priority ``COHORT_OFFLINE__PRIORITY``) and interactive
requests (priority 0) share an instance's running set. On a CPU a decode step's time grows with
every row in it, so background rows beside an interactive one slow each of its steps (2.5× its
p50 latency, docs/notes/batch.md) however strictly the batcher orders the queue. So at each step:

- the most urgent priority present (the lowest number among the rows running, waiting to resume
  or waiting to be admitted) runs every step;
- a less urgent level *yields*: it runs in a share of the steps. At a gap of ``span`` or more
  (``COHORT_OFFLINE__PRIORITY``: a young job's rows beside interactive ones) that share is what
  keeps the urgent rows' mean step time within ``slowdown`` of their time alone, measured here
  (``observe``: step times with and without yielding rows): if a step with them costs ``t_mixed``
  and one without ``t_alone``, the share is ``slowdown * t_alone / (t_mixed - t_alone)``, at least
  ``min_duty`` — small on a CPU, where each row lengthens a step, near every step on a GPU, where
  a few more rows cost almost nothing. As the gap closes the share rises linearly to every step:
  the job runner raises a job's rows towards priority 0 as its completion window nears
  (``offline.runner.row_priority``), so the ramp that reorders the queue also gives the job more
  steps here, and a job under steady interactive load still progresses;
- a yielding level's steps are spread evenly by a credit per level (deterministic; every row of
  a level runs in the same steps, so the slow steps are few rather than every step a bit slower).

A yielding row stays resident (its KV pages kept) and skips the step; groups join most urgent
first, a yielding one too (to wait resident: groups waiting to join count against the batcher's
lookahead, ``COHORT_CONTINUOUS__LOOKAHEAD``, and would hold up the next interactive batch); a row
evicted while it yields resumes only in its level's steps; when an urgent row needs a page the
victim comes from the least urgent level (``least_urgent``). With one level present nothing changes: a job alone
runs at full speed. Plain Python, no torch: the simulator can apply the same rule.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

EMA = 0.1  # weight of the newest step in the measured step times
LOG_EVERY = 500  # steps with yielding rows between two log lines of the measured share


@dataclass
class StepShares:
    """Which priority levels run at each step; call ``running`` once per step, then ``observe``."""

    span: int = 10           # the priority gap at which a yielding level's share is the base share
    slowdown: float = 0.1    # how much yielding rows may lengthen the urgent rows' mean step time
    min_duty: float = 0.0    # the base share's floor
    credit: dict[int, float] = field(default_factory=dict)  # per yielding level: its share accrued
    t_alone: float | None = None  # mean step seconds, the most urgent level alone while others wait
    t_mixed: float | None = None  # mean step seconds, yielding levels running beside it
    _top: int | None = None
    _seen: int = 0

    def base(self) -> float:
        """The share of steps the least urgent levels run (see the module docstring)."""
        if self.t_alone is None or self.t_mixed is None:
            share = self.slowdown  # not measured yet: a first guess, measured within a few steps
        elif self.t_mixed <= self.t_alone * (1.0 + self.slowdown):
            share = 1.0
        else:
            share = self.slowdown * self.t_alone / (self.t_mixed - self.t_alone)
        return min(1.0, max(self.min_duty, share))

    def duty(self, gap: int) -> float:
        """The share of steps a level ``gap`` priorities less urgent than the most urgent one runs."""
        if gap <= 0:
            return 1.0
        base = self.base()
        if self.span <= 0 or gap >= self.span:
            return base
        return 1.0 - (1.0 - base) * gap / self.span

    def running(self, levels: Iterable[int]) -> set[int]:
        """The levels whose rows run this step, given every level present (rows running, waiting
        or resuming). A level that left forgets its credit; one that returns starts afresh."""
        present = set(levels)
        if not present:
            self.credit.clear()
            self._top = None
            return set()
        top = self._top = min(present)
        run = {top}
        credit = {}
        for p in sorted(present - {top}):
            c = self.credit.get(p, 0.0) + self.duty(p - top)
            if c >= 1.0 - 1e-9:
                run.add(p)
                c -= 1.0
            credit[p] = c
        self.credit = credit
        return run

    def observe(self, seconds: float, ran: set[int]) -> None:
        """A step took ``seconds`` running rows of the levels ``ran``: it updates ``t_alone`` (only
        the most urgent level ran while others yielded) or ``t_mixed`` (others ran beside it).
        Steps without the most urgent level, or with one level present, say nothing."""
        if self._top is None or self._top not in ran or not self.credit:
            return
        if ran == {self._top}:
            self.t_alone = seconds if self.t_alone is None else (1 - EMA) * self.t_alone + EMA * seconds
        else:
            self.t_mixed = seconds if self.t_mixed is None else (1 - EMA) * self.t_mixed + EMA * seconds
        self._seen += 1
        if self._seen % LOG_EVERY == 0:
            log.info("yielding rows run in %.3f of the steps: a step takes %.1f ms with them, %.1f ms without",
                     self.base(), 1e3 * (self.t_mixed or 0.0), 1e3 * (self.t_alone or 0.0))


def least_urgent(priorities: dict[str, int]) -> list[str]:
    """The row ids of the least urgent level (the highest priority number): where an eviction for
    an urgent row's page takes its victim, so background rows go before interactive ones."""
    if not priorities:
        return []
    worst = max(priorities.values())
    return [rid for rid, p in priorities.items() if p == worst]
