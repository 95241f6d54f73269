"""How long one engine step takes: from the roofline (``bench.roofline``) or from coefficients
fitted to a real engine's steps.

A step is described by what costs time on a GPU (``StepShape``): the prefill tokens it computes
(chunks of prompts, and the recompute of resumed requests), its decode rows, and the context the
rows attend to. The roofline turns that into FLOPs and bytes read; the fitted form is linear,

    t = a + b · prefill_tokens + c · decode_rows + d · context_tokens        (seconds)

(the roofline's version is ``roofline_steps``), where ``context_tokens`` is Σ over every scheduled row of the tokens in its KV after the step
(what attention reads). ``a`` is the per-step floor (launches, sampling, scheduling), ``b`` the
prefill cost per token, ``c`` the per-row decode cost, ``d`` the KV read per cached token. It is
the form ``fit.fit_step_time`` fits by least squares (coefficients kept non-negative), and the JSON
``--fit FILE`` reads: ``{"form": "linear-v1", "a": …, "b": …, "c": …, "d": …}``.

The second form, ``linear-v2``, adds what a step with prefill costs beyond its tokens:

    t = a + a_p · [the step has prefill] + b · prefill_tokens + e · prefill_rows
          + c · decode_rows + d · context_tokens

``a_p`` is the extra fixed cost of a step that prefills (a real engine prepares a different
attention path and more inputs), ``e`` the cost of each prompt started or continued in it (its
setup, its sampler state). A linear-v1 file is a linear-v2 one with ``a_p = e = 0``; ``load_fit``
reads both.

**The front end.** Before a request reaches the scheduler a real server parses it, tokenizes the
prompt and hands it to the engine process; on vLLM's CPU build that work runs on the engine's own
core, so it both delays the request and takes time from the steps. A fit may carry its cost,

    front = f + g · prompt_tokens        (seconds of the engine's core per request)

which the stepped engine (``engine.SteppedEngine``) spends before the request joins the waiting
queue, lengthening the step in flight. ``f`` and ``g`` are not part of the form: a file without
them (every file written before they existed) has no front end, ``f = g = 0``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.engine_sim.scheduler import SimStep

FIT_FORM = "linear-v1"
FIT_FORM_V2 = "linear-v2"
FORMS = (FIT_FORM, FIT_FORM_V2)


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the terms both step-time models read."""

    prefill_tokens: int = 0
    prefill_pairs: float = 0.0     # causal attention pairs of the prefill chunks: Σ c·(p + c/2)
    prefill_context: int = 0       # Σ (p + c) over prefill rows: the KV they read and write
    decode_rows: int = 0
    decode_context: int = 0        # Σ context over decode rows
    prefill_rows: int = 0          # rows of the step that compute prompt tokens

    @property
    def context_tokens(self) -> int:
        return self.prefill_context + self.decode_context

    @classmethod
    def of(cls, plan: SimStep) -> StepShape:
        pt = pc = dr = dc = pr = 0
        pairs = 0.0
        for row in plan.rows:
            after = row.num_computed + row.num_new
            if row.is_decode:
                dr += 1
                dc += after
            else:
                pt += row.num_new
                pc += after
                pr += 1
                pairs += row.num_new * (row.num_computed + row.num_new / 2.0)
        return cls(pt, pairs, pc, dr, dc, pr)

    def features(self, form: str = FIT_FORM) -> list[float]:
        """The fitted form's regressors: 1, prefill tokens, decode rows, context tokens; linear-v2
        adds [has prefill] and prefill rows (the order ``FittedStepTime.of`` takes)."""
        base = [1.0, float(self.prefill_tokens), float(self.decode_rows), float(self.context_tokens)]
        if form == FIT_FORM:
            return base
        return [*base, 1.0 if self.prefill_tokens > 0 else 0.0, float(self.prefill_rows)]


class StepTime(Protocol):
    def seconds(self, shape: StepShape) -> float: ...

    def front_seconds(self, prompt_tokens: int) -> float: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class FittedStepTime:
    """t = a + a_p·[prefill] + b·prefill_tokens + e·prefill_rows + c·decode_rows + d·context_tokens
    (module docstring; linear-v1 when ``a_p`` and ``e`` are 0), and the front end's f + g·prompt
    tokens per request (0 when neither is given)."""

    a: float
    b: float
    c: float
    d: float
    a_p: float = 0.0
    e: float = 0.0
    f: float = 0.0
    g: float = 0.0

    @property
    def form(self) -> str:
        return FIT_FORM if self.a_p == 0.0 and self.e == 0.0 else FIT_FORM_V2

    @classmethod
    def of(cls, form: str, coef: list[float]) -> FittedStepTime:
        """From coefficients in ``StepShape.features(form)`` order, then f and g when there are two
        more."""
        k = len(StepShape().features(form))
        front = dict(zip(("f", "g"), coef[k:k + 2], strict=False))
        return cls(*coef[:4], **front) if form == FIT_FORM else cls(*coef[:4], a_p=coef[4], e=coef[5], **front)

    def front_seconds(self, prompt_tokens: int) -> float:
        return self.f + self.g * prompt_tokens

    def seconds(self, shape: StepShape) -> float:
        t = (self.a + self.b * shape.prefill_tokens + self.c * shape.decode_rows
             + self.d * shape.context_tokens)
        if shape.prefill_tokens > 0:
            t += self.a_p + self.e * shape.prefill_rows
        return t

    def describe(self) -> dict[str, Any]:
        return {"kind": "fit", **self.to_json()}

    def to_json(self) -> dict[str, Any]:
        coef = asdict(self)
        if self.form == FIT_FORM:
            del coef["a_p"], coef["e"]
        if self.f == 0.0 and self.g == 0.0:
            del coef["f"], coef["g"]
        return {"form": self.form, **coef}


def load_fit(path: str | Path) -> FittedStepTime:
    """The coefficients a ``--fit FILE`` names (the JSON ``FittedStepTime.to_json`` writes, or
    ``cohort engine-sim fit`` with more beside them): linear-v1 or linear-v2, with the front end's
    f and g when the file has them (0 when not)."""
    data = json.loads(Path(path).read_text())
    form = data.get("form", FIT_FORM)
    if form not in FORMS:
        raise ValueError(f"{path}: step-time form {form!r} is not one of {FORMS}")
    keys = "abcd" if form == FIT_FORM else ("a", "b", "c", "d", "a_p", "e")
    try:
        return FittedStepTime.of(form, [float(data[k]) for k in keys] + [float(data.get(k, 0.0)) for k in "fg"])
    except KeyError as e:
        raise ValueError(f"{path}: missing coefficient {e.args[0]!r}") from None
