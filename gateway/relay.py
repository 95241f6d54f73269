"""Following an admitted request to its answer: text as it is generated, then the end — or a
failure, or a withdrawal when the client leaves or the deadline passes.

Streaming and non-streaming requests take the same path (``Relay.pieces``); a non-streaming one
just keeps the end event's whole text (``Relay.collect``). So both are measured alike (TTFT,
inter-token latency, queue time, end-to-end latency) and both are withdrawn alike.

Replays: the batcher resumes a lost batch's rows after the tokens their streams already carry,
so a re-run should not repeat text; as a safety net, ``tokens`` (the count so far) tells a repeat
apart: a delta that does not advance past what was relayed is dropped. At the end the relayed text is reconciled with the end event's
whole text: a missing tail is relayed before the finish, so what a client concatenates is the
answer whenever the relayed text is a prefix of it (always, for greedy decoding).

Logprobs (when asked for) ride on the deltas, one per token id; a piece carries those of the
tokens since the previous piece (deltas without text — a held-back stop string, static
execution — hand theirs to the next piece), and the answer keeps them all.

Withdrawal (``withdraw``) happens exactly once per request that ends without a final event,
whatever ended it: the reader's deadline or disconnect check, or the consumer closing or
cancelling the iterator (Starlette cancels a streaming response whose client went away).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from starlette.concurrency import run_in_threadpool

from cohort import bus
from cohort.logdb import finish_request
from cohort.protocol import FailureCode, FinishReason, StreamEvent, StreamKind
from cohort.types import ProfiledRequest
from gateway.errors import APIError
from gateway.stream import Withdrawn, read_events
from gateway.stream_hub import hub_for

log = logging.getLogger("cohort.gateway")

# The ``reason`` label of the cancelled-requests counter.
CANCEL_REASONS = {FailureCode.CANCELLED: "disconnect", FailureCode.TIMEOUT: "timeout"}


@dataclass
class Ticket:
    """An admitted, enqueued request and the clocks its answer is measured against
    (``time.monotonic()`` instants)."""

    request: ProfiledRequest
    endpoint: str
    received: float   # the HTTP request arrived: TTFT and end-to-end latency start here
    deadline: float   # the gateway gives up and withdraws the request
    pool: str = "default"  # the model pool it was queued in (its cancels go there)


@dataclass
class Piece:
    """New text of an answer and the (token id, TokenLogprob) pairs of the tokens it stands for
    (empty unless the request asked for logprobs)."""

    text: str
    logprobs: list[tuple[int, list]] = field(default_factory=list)


@dataclass
class Answer:
    """The end of a request's stream."""

    text: str
    tokens: int
    finish_reason: str
    batch_id: str
    batch_size: int
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: list[tuple[int, list]] = field(default_factory=list)  # every token's, when asked for
    # the prompt's ids and one PromptLogprob (None first) per id, when asked for
    prompt: tuple[list[int], list] | None = None
    cached_tokens: int = 0   # prompt tokens the instance's prefix cache had

    @classmethod
    def from_event(cls, ev: StreamEvent) -> Answer:
        return cls(ev.text, ev.tokens, ev.finish_reason or FinishReason.STOP.value, ev.batch_id or "",
                   ev.batch_size or 0, dict(ev.timings), cached_tokens=ev.cached_tokens)


class RequestMetrics:
    """What the choices of one HTTP request share for the per-request series (the vLLM names):
    its first token is the first of any choice, its end the last choice's, and a withdrawal
    counts once. Each choice's own observations go to the ``cohort_choice_*`` series."""

    def __init__(self, choices: int = 1) -> None:
        self.left = choices
        self.first_token = False
        self.cancelled = False
        self.queued_s: float | None = None


async def withdraw(app_state, ticket: Ticket, code: FailureCode, group: RequestMetrics | None = None) -> None:
    """Record why in the log DB, tell the batcher and the worker to drop the request, count it.
    The record comes first (as the worker records before it answers): whoever sees the
    withdrawal in Redis finds its status. It overrules a status already written (a worker that
    finished the row as the deadline passed): the record says what the client saw."""
    rid = ticket.request.id
    error = ("the client disconnected" if code is FailureCode.CANCELLED
             else f"no answer within {app_state.settings.request_timeout_s:g} s")
    await run_in_threadpool(finish_request, app_state.db, rid, overrule=True, status=code.value, error=error)
    if (direct := getattr(app_state, "direct", None)) is not None:
        direct.cancel(rid)  # its engine stream, where this gateway runs it, closes now
    pipe = app_state.redis.pipeline()
    bus.cancel(pipe, rid, ticket.pool)
    await pipe.execute()
    m = app_state.metrics
    m.choices_cancelled.labels(ticket.endpoint, CANCEL_REASONS[code]).inc()
    if group is None or not group.cancelled:
        m.cancelled.labels(ticket.endpoint, CANCEL_REASONS[code]).inc()
        if group is not None:
            group.cancelled = True


def _withdrawn_error(code: FailureCode, timeout_s: float) -> APIError:
    if code is FailureCode.TIMEOUT:
        return APIError(code.http_status, f"no answer within {timeout_s:g} s; the request was withdrawn",
                        code=code.value)
    return APIError(code.http_status, "the client disconnected", code=code.value)


