"""Steps a ``ContinuousRun`` and renders its token events the way the instance's publisher does
(``GroupHandle.render``): one ``TextStage`` per group, rows a stop string ended cancelled in the run."""

from __future__ import annotations

from workers.continuous import ContinuousRun
from workers.row_text import TextStage
from workers.step_outputs import StepOutput


def step_rendered(run: ContinuousRun, stages: dict[str, TextStage]) -> dict[str, StepOutput]:
    outs = run.step()
    for bid, out in outs.items():
        stopped = stages.setdefault(bid, TextStage(run.tok)).render(out)
        if stopped:
            run.cancel(stopped)
    return outs
