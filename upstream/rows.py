"""An upstream instance's rows and groups: what ``upstream.admission`` admits, streams (or
releases to a gateway) and reports, and the rule of what a row's KV and budget are."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from batcher.prefix_groups import shared_by_longer_lived
from batcher.prefix_pages import page_hashes
from cohort.types import Batch, ProfiledRequest
from workers.continuous_loop import GroupHandle
from workers.step_outputs import StepOutput


@dataclass
class Row:
    """One request while its group is on the server: what it streamed so far."""

    req: ProfiledRequest
    prompt_ids: list[int]
    group: AdmissionGroup
    new_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    task: asyncio.Task | None = None
    ended: bool = False
    released: bool = False  # streamed by its gateway (``protocol.Release``), not by this worker
    handed_back: bool = False  # evicted: it continues elsewhere, so it did not show its length here
    heard_at: float = 0.0   # released: when its gateway last reported on it (monotonic)
    _pages: list[int] | None = field(default=None, repr=False)

    def pages(self, page_tokens: int) -> list[int]:
        """Its prompt's page keys at the engine's page size (one engine: computed once), which rows
        running beside it may share (``batcher.prefix_groups.shared_by_longer_lived``)."""
        if self._pages is None:
            ids = self.prompt_ids
            self._pages = page_hashes(ids, page_tokens) if 0 < page_tokens <= len(ids) else []
        return self._pages

    @property
    def context(self) -> int:
        return len(self.prompt_ids) + len(self.req.generated_ids) + len(self.new_ids)

    def held_context(self, unsent: int) -> int:
        """The KV the server may hold for it: its context plus up to ``unsent`` tokens generated but
        not yet sent (a server that streams in chunks sends the first token and the last at once,
        the others ``unsent + 1`` at a time). Planning with what arrived alone credits each row with
        less KV than it holds, by a different amount per row, and a set planned to the last page
        overfills the server, which then preempts a row. A released row's first token is not sent
        at once either: its gateway reports it with the next progress."""
        return self.context + (min(unsent, self.remaining - 1) if self.new_ids or self.released else 0)

    @property
    def remaining(self) -> int:
        """Tokens planning still reserves for it (``workers.rows.RowState.planned_remaining``)."""
        return max(1, self.planned - len(self.new_ids))

    @property
    def planned(self) -> int:
        """Tokens planning reserved for this run of it."""
        return self.req.run_plan_tokens

    @property
    def limit(self) -> int:
        """Tokens it may still generate: an emulated length (benchmarks) or max_tokens."""
        e = self.req.emulated_tokens
        return self.req.max_tokens if e is None else max(1, min(e, self.req.max_tokens))


def shared_tokens(rows: list[Row], page_tokens: int) -> list[int]:
    """Tokens of each row's prompt that the server holds once for rows that share them (the one
    rule: ``batcher.prefix_groups.shared_by_longer_lived``), left out of the rows' KV."""
    return shared_by_longer_lived([r.pages(page_tokens) for r in rows], [r.remaining for r in rows],
                                  [len(r.prompt_ids) for r in rows], page_tokens)


@dataclass
class AdmissionGroup:
    """One admission group (a batch the batcher sent) and what its rows produced since the last flush."""

    batch: Batch
    handle: GroupHandle
    rows: list[Row] = field(default_factory=list)
    admitted_at: float | None = None  # wall time of the admission (the rows' queue time ends there)
    told_admitted: bool = False
    out: StepOutput = field(default_factory=StepOutput)
    generated: int = 0
    dirty: bool = False

    @property
    def admitted(self) -> bool:
        return self.admitted_at is not None

    @property
    def alive(self) -> list[str]:
        return [r.req.id for r in self.rows if not r.ended]


@dataclass
class PlanReach:
    """How far planned lengths ran past what rows then generated, over the rows that ended here
    (older rows fading): the overcommit an engine that queues and preempts may be judged with
    (``batcher.kv_judge.KVJudge.overcommit``), up to a cap. Plans are upper bounds, so rows hold
    less KV than planned, by as much as this measures; where plans are exact it stays 0 and the
    engine is never planned past its KV."""

    planned: float = 0.0
    generated: float = 0.0
    keep: float = 0.98  # each ended row's weight decays by this per later row: about the last 50 rows count

    def add(self, row: Row) -> None:
        self.planned = self.planned * self.keep + row.planned
        self.generated = self.generated * self.keep + len(row.new_ids)

    def overcommit(self, cap: float) -> float:
        return max(0.0, min(cap, self.planned / self.generated - 1.0)) if self.generated > 0 else 0.0


@dataclass
class ReportPace:
    """How many tokens a second a released row streams, from its gateway's progress reports (older
    reports fading): what a row may hold beyond what was last reported. A gateway reports progress
    once every ``COHORT_UPSTREAM_REPORT_S`` (0.25 s), and a GPU engine streams tens of tokens a row
    in that time; planning with the last report alone credits every row with that much less KV
    than it holds, the same undercount a chunked stream makes (``Row.held_context``)."""

    rate: float = 0.0  # tokens a second, per row
    keep: float = 0.9  # each report's weight decays by this per later report

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.rate = tokens / seconds if self.rate == 0 else self.keep * self.rate + (1 - self.keep) * tokens / seconds

    def unreported(self, row: Row, now: float) -> int:
        """Tokens ``row`` may have streamed since its gateway last reported on it (``now``: monotonic),
        once a report said it streams: before that it may still wait in the engine's queue, holding
        its prompt alone, and charging it the pace would plan it at up to twice its length."""
        return int(self.rate * max(0.0, now - row.heard_at)) if row.released and row.new_ids else 0
