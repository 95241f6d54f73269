"""The decode loop on the built-in model (real HF model, real DynamicCache): greedy equals HF
``generate``, rows leave as they finish, preemption keeps the work, stops, sampling, cancellation."""

from __future__ import annotations

import pytest
import torch

from cohort.protocol import FailureCode, FinishReason
from cohort.types import ProfiledRequest, SamplingParams
from workers.detokenize import IncrementalDetokenizer
from workers.engine import LLMEngine
from workers.padded_run import PaddedRun
from workers.step_outputs import KVCacheOutOfMemory

PROMPTS = ["Translate to French: good morning", "Hi", "a much longer prompt about static batching " * 4,
           "Summarise: the cat sat on the mat"]


def req(i: int, prompt: str, max_tokens: int = 20, **kw) -> ProfiledRequest:
    return ProfiledRequest(id=f"r{i}", prompt=prompt, input_tokens=len(prompt.split()), arrival=0.0,
                           predicted_tokens=kw.pop("predicted", max_tokens), max_tokens=max_tokens, **kw)


def run(engine: LLMEngine, reqs, capacity=None, **kw) -> tuple[PaddedRun, list]:
    b = engine.start(reqs, **kw)
    if capacity is not None:
        b.capacity = capacity
    return b, b.run_to_end()


def by_id(outs, attr="finished"):
    return {x.request.id: x for o in outs for x in getattr(o, attr)}


def test_greedy_equals_hf_generate_token_for_token(engine):
    reqs = [req(i, p, max_tokens=m) for i, (p, m) in enumerate(zip(PROMPTS, (24, 5, 16, 11), strict=True))]
    _, outs = run(engine, reqs)
    got = by_id(outs)
    tok = engine.tokenizer
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    ref = engine.model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id)[:, enc["input_ids"].shape[1]:]
    for i, r in enumerate(reqs):
        want = ref[i].tolist()
        if tok.eos_token_id in want:
            want = want[:want.index(tok.eos_token_id)]
        want = want[:r.max_tokens]
        assert got[r.id].tokens == len(want)
        assert got[r.id].text == tok.decode(want, skip_special_tokens=True)


def test_rows_are_answered_when_they_finish_and_leave_the_batch(engine):
    reqs = [req(i, p, max_tokens=30, emulated_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, (3, 17, 9, 30),
                                                                                         strict=True))]
    b = engine.start(reqs, emulate=True)
    finished_at_step, sizes = {}, []
    while not b.done:
        out = b.step()
        sizes.append(len(b.rows))
        for f in out.finished:
            finished_at_step[f.request.id] = (b.steps, f.tokens, f.finish_reason)
    assert finished_at_step == {"r0": (3, 3, FinishReason.STOP), "r2": (9, 9, FinishReason.STOP),
                                "r1": (17, 17, FinishReason.STOP), "r3": (30, 30, FinishReason.LENGTH)}
    assert sizes[2] == 3 and sizes[8] == 2 and sizes[16] == 1  # the KV rows of finished requests are gone


def test_static_execution_answers_everyone_at_the_end(engine):
    reqs = [req(i, p, max_tokens=12, emulated_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS[:2], (2, 12),
                                                                                        strict=True))]
    b = engine.start(reqs, emulate=True, elastic=False)
    outs = b.run_to_end()
    assert [len(o.finished) for o in outs] == [0] * 11 + [2]
    assert all(len(b.rows) == 2 for _ in outs) and not any(o.deltas for o in outs)
    assert {f.tokens for f in outs[-1].finished} == {2, 12}
    # what the clients see: nothing before the batch ends
    assert len({(f.first_token_at, f.finished_at) for f in outs[-1].finished}) == 1


def test_deltas_stream_the_answer(engine):
    b, outs = run(engine, [req(0, PROMPTS[0], max_tokens=15)])
    streamed = "".join(d[1] for o in outs for d in o.deltas)
    final = by_id(outs)["r0"].text
    assert streamed == final and len([d for o in outs for d in o.deltas]) > 1
    assert [d[2] for o in outs for d in o.deltas] == sorted(d[2] for o in outs for d in o.deltas)


