"""The one path every generation endpoint takes in: validate, reserve, predict, record, enqueue
(``admit``). The answer is then read from the request's stream by gateway.relay.

Admission control happens before anything is written: a request that tokenizes to nothing or can
never fit an instance of its pool (400), no live instance (503) or a full queue (429 with
``Retry-After``) is refused up front and leaves no trace, so an accepted request is always one
the system can answer — and it is answered, or failed explicitly, by the worker or the batcher.

The queue limit holds under any burst because the depth check and the taking of a slot are one
Redis step (``bus.reserve``): admitted iff incoming + pending + reserved < ``COHORT_MAX_PENDING``,
or the request is more urgent (lower ``priority``) than the least urgent one waiting, which the
batcher then sheds. The log-DB row is written while the slot is reserved and before the push
(``bus.enqueue`` drops the reservation in the same transaction), so whoever sees the request in
Redis finds its record, and a request that fails between the two steps gives its slot back and
its record says ``failed`` — what its client is answered.

Every check, the tokenizer, the queue and the keys are those of the pool the request's ``model``
names (gateway.pools).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace

import anyio
from starlette.concurrency import run_in_threadpool

from batcher.memory import KVMemory
from cohort import bus
from cohort.logdb import finish_request
from cohort.protocol import dumps
from cohort.settings import Settings
from cohort.tokenizer import build_prompt, prompt_token_ids, tokenizer_loaded, vocab_size
from cohort.types import ProfiledRequest, SamplingParams, new_id
from gateway import reattach
from gateway.admission_records import AdmissionRecords
from gateway.errors import APIError
from gateway.pools import PoolView, ServedModel
from gateway.relay import Ticket
from predictor.base import PredictItem

__all__ = ["PoolView", "Submission", "admit", "admit_many", "check_token_ids"]

log = logging.getLogger("cohort.gateway")
# Prompts up to this many characters are tokenized on the event loop (~0.3 ms at most for a fast
# tokenizer): the hand-off to a thread and back cost more CPU than that (measured ~0.1-0.2 ms) and
# a thread wake of latency. Longer ones, and a tokenizer not yet loaded, go to a thread.
INLINE_TOKENIZE_CHARS = 1000


@dataclass
class Submission:
    """A validated request, before it is profiled. ``instruction`` and ``user_input`` are what
    the predictor reads; the model reads ``prompt`` when given (a rendered chat template, a
    token-id prompt's text), else ``build_prompt(instruction, user_input)``. ``prompt_ids`` go to
    the worker as they are (token-id prompts, chat templates) and L(p) is their count."""

    instruction: str
    user_input: str
    max_tokens: int
    slo_s: float | None = None
    sampling: SamplingParams = SamplingParams()
    emulated_tokens: int | None = None
    task: str | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    priority: int = 0
    param: str = "input"  # the request field the prompt came from (errors about the prompt name it)

    @property
    def text(self) -> str:
        return self.prompt if self.prompt is not None else build_prompt(self.instruction, self.user_input)

    @property
    def shape(self) -> tuple:
        """What admission checks depend on: copies of one prompt (``n``) are checked once."""
        return (self.text, tuple(self.prompt_ids or ()), self.max_tokens, self.emulated_tokens,
                self.sampling.logit_bias)


def _default_model(s: Settings) -> ServedModel:
    return ServedModel(s.served_model_name or s.model, s.pool, s.model, 0, s.max_input_tokens + s.max_tokens_limit)


async def _check(s: Settings, served: ServedModel, sub: Submission) -> list[int]:
    """Everything about one request that needs no queue: its prompt's token ids (L(p) is their
    count), or an APIError. The worker runs these ids: the prompt is tokenized once, here."""
    if not (sub.instruction or sub.user_input or sub.prompt_ids):
        raise APIError(400, "the request has no text: give an instruction, an input or a prompt",
                       code="empty_prompt", param=sub.param)
    if sub.max_tokens > s.max_tokens_limit:
        raise APIError(400, f"max_tokens {sub.max_tokens} exceeds the limit of {s.max_tokens_limit}",
                       code="invalid_value", param="max_tokens")
    if sub.emulated_tokens is not None:
        if not s.emulate_lengths:
            raise APIError(400, "emulated_tokens is a benchmark feature; the server runs with "
                           "COHORT_EMULATE_LENGTHS=false", code="emulation_disabled", param="emulated_tokens")
        if sub.emulated_tokens > sub.max_tokens:
            raise APIError(400, "emulated_tokens cannot exceed max_tokens", code="invalid_value",
                           param="emulated_tokens")
    for param, ids in (("logit_bias", [t for t, _ in sub.sampling.logit_bias]), ("prompt", sub.prompt_ids or [])):
        await check_token_ids(served, ids, param)
    if sub.prompt_ids is not None:
        ids = list(sub.prompt_ids)
    elif len(text := sub.text) <= INLINE_TOKENIZE_CHARS and tokenizer_loaded(served.path):
        (ids,) = prompt_token_ids([text], served.path)
    else:
        (ids,) = await run_in_threadpool(prompt_token_ids, [text], served.path)
    input_tokens = len(ids)
    if input_tokens == 0:  # " ", "\u200b": text with characters but nothing the model can read
        raise APIError(400, "the prompt is empty once tokenized (only whitespace or invisible characters)",
                       code="empty_prompt", param=sub.param)
    if input_tokens > s.max_input_tokens:
        raise APIError(400, f"the prompt has {input_tokens} tokens; the limit is {s.max_input_tokens}",
                       code="context_length_exceeded", param=sub.param)
    return ids


def within_context(sub: Submission, input_tokens: int, context: int) -> Submission:
    """The request as the pool's context lets it run, as vLLM runs it: a prompt that leaves no room
    for one token is refused; a ``max_tokens`` that does not fit beside the prompt is planned (and
    sent) as what fits, so the answer ends there with ``finish_reason: "length"``."""
    if input_tokens >= context:
        raise APIError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                       f"{input_tokens}, leaving no room to generate", code="context_length_exceeded",
                       param=sub.param)
    room = context - input_tokens
    if sub.max_tokens <= room:
        return sub
    emulated = None if sub.emulated_tokens is None else min(sub.emulated_tokens, room)
    return replace(sub, max_tokens=room, emulated_tokens=emulated)


async def check_token_ids(served: ServedModel, ids: list[int], param: str) -> None:
    """Token ids must name tokens of the pool's vocabulary (checked before anything decodes them)."""
    if not ids:
        return
    vocab = await run_in_threadpool(vocab_size, served.path)
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise APIError(400, f"{param} names token {bad[0]}; the vocabulary of {served.id} has tokens "
                       f"0..{vocab - 1}", code="invalid_value", param=param)