class Relay:
    """One request's answer as it arrives. Iterate ``pieces()`` once (or ``collect()``)."""

    def __init__(self, app_state, ticket: Ticket,
                 disconnected: Callable[[], Awaitable[bool]] | None = None,
                 group: RequestMetrics | None = None) -> None:
        self.st, self.ticket, self.disconnected = app_state, ticket, disconnected
        self.group = group or RequestMetrics()  # shared by the choices of one HTTP request
        self.sent = ""              # text relayed so far
        self.sent_tokens = 0        # tokens that text stands for
        self.answer: Answer | None = None
        self.scored_tokens = 0      # tokens whose logprobs were received
        self.logprobs: list[tuple[int, list]] = []   # all of them, in order
        self._unsent_logprobs: list[tuple[int, list]] = []
        self.prompt: tuple[list[int], list] | None = None  # the prompt's logprobs, when asked for
        self._settled = False       # the request ended: answered, failed or withdrawn
        self._last_at: float | None = None
        self._itl = None  # the ITL histogram's child for this endpoint

    async def pieces(self) -> AsyncIterator[Piece]:
        """New text in order; ``self.answer`` is set when it ends. Raises APIError when the
        request fails or is withdrawn (499 client gone, 504 deadline)."""
        t, m = self.ticket, self.st.metrics
        direct = getattr(self.st, "direct", None)
        local = direct is not None and t.request.owner == direct.gateway_id  # its tokens come from here
        try:
            events = read_events(hub_for(self.st), t.request.id, t.deadline,
                                 self.st.settings.disconnect_check_s, self.disconnected, wake=not local)
            async with contextlib.aclosing(events):  # its stream is dropped from the hub at once
                async for ev in events:
                    if ev.kind is StreamKind.DELTA:
                        if ev.prompt_logprobs and self.prompt is None:  # a re-run may send them again
                            self.prompt = (ev.prompt_ids, ev.prompt_logprobs)
                        self._take_logprobs(ev)
                        if ev.tokens > self.sent_tokens and ev.text:
                            self._observe_tokens(ev.tokens)
                            self.sent, self.sent_tokens = self.sent + ev.text, ev.tokens
                            yield self._piece(ev.text)
                        continue
                    self._settled = True
                    if ev.kind is StreamKind.ERROR:
                        code = FailureCode.parse(ev.code)
                        m.failures.labels(t.endpoint, code.value).inc()
                        raise APIError(code.http_status, ev.message or "the request failed", code=code.value)
                    answer = Answer.from_event(ev)
                    answer.logprobs, answer.prompt = self.logprobs, self.prompt
                    if answer.text.startswith(self.sent):
                        if tail := answer.text[len(self.sent):]:
                            self._observe_tokens(answer.tokens)
                            self.sent, self.sent_tokens = answer.text, answer.tokens
                            yield self._piece(tail)
                    else:
                        log.warning("request %s: relayed text is not a prefix of its answer (a sampled re-run "
                                    "after a worker loss?)", t.request.id)
                    if self._unsent_logprobs:
                        yield self._piece("")
                    self._finish(answer)
                    return
        except Withdrawn as w:
            self._settled = True
            with anyio.CancelScope(shield=True):  # the client leaving also cancels us: finish the withdrawal
                await withdraw(self.st, t, w.code, self.group)
            raise _withdrawn_error(w.code, self.st.settings.request_timeout_s) from None
        finally:
            await self.abandon()  # closed or cancelled by the consumer: the client went away
            if direct is not None:
                direct.forget(t.request.id)

    async def abandon(self) -> None:
        """Withdraw the request as cancelled unless it already ended; safe to call more than once
        and from a cancelled task (shielded: Starlette cancels a stream whose client left)."""
        if self._settled:
            return
        self._settled = True
        with anyio.CancelScope(shield=True):
            try:
                await withdraw(self.st, self.ticket, FailureCode.CANCELLED, self.group)
            except Exception:  # never mask why the consumer stopped
                log.exception("request %s: withdrawal failed", self.ticket.request.id)

    def _take_logprobs(self, ev: StreamEvent) -> None:
        """Keep the logprobs of tokens not seen before (a re-run may repeat a delta)."""
        new = ev.tokens - self.scored_tokens
        if not ev.logprobs or new <= 0:
            return
        pairs = list(zip(ev.ids, ev.logprobs, strict=False))[-new:]
        self.logprobs += pairs
        self._unsent_logprobs += pairs
        self.scored_tokens = ev.tokens

    def _piece(self, text: str) -> Piece:
        piece = Piece(text, self._unsent_logprobs)
        self._unsent_logprobs = []
        return piece

    async def collect(self) -> Answer:
        """Read to the end (a non-streaming request)."""
        async for _ in self.pieces():
            pass
        assert self.answer is not None
        return self.answer

    def _observe_tokens(self, tokens: int) -> None:
        now, t, m = time.monotonic(), self.ticket, self.st.metrics
        if self._last_at is None:
            m.choice_ttft.labels(t.endpoint).observe(now - t.received)
            if not self.group.first_token:
                self.group.first_token = True
                m.ttft.labels(t.endpoint).observe(now - t.received)
        else:
            if self._itl is None:  # the labelled child, looked up once (this runs for every event)
                self._itl = m.itl.labels(t.endpoint)
            self._itl.observe((now - self._last_at) / max(1, tokens - self.sent_tokens))
        self._last_at = now

    def _finish(self, answer: Answer) -> None:
        t, m = self.ticket, self.st.metrics
        self.answer = answer
        m.choice_latency.labels(t.endpoint).observe(time.monotonic() - t.received)
        g = self.group
        if "queued_s" in answer.timings:
            g.queued_s = answer.timings["queued_s"] if g.queued_s is None else min(g.queued_s, answer.timings["queued_s"])
        g.left -= 1
        if g.left == 0:  # the request's last choice: its end is the request's
            m.latency.labels(t.endpoint).observe(time.monotonic() - t.received)
            if g.queued_s is not None:
                m.queue_time.labels(t.endpoint).observe(g.queued_s)