def test_preemption_hands_back_continuations_that_resume_where_they_stopped(engine):
    reqs = [req(i, p, max_tokens=40, emulated_tokens=40, predicted=p_) for i, (p, p_) in
            enumerate(zip(PROMPTS[:3], (40, 10, 35), strict=True))]
    _, whole = run(engine, reqs, emulate=True)
    reference = {k: v.text for k, v in by_id(whole).items()}
    L = max(len(engine.prompt_ids(r.prompt)) for r in reqs)
    capacity = 3 * (L + 12) * engine.delta_bytes  # room for ~12 steps of three rows
    b, outs = run(engine, reqs, capacity=capacity, emulate=True)
    evicted = [c for o in outs for c in o.evicted]
    assert evicted and not any(o.failed for o in outs)
    first = evicted[0]
    assert first.id == "r0"  # largest predicted remaining goes first (batcher.elastic.eviction_order)
    assert first.preemptions == 1 and first.generated_ids and first.prompt_ids
    assert first.max_tokens == 40 - len(first.generated_ids) and first.input_tokens == len(first.prompt_ids) + \
        len(first.generated_ids)
    done = by_id(outs)
    pending = list(evicted)
    while pending:  # resume every continuation alone, like the batcher would
        c = pending.pop()
        _, more = run(engine, [c], emulate=True)
        done.update(by_id(more))
        pending += [x for o in more for x in o.evicted]
    assert {k: v.text for k, v in done.items()} == reference  # the same answer as without preemption
    assert all(v.tokens == 40 for v in done.values())


def test_split_recovery_gives_the_batch_back(engine):
    reqs = [req(i, p, max_tokens=60, emulated_tokens=60) for i, p in enumerate(PROMPTS[:2])]
    b = engine.start(reqs, emulate=True, recovery="split")
    b.capacity = 2 * 30 * engine.delta_bytes
    with pytest.raises(KVCacheOutOfMemory):
        b.run_to_end()


def test_a_request_that_cannot_fit_alone_fails_explicitly(engine):
    b, outs = run(engine, [req(0, PROMPTS[0], max_tokens=60, emulated_tokens=60)], emulate=True,
                  capacity=20 * engine.delta_bytes)
    failed = [f for o in outs for f in o.failed]
    assert len(failed) == 1 and failed[0][1] is FailureCode.OUT_OF_MEMORY and b.done
    assert not any(o.evicted for o in outs)


def test_cancelled_rows_stop_at_the_next_step(engine):
    reqs = [req(i, p, max_tokens=20, emulated_tokens=20) for i, p in enumerate(PROMPTS[:2])]
    b = engine.start(reqs, emulate=True)
    b.step()
    b.cancel(["r1"])
    b.step()
    assert b.alive_ids() == ["r0"] and len(b.rows) == 1
    outs = b.run_to_end()
    assert set(by_id(outs)) == {"r0"}


def test_stop_strings_cut_the_answer(engine):
    _, outs = run(engine, [req(0, PROMPTS[3], max_tokens=30)])
    full = by_id(outs)["r0"].text
    assert len(full) > 6
    stop = full[3:6]
    _, outs = run(engine, [req(0, PROMPTS[3], max_tokens=30, sampling=SamplingParams(stop=(stop,)))])
    res = by_id(outs)["r0"]
    assert res.text == full[:full.index(stop)] and res.finish_reason is FinishReason.STOP
    assert "".join(d[1] for o in outs for d in o.deltas) == res.text  # a stop string is never streamed


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, presence_penalty=0.5,
                        frequency_penalty=0.3, repetition_penalty=1.1, logit_bias=((5, 2.0),))
    alone = by_id(run(engine, [req(0, PROMPTS[0], sampling=sp)])[1])["r0"].text
    mixed = by_id(run(engine, [req(1, PROMPTS[2]), req(0, PROMPTS[0], sampling=sp)])[1])["r0"].text
    other_seed = by_id(run(engine, [req(0, PROMPTS[0], sampling=SamplingParams(temperature=0.9, seed=8))])[1])
    assert alone == mixed and alone != other_seed["r0"].text