async def admit(app_state, sub: Submission, endpoint: str, received: float | None = None,
                served: ServedModel | None = None) -> Ticket:
    """Validate, predict and enqueue one request, or raise APIError (nothing written then).
    ``received``: when the HTTP request arrived (``time.monotonic()``), for TTFT and latency;
    ``served``: the model (pool) it goes to, default the gateway's own pool."""
    (ticket,) = await admit_many(app_state, [sub], endpoint, received, served)
    return ticket


async def admit_many(app_state, subs: list[Submission], endpoint: str, received: float | None = None,
                     served: ServedModel | None = None) -> list[Ticket]:
    """Admit several requests, all or none (``n`` copies, prompt lists): each is a request of
    its own, and they reach the batcher in one push, so they can share a batch."""
    received = time.monotonic() if received is None else received
    s: Settings = app_state.settings
    redis = app_state.redis
    served = served or _default_model(s)
    checked: dict[tuple, int] = {}
    for sub in subs:
        if sub.shape not in checked:
            checked[sub.shape] = await _check(s, served, sub)
    prompt_ids = [checked[sub.shape] for sub in subs]
    counts = [len(ids) for ids in prompt_ids]
    alive = await app_state.pool.alive(served.pool)
    if not alive:
        raise APIError(503, f"no LLM instance of {served.id} is available yet; retry shortly", code="no_instance")
    subs = [within_context(sub, n, app_state.pool.max_model_len(alive)) for sub, n in zip(subs, counts, strict=True)]
    memory = KVMemory.for_pool(alive)
    for sub, input_tokens in zip(subs, counts, strict=True):
        if not memory.judge().fits(1, input_tokens, sub.max_tokens):
            raise APIError(400, f"prompt ({input_tokens} tokens) + max_tokens ({sub.max_tokens}) need "
                           f"{memory.mem(1, input_tokens, sub.max_tokens)} bytes of KV cache; an instance has "
                           f"{memory.theta_bytes}. Lower max_tokens or shorten the input.",
                           code="context_length_exceeded", param="max_tokens")
    given, attach = await reattach.row_request(app_state, len(subs))
    if attach:  # a job row sent again: follow its request already in the system (gateway.reattach)
        reqs = await _profile(app_state, served, subs, prompt_ids, [given])
        return [Ticket(reqs[0], endpoint, received, time.monotonic() + s.request_timeout_s, served.pool)]
    ids = [given] if given else [new_id("req") for _ in subs]
    priority = min(sub.priority for sub in subs)  # one request's choices share its priority
    admitted, depth = await bus.reserve(redis, served.pool, ids, priority, s.max_pending, time.time())
    if not admitted:
        raise APIError(429, f"the queue of {served.id} is full ({depth} requests waiting); retry later",
                       code="queue_full")
    recorded = False
    try:
        # a Batch API row (it names its request) stays relayed: its stream is what a restarted gateway re-attaches
        reqs = await _profile(app_state, served, subs, prompt_ids, ids, None if given else _owner(app_state, alive))
        await admission_records(app_state).write([_row(served, r) for r in reqs])
        recorded = True
        await bus.enqueue(redis, served.pool, ids, [dumps(r.to_dict()) for r in reqs])
    except BaseException:
        with anyio.CancelScope(shield=True):
            if recorded:  # the client is answered an error: so says the record
                with contextlib.suppress(Exception):
                    for rid in ids:
                        await run_in_threadpool(finish_request, app_state.db, rid, status="failed",
                                                error="not queued: the queue was unavailable")
            with contextlib.suppress(Exception):
                await bus.release(redis, served.pool, ids)
        raise
    deadline = time.monotonic() + s.request_timeout_s
    for req in reqs:
        app_state.metrics.predicted_tokens.observe(req.predicted_tokens)
    return [Ticket(req, endpoint, received, deadline, served.pool) for req in reqs]


