"""Text off the engine thread: the continuous run emits token events only; a group's reader
renders them (``TextStage``) — stop strings cut the answer and cancel the row in the engine,
streamed deltas add up to the answer, and events after a row ended are ignored."""

from __future__ import annotations

import time

import torch

from cohort.protocol import FinishReason
from cohort.types import Batch, ProfiledRequest, SamplingParams
from workers.continuous import ContinuousRun
from workers.continuous_loop import ContinuousLoop
from workers.engine import LLMEngine
from workers.row_text import TextStage
from workers.step_outputs import StepOutput, TokenEvent

PROMPT = "Translate to French: good morning"


def make_run(engine: LLMEngine) -> ContinuousRun:
    return ContinuousRun(engine.model, engine.tokenizer, engine.device, torch.float32, num_pages=128,
                         page_size=8, token_budget=16)


def req(rid: str, max_tokens: int, stop: tuple[str, ...] = ()) -> ProfiledRequest:
    return ProfiledRequest(id=rid, prompt=PROMPT, input_tokens=5, arrival=0.0, predicted_tokens=max_tokens,
                           max_tokens=max_tokens, sampling=SamplingParams(stop=stop))


def greedy_text(engine: LLMEngine, n: int) -> str:
    ids = engine.prompt_ids(PROMPT)
    out = engine.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return engine.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_the_engine_step_carries_tokens_and_no_text(engine):
    run = make_run(engine)
    run.submit(Batch(id="A", requests=[req("r0", 4)], created=0.0), [engine.prompt_ids(PROMPT)])
    outs = []
    while not run.idle:
        outs += list(run.step().values())
        run.finished_groups()
    assert all(not o.deltas and not o.finished for o in outs)
    events = [ev for o in outs for ev in o.tokens]
    assert [ev.token is not None for ev in events] == [True] * 4
    assert events[-1].finish is FinishReason.LENGTH and [ev.total_tokens for ev in events] == [1, 2, 3, 4]


def test_a_stop_string_ends_the_row_cancels_it_in_the_engine_and_the_stream_adds_up(engine):
    text = greedy_text(engine, 16)
    words = text.split()
    stop = words[3] if len(words) > 3 else text[4:7]
    loop = ContinuousLoop(lambda: make_run(engine))
    try:
        handle = loop.submit(Batch(id="A", requests=[req("r0", 16, (stop,)), req("r1", 6)], created=0.0),
                             [engine.prompt_ids(PROMPT)] * 2)
        deltas: dict[str, str] = {}
        done = {}
        ended = False
        while not ended:
            for h, upd in loop.updates(5.0):
                assert h is handle and not upd.out.tokens  # rendered on this (the reader's) thread
                for r, piece, _n, _ids in upd.out.deltas:
                    deltas[r.id] = deltas.get(r.id, "") + piece
                done.update({f.request.id: f for f in upd.out.finished})
                ended = ended or upd.done
        assert done["r0"].finish_reason is FinishReason.STOP and stop not in done["r0"].text
        assert text.startswith(done["r0"].text) and deltas.get("r0", "") == done["r0"].text
        assert done["r1"].finish_reason is FinishReason.LENGTH and deltas["r1"] == done["r1"].text
        deadline = time.monotonic() + 5.0
        while not loop.run.idle and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.run.idle  # the stopped row was cancelled: nothing left running
    finally:
        loop.stop()


def test_events_after_a_row_ended_are_ignored(engine):
    stage = TextStage(engine.tokenizer)
    r = req("r0", 8)
    ids = engine.prompt_ids("hello world again")
    out = StepOutput(tokens=[TokenEvent(r, ids[0], 1, 1.0, 1.0), TokenEvent(r, ids[1], 2, 2.0, 1.0, FinishReason.LENGTH),
                             TokenEvent(r, ids[2], 3, 3.0, 1.0)])
    assert stage.render(out) == [] and not out.tokens
    assert len(out.finished) == 1 and out.finished[0].tokens == 2 and out.finished[0].finished_at == 2.0
    assert out.finished[0].text == engine.tokenizer.decode(ids[:2], skip_special_tokens=True)