def test_logit_bias_forces_a_token(engine):
    tok_id = engine.tokenizer.convert_tokens_to_ids("cat")
    sp = SamplingParams(logit_bias=((tok_id, 100.0),))
    res = by_id(run(engine, [req(0, PROMPTS[1], max_tokens=4, sampling=sp)])[1])["r0"]
    assert res.text.split() == ["cat"] * 4


def test_ignore_eos_runs_to_max_tokens_even_when_eos_is_favoured(engine):
    """vLLM's ignore_eos is a sampling parameter: honoured without length emulation."""
    eos = engine.tokenizer.eos_token_id
    favour_eos = ((eos, 100.0),)
    stops = by_id(run(engine, [req(0, PROMPTS[1], max_tokens=6, sampling=SamplingParams(logit_bias=favour_eos))],
                      emulate=False)[1])["r0"]
    ignores = by_id(run(engine, [req(0, PROMPTS[1], max_tokens=6,
                                     sampling=SamplingParams(logit_bias=favour_eos, ignore_eos=True))],
                        emulate=False)[1])["r0"]
    assert stops.tokens == 0 and stops.finish_reason == FinishReason.STOP
    assert ignores.tokens == 6 and ignores.finish_reason == FinishReason.LENGTH


class ByteTokenizer:
    """Token id = one UTF-8 byte: a multi-byte character spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_splits_a_multibyte_character():
    text = "naïve 東京 ✓"
    detok = IncrementalDetokenizer(ByteTokenizer())
    deltas = [detok.push(b) for b in text.encode()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    raw = text.encode()
    cut = raw.index("東".encode()) + 1  # preempted in the middle of a character
    resumed = IncrementalDetokenizer(ByteTokenizer(), list(raw[:cut]))
    rest = "".join(resumed.push(b) for b in raw[cut:])
    assert rest == text[text.index("東"):]


def test_profiling_times_exact_shapes(engine):
    assert engine.run_shape(2, 16, 8) > 0
    assert torch.is_inference_mode_enabled() is False


class OOMAfterForward:
    """The real model, but a decode step with more than ``rows`` rows raises CUDA's OOM error
    *after* the layers appended to the cache (as a real OOM in a late layer would)."""

    def __init__(self, model, rows: int, from_step: int) -> None:
        self.model, self.rows, self.from_step, self.calls = model, rows, from_step, 0

    def __call__(self, **kw):
        out = self.model(**kw)
        self.calls += 1
        if self.calls > self.from_step and kw["input_ids"].shape[0] > self.rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return out


def test_cuda_oom_inside_a_step_rolls_the_cache_back_and_preempts(engine):
    reqs = [req(i, p, max_tokens=20, emulated_tokens=20, predicted=n) for i, (p, n) in
            enumerate(zip(PROMPTS[:3], (20, 5, 10), strict=True))]
    _, whole = run(engine, reqs, emulate=True)
    b = engine.start(reqs, emulate=True)
    b.model = OOMAfterForward(engine.model, rows=2, from_step=6)
    outs = b.run_to_end()
    evicted = [c for o in outs for c in o.evicted]
    assert [c.id for c in evicted] == ["r0"] and len(evicted[0].generated_ids) == 6  # prefill + 5 steps
    finished = by_id(outs)
    assert {k: v.text for k, v in finished.items()} == {k: by_id(whole)[k].text for k in ("r1", "r2")}
    (rest,) = by_id(run(engine, evicted, emulate=True)[1]).values()
    assert rest.text == by_id(whole)["r0"].text and rest.tokens == 20


def _stream_logprobs(outs, rid: str = "r0") -> tuple[list[int], list]:
    ids, lps = [], []
    for o in outs:
        for d in o.deltas:
            if d[0].id == rid:
                ids += list(d[3])
                lps += getattr(d[3], "logprobs", [])
    return ids, lps


def test_logprobs_come_from_the_distribution_the_row_samples_from(engine):
    """Greedy: the chosen token is the top alternative; every generated token has one entry;
    the text and the tokens are those of the same request without logprobs."""
    plain = by_id(run(engine, [req(0, PROMPTS[0], max_tokens=8)])[1])["r0"]
    _, outs = run(engine, [req(0, PROMPTS[0], max_tokens=8, sampling=SamplingParams(logprobs=3))])
    res = by_id(outs)["r0"]
    ids, lps = _stream_logprobs(outs)
    assert res.text == plain.text and len(ids) == len(lps) == res.tokens
    for tok, (lp, top) in zip(ids, lps, strict=True):
        assert len(top) == 3 and top[0][0] == tok and top[0][1] == pytest.approx(lp)
        assert lp <= 0 and [a[1] for a in top] == sorted((a[1] for a in top), reverse=True)


def test_logprobs_follow_the_processors(engine):
    """top_k=2 sampling: only two tokens have probability; the rest are at the floor, and the
    two that remain sum to 1."""
    sp = SamplingParams(temperature=1.0, top_k=2, seed=3, logprobs=3)
    _, outs = run(engine, [req(0, PROMPTS[1], max_tokens=6, sampling=sp)])
    ids, lps = _stream_logprobs(outs)
    assert ids and len(lps) == len(ids)
    for tok, (lp, top) in zip(ids, lps, strict=True):
        assert tok in (top[0][0], top[1][0]) and lp in (top[0][1], top[1][1]) and top[2][1] == -9999.0
        assert sum(torch.tensor([top[0][1], top[1][1]]).exp().tolist()) == pytest.approx(1.0, abs=1e-4)


def test_static_execution_sends_logprobs_at_the_release(engine):
    reqs = [req(0, PROMPTS[0], max_tokens=5, emulated_tokens=5, sampling=SamplingParams(logprobs=0)),
            req(1, PROMPTS[1], max_tokens=9, emulated_tokens=9)]
    outs = engine.start(reqs, emulate=True, elastic=False).run_to_end()
    assert not any(o.deltas for o in outs[:-1])
    (d,) = outs[-1].deltas
    assert d[0].id == "r0" and d[1] == "" and d[2] == 5 and len(d[3].logprobs) == 5
    assert all(top == [] for _, top in d[3].logprobs)


def test_prompt_logprobs_are_the_models_own_and_independent_of_the_batch(engine):
    """The prefill's logits score each prompt token (the first has none); left padding and a
    batch-mate change nothing; a row with max_tokens 0 scores its prompt and generates nothing."""
    prompt = "the cat sat on the mat"
    ids = engine.prompt_ids(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(engine.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
    sp = SamplingParams(prompt_logprobs=2)
    for reqs in ([req(0, prompt, max_tokens=0, sampling=sp)],
                 [req(1, PROMPTS[2], max_tokens=3), req(0, prompt, max_tokens=0, sampling=sp)]):
        b = engine.start(reqs)
        outs = b.run_to_end()
        (got,) = [(r, i, s) for o in outs for r, i, s in o.prompt_scores]
        assert got[0].id == "r0" and got[1] == ids and got[2][0] is None
        assert [e[0] for e in got[2][1:]] == pytest.approx(want, abs=1e-4)
        for e, j in zip(got[2][1:], range(1, len(ids)), strict=True):
            assert len(e[1]) == 2 and e[1][0][1] >= e[1][1][1]                  # the two most likely
            assert e[2] == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1        # the prompt token's rank
        assert by_id(outs)["r0"].tokens == 0
        assert all(not o.prompt_scores or o is outs[0] for o in outs)  # once, at the prefill
