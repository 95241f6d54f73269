"""How one batch runs on an instance in the simulator: static or elastic decode, OOM split or preemption.

The batch is left-padded to L(B) and decodes one step at a time; at step s every row still in the
batch holds L(B)+s tokens of KV (``batcher.elastic.next_step_kv_tokens``). Rows have *true*
remaining lengths t_i (the simulator knows them; the policy only saw predictions).

* ``static`` (the papers, HF ``generate``): every row stays until the longest ends; all rows are
  answered then.
* ``elastic``: a row leaves when it has produced its t_i tokens (answered at once, its KV dropped),
  so later steps run with a smaller β; the instance is busy until the last row leaves.

Time is the batch-time model T(β, L, G) read as prefill + G decode steps, so the steps s₀+1…s₁
run by β rows cost T(β, L, s₁) − T(β, L, s₀), and a run whose alive count changes at steps
s₁ < s₂ < … costs

    T(β₀, L, s₁) + Σ_j [T(β_j, L, s_{j+1}) − T(β_j, L, s_j)]

(β₀ rows prefill and run the first segment; β_j rows run segment j). With the roofline a step's
cost is exactly the weights plus β_j·(L+g)·Δ of KV reads, so this is the model's own step cost
with the alive β. A run that never changes β costs T(β, L, G) as before.

Memory overflow, when the next step would pass Θ (in tokens, ``KVMemory.theta_tokens``):

* ``split`` (Magnus): the step that overflowed is paid, the run is thrown away, and the rows
  still running are split in halves that restart from zero (static: the whole batch, as the
  paper; elastic: the rows not yet answered).
* ``preempt``: before the step, rows leave by ``batcher.elastic.eviction_order`` (largest
  predicted remaining first) until the step fits; each keeps the tokens it generated and comes
  back as a continuation (its prefix is re-prefilled when it resumes). A row whose own prompt and
  tokens cannot take one more step even alone fails instead (nothing loops).

Pure Python: ``simulate_batch_run`` returns offsets from the batch start; ``bench.simulator``
turns them into events. (``Sim`` in the names: this is the simulated world's batch, not the
worker's ``workers.padded_run`` run.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from batcher.elastic import eviction_order, next_step_kv_tokens
from batcher.policies.base import BatchTimeModel

EXECUTIONS = ("static", "elastic")
RECOVERIES = ("split", "preempt")


@dataclass
class SimBatchRun:
    """What happened to one batch run, as offsets (seconds) from its start; rows are indices."""

    end: float = 0.0                                                   # the instance is free again
    first_token: float = 0.0                                           # end of the first decode step
    finished: list[tuple[int, float]] = field(default_factory=list)    # (row, answered at)
    evicted: list[tuple[int, int, float]] = field(default_factory=list)  # (row, tokens kept, at)
    failed: list[tuple[int, float]] = field(default_factory=list)      # (row, at)
    split: list[int] | None = None      # rows to split in halves and restart (split recovery)
    decoded: int = 0                    # row-steps decoded in this run (tokens, padding rows included)
    wasted: int = 0                     # row-steps thrown away (rows restarted from zero)


def simulate_batch_run(inputs: Sequence[int], true: Sequence[int], predicted: Sequence[int],
                       preemptions: Sequence[int], budget: int, time_model: BatchTimeModel,
                       execution: str = "static", recovery: str = "split",
                       max_preemptions: int = 8) -> SimBatchRun:
    """Run one batch: ``inputs`` L(p) (continuations: prompt + generated), ``true`` remaining true
    lengths (≥ 1), ``predicted`` remaining predicted lengths (eviction order), ``budget`` = Θ in
    tokens. See the module docstring for the rules."""
    if execution not in EXECUTIONS or recovery not in RECOVERIES:
        raise ValueError(f"execution in {EXECUTIONS}, recovery in {RECOVERIES}")
    elastic = execution == "elastic"
    n = len(true)
    L = max(inputs)
    est = time_model.estimate
    out = SimBatchRun()
    alive = sorted(range(n), key=lambda i: true[i])   # shortest first: elastic rows leave in this order
    s = 0                    # decode steps done
    t: float | None = None   # time offset after step s (None: nothing run yet)

    def advance(a: int, e: int) -> None:
        """Run steps s+1..e with ``a`` rows."""
        nonlocal s, t
        if t is None and a == n:
            t = est(n, L, e)                 # a first segment at once: exactly T(β, L, G) for a plain run
            if e >= 1:
                out.first_token = est(n, L, 1)
        else:
            if t is None:
                t = est(n, L, 0)
            if e > s:
                if s == 0:
                    out.first_token = t + max(0.0, est(a, L, 1) - est(a, L, 0))
                t += max(0.0, est(a, L, e) - est(a, L, s))
        out.decoded += a * max(0, e - s)
        s = max(s, e)

    while alive:
        a = len(alive)
        e = max(s, true[alive[0]] if elastic else true[alive[-1]])
        if next_step_kv_tokens(a, L + e - 1) <= budget:   # every step up to e fits (KV grows with s)
            advance(a, e)
            k = a if not elastic else next((j for j, i in enumerate(alive) if true[i] > e), a)
            out.finished.extend((i, t) for i in alive[:k])
            alive = alive[k:]
            continue
        if recovery == "split":
            v = max(min(e, budget // a - L + 1), 0 if s == 0 else s + 1)  # the step that overflows: paid, lost
            advance(a, v)
            out.wasted += a * v
            out.split = list(alive) if elastic else list(range(n))
            break
        v = max(s + 1, budget // a - L + 1)        # the first step that does not fit
        advance(a, v - 1)
        kept = v - 1
        stuck = {i for i in alive if inputs[i] + kept + 1 > budget}   # cannot take a step even alone
        out.failed.extend((i, t) for i in alive if i in stuck)
        rest = [i for i in alive if i not in stuck]
        order = eviction_order([max(0, predicted[i] - kept) for i in rest], [preemptions[i] for i in rest],
                               max_preemptions)
        keep = len(rest)
        gone: set[int] = set()
        for j in order:
            if next_step_kv_tokens(keep, L + kept) <= budget:
                break
            i = rest[j]
            gone.add(i)
            keep -= 1
            if true[i] <= kept:                    # static: already done, answered as it leaves
                out.finished.append((i, t))
            else:
                out.evicted.append((i, kept, t))
        alive = [i for i in rest if i not in gone]
    out.end = t if t is not None else est(n, L, 0)
    return out
