"""From a row's tokens to what its client reads: incremental text, stop strings, deltas, answers.

Why apart from ``workers.rows``: choosing tokens is the decode thread's job, text is not. Under
continuous execution the engine thread only emits ``TokenEvent``s and the instance's publisher
thread renders them here (``GroupHandle.render``), so detokenizing and the stop-string scan never hold
up the rows that decode; a row a stop string ends is then cancelled in the engine, whose next
token or two for it are ignored. The padded loop renders each event as it is made (a stop
string ends the row that step). Either way the rules are the ones below: stop strings held back
until they can no longer match, a delta carrying every token id not yet streamed (the stream is
a checkpoint), and, when the caller does not stream (static execution), answers held until
``release``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from cohort.protocol import FinishReason, ScoredIds, TokenLogprob
from cohort.types import ProfiledRequest
from workers.detokenize import IncrementalDetokenizer
from workers.step_outputs import RowResult, StepOutput, TokenEvent


class RowText:
    """One row's text while it runs: what was decoded, streamed, and held back."""

    def __init__(self, req: ProfiledRequest, tokenizer) -> None:
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, req.generated_ids)
        self.max_stop = max((len(s) for s in req.sampling.stop), default=0)
        self.sent = len(self.detok.text()) if req.generated_ids else 0  # chars streamed so far
        self.pending = ""                                             # decoded, held back for stops
        self.unsent_ids: list[int] = []                               # generated, not yet on the stream
        self.unsent_logprobs: list[TokenLogprob] = []                 # one per unsent id (when asked)
        self.scored = req.sampling.logprobs is not None
        self.total_tokens = req.done_tokens
        self.server_text: str | None = None                           # upstream rows: the server's text

    def push(self, ev: TokenEvent) -> str:
        """The text this token adds: decoded here, or as the upstream server rendered it (its
        detokenizer is the reference, and a text-only server's ids are cohort's re-tokenization)."""
        if ev.piece is None:
            return self.detok.push(ev.token)
        if self.server_text is None:
            self.server_text = self.detok.text()
        self.detok.ids.append(ev.token)
        self.server_text += ev.piece
        return ev.piece

    def text(self) -> str:
        return self.detok.text() if self.server_text is None else self.server_text

    def take_ids(self) -> list[int]:
        """The unsent ids (with their logprobs when the request asked for them), now sent."""
        ids = ScoredIds(self.unsent_ids, self.unsent_logprobs) if self.scored else self.unsent_ids
        self.unsent_ids, self.unsent_logprobs = [], []
        return ids


class TextStage:
    """Renders the token events of a set of rows (a batch, or one admission group)."""

    def __init__(self, tokenizer, *, streaming: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.tok, self.streaming, self.clock = tokenizer, streaming, clock
        self.rows: dict[str, RowText] = {}
        self.ended: set[str] = set()                          # answered here: later events are ignored
        self.held: list[tuple[RowText, RowResult]] = []       # not streaming: answers wait for ``release``

    def text_of(self, req: ProfiledRequest) -> RowText:
        t = self.rows.get(req.id)
        if t is None:
            t = self.rows[req.id] = RowText(req, self.tok)
        return t

    def render(self, out: StepOutput) -> list[str]:
        """Turn ``out.tokens`` into deltas and finished rows (in ``out``); the ids of rows a stop
        string ended, which the engine still runs and must cancel."""
        touched: dict[str, RowText] = {}
        stopped = [ev.req.id for ev in out.tokens if self.apply(ev, out, touched)]
        for rid, t in touched.items():  # one delta per row for all its tokens in this output
            if rid in self.rows:
                self.send(t, len(t.pending) - (t.max_stop - 1 if t.max_stop else 0), out)
        out.tokens = []
        for req, _code, _message in out.failed:
            self.forget(req.id)
        return stopped

    def apply(self, ev: TokenEvent, out: StepOutput, touched: dict[str, RowText] | None = None) -> bool:
        """One token (or end) of one row; True when a stop string ended the row here. With
        ``touched`` the row's delta waits there for the caller (``render``: one per row)."""
        rid = ev.req.id
        if rid in self.ended:
            return False
        t = self.text_of(ev.req)
        t.total_tokens = ev.total_tokens
        if ev.token is not None:
            t.unsent_ids.append(ev.token)
            if ev.scored is not None:
                t.unsent_logprobs.append(ev.scored)
            t.pending += t.push(ev)
            if t.max_stop:
                text = t.text()
                for s in ev.req.sampling.stop:
                    cut = text.find(s, max(0, t.sent - len(s)))
                    if cut >= 0:
                        t.pending = text[t.sent:cut]
                        self.finish(t, FinishReason.STOP, ev, out, text=text[:cut])
                        return ev.finish is None
        if ev.finish is not None:
            self.finish(t, ev.finish, ev, out)
            return False
        if touched is not None:
            touched[rid] = t
            return False
        self.send(t, len(t.pending) - (t.max_stop - 1 if t.max_stop else 0), out)
        return False

    def send(self, t: RowText, n: int, out: StepOutput) -> None:
        """Stream the first ``n`` pending characters with every token id not yet streamed (a
        delta may carry ids and no text: held-back text still records the tokens)."""
        if not self.streaming:
            return
        text = t.pending[:max(0, n)]
        if not text and not t.unsent_ids:
            return
        out.deltas.append((t.req, text, t.total_tokens, t.take_ids()))
        t.sent += len(text)
        t.pending = t.pending[len(text):]

    def send_scores(self, t: RowText, out: StepOutput) -> None:
        """Without streaming logprobs have no other way to the client: the row's unsent ids and
        logprobs go out in one delta without text (the end event has the text)."""
        if not self.streaming and t.scored and t.unsent_ids:
            out.deltas.append((t.req, "", t.total_tokens, t.take_ids()))

    def finish(self, t: RowText, reason: FinishReason, ev: TokenEvent, out: StepOutput,
               text: str | None = None) -> None:
        self.send(t, len(t.pending), out)
        done = RowResult(t.req, t.text() if text is None else text, ev.total_tokens, reason,
                         ev.first_token_at, ev.at, ev.cached_tokens)
        self.forget(t.req.id)
        if self.streaming:
            out.finished.append(done)
        else:
            self.held.append((t, done))

    def evict(self, req: ProfiledRequest, out: StepOutput) -> None:
        """The row leaves this batch as a continuation: what it generated is streamed (or its
        logprobs sent) now; its next run starts a fresh text from the ids it carries."""
        t = self.rows.pop(req.id, None)
        if t is not None:
            self.send(t, len(t.pending), out)
            self.send_scores(t, out)

    def forget(self, rid: str) -> None:
        """The row is over (answered, failed): its text goes, later events are ignored."""
        self.rows.pop(rid, None)
        self.ended.add(rid)

    def release(self, out: StepOutput) -> None:
        """Answers held back (no streaming) go out now: that is when each client gets its first
        (and last) text, so both times are the release time."""
        if not self.held:
            return
        now = self.clock()
        for t, res in self.held:
            self.send_scores(t, out)
            out.finished.append(replace(res, first_token_at=now, finished_at=now))
        self.held = []