def admission_records(app_state) -> AdmissionRecords:
    """The app's group-committing writer of admission records (made on first use, for its log DB)."""
    writer = getattr(app_state, "admission_records", None)
    if writer is None or writer.db is not app_state.db:
        writer = app_state.admission_records = AdmissionRecords(app_state.db)
    return writer


def _owner(app_state, alive: list) -> str | None:
    """This gateway, where it streams an upstream pool's rows from their engines itself
    (COHORT_UPSTREAM_STREAMING=gateway); None: the pool's instances relay them."""
    direct = getattr(app_state, "direct", None)
    return direct.gateway_id if direct is not None and all(i.upstream for i in alive) else None


async def _profile(app_state, served: ServedModel, subs: list[Submission], prompt_ids: list[list[int]],
                   ids: list[str], owner: str | None = None) -> list[ProfiledRequest]:
    """The requests as the batcher reads them: each with its predicted length (one prediction
    per distinct prompt: ``n`` copies share it)."""
    predictions: dict[tuple, tuple] = {}
    reqs: list[ProfiledRequest] = []
    for rid, sub, p_ids in zip(ids, subs, prompt_ids, strict=True):
        input_tokens = len(p_ids)
        key = (sub.instruction, sub.user_input, input_tokens, sub.task, sub.max_tokens)
        if key not in predictions:
            item = PredictItem(sub.instruction, sub.user_input, input_tokens, sub.task)
            predictions[key] = await app_state.predictor.predict_bounds(item, sub.max_tokens, pool=served.path)
        predicted, upper, version = predictions[key]
        if sub.sampling.ignore_eos:  # the client fixed the length: max_tokens, unless a stop string ends it
            predicted, upper = sub.max_tokens, sub.max_tokens
        reqs.append(ProfiledRequest(
            id=rid, prompt=sub.text, input_tokens=input_tokens, predicted_tokens=int(predicted),
            predicted_upper=upper, max_tokens=sub.max_tokens, arrival=time.time(), model=served.path,
            sampling=sub.sampling, slo_s=sub.slo_s, instruction=sub.instruction, user_input=sub.user_input,
            task=sub.task, emulated_tokens=sub.emulated_tokens, predictor_version=version,
            prompt_ids=list(p_ids), priority=sub.priority,
            owner=owner if sub.sampling.logprobs is None and sub.sampling.prompt_logprobs is None else None))
    return reqs


def _row(served: ServedModel, req: ProfiledRequest) -> dict:
    """A request's log-DB row as admitted (``queued``; the answer's owner settles it)."""
    return {"id": req.id, "created": req.arrival, "model": served.path, "task": req.task,
            "instruction": req.instruction, "user_input": req.user_input, "input_tokens": req.input_tokens,
            "max_tokens": req.max_tokens, "predicted_tokens": req.predicted_tokens,
            "predicted_upper": req.predicted_upper,  # the bound its memory was planned with
            "predictor_version": req.predictor_version, "emulated_tokens": req.emulated_tokens,
            "slo_s": req.slo_s, "status": "queued"}
