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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.engine_sim.scheduler import SimStep

FIT_FORM = "linear-v1"


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the terms both step-time models read."""

    prefill_tokens: int = 0
    prefill_pairs: float = 0.0     # causal attention pairs of the prefill chunks: Σ c·(p + c/2)
    prefill_context: int = 0       # Σ (p + c) over prefill rows: the KV they read and write
    decode_rows: int = 0
    decode_context: int = 0        # Σ context over decode rows

    @property
    def context_tokens(self) -> int:
        return self.prefill_context + self.decode_context

    @classmethod
    def of(cls, plan: SimStep) -> StepShape:
        pt = pc = dr = dc = 0
        pairs = 0.0
        for row in plan.rows:
            after = row.num_computed + row.num_new
            if row.is_decode:
                dr += 1
                dc += after
            else:
                pt += row.num_new
                pc += after
                pairs += row.num_new * (row.num_computed + row.num_new / 2.0)
        return cls(pt, pairs, pc, dr, dc)

    def features(self) -> list[float]:
        """The fitted form's regressors: 1, prefill tokens, decode rows, context tokens."""
        return [1.0, float(self.prefill_tokens), float(self.decode_rows), float(self.context_tokens)]


class StepTime(Protocol):
    def seconds(self, shape: StepShape) -> float: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class FittedStepTime:
    """t = a + b·prefill_tokens + c·decode_rows + d·context_tokens (module docstring)."""

    a: float
    b: float
    c: float
    d: float

    def seconds(self, shape: StepShape) -> float:
        return (self.a + self.b * shape.prefill_tokens + self.c * shape.decode_rows
                + self.d * shape.context_tokens)

    def describe(self) -> dict[str, Any]:
        return {"kind": "fit", "form": FIT_FORM, **asdict(self)}

    def to_json(self) -> dict[str, Any]:
        return {"form": FIT_FORM, **asdict(self)}


def load_fit(path: str | Path) -> FittedStepTime:
    """The coefficients a ``--fit FILE`` names (the JSON ``FittedStepTime.to_json`` writes)."""
    data = json.loads(Path(path).read_text())
    form = data.get("form", FIT_FORM)
    if form != FIT_FORM:
        raise ValueError(f"{path}: step-time form {form!r} is not {FIT_FORM!r}")
    try:
        return FittedStepTime(*(float(data[k]) for k in "abcd"))
    except KeyError as e:
        raise ValueError(f"{path}: missing coefficient {e.args[0]!r}") from None
