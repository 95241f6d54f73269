"""Settings of continuous execution: how many groups and rows an instance runs, its pages and per-step budget,
and how background rows give way (``batcher.running_set``, ``batcher.row_priority``).

Read through the one settings object as ``settings.continuous.<name>``, from ``COHORT_CONTINUOUS__<NAME>``
variables (``cohort.settings``); tuning knobs a deployment rarely touches, grouped by the code that reads
them (``cohort`` is the bottom floor, so the groups live here).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class ContinuousSettings(BaseModel):
    """Continuous execution: how many groups and rows an instance runs, its pages and per-step budget, and how
    background rows give way (``batcher.running_set``, ``batcher.row_priority``)."""

    max_groups: int = Field(
        default=64, ge=1, description="continuous: batches one instance runs at once (the batcher sends no "
        "more). A group costs the worker no thread of its own (one publisher reports for all), so this only "
        "bounds the rows in flight when groups are single requests (live CPU stack, 600 requests at 40/s: "
        "16 → 64 took spf@continuous from 1.50× to 1.87× elastic; docs/benchmarks.md).")
    lookahead: int = Field(
        default=4, ge=1, description="continuous: batches the batcher keeps waiting at each instance to be "
        "admitted, so a group is there at every step boundary where room appears (a dispatch round trip "
        "takes several steps).")
    group_frac: float = Field(
        default=0.01, gt=0.0, le=1.0, description="continuous: the share of Θ the policy plans one batch (an "
        "admission group) with; small groups join a running set that is far from empty at many step boundaries "
        "instead of waiting for room for a big one (simulator, saturated Magnus trace: 0.05 against 0.25 cut "
        "magnus's mean latency 8.95 → 8.35 s and spf's TTFT 2.20 → 1.40 s; 0.01 with COHORT_SPF_AGING 3.5 took "
        "spf's mean latency from 0.76 to 0.73x cb-fcfs there, and from 1.00 to 0.76x on H100 / Llama-7B; "
        "docs/benchmarks.md).")
    max_rows: int = Field(
        default=256, ge=1, description="continuous: most rows one instance runs at once (vLLM's max_num_seqs, "
        "256, by default). COHORT_CONTINUOUS__MARGINAL_COST caps the rows by the step's make-up below it; a "
        "fixed cap is a blunter tool (simulator, saturated Magnus trace: 224 took spf's mean latency from "
        "0.73 to 0.70x cb-fcfs on V100 / ChatGLM-6B but cost 0.76 -> 0.86x on H100 / Llama-7B; "
        "docs/benchmarks.md).")
    marginal_cost: float = Field(
        default=0.815, ge=0.0, le=1.0, description="continuous: a row joins only while its marginal "
        "decode-step cost is at most this share of the running rows' mean cost per row (0 = off; "
        "batcher.row_cost). The step's make-up decides how many rows run: where steps are bound by the rows "
        "(V100 / ChatGLM-6B in the simulator, ~223 rows) another row buys little throughput and slows every "
        "row; where a step's fixed part dominates (H100 / Llama-7B) it never binds. A CUDA worker learns its step "
        "cost from its own steps; a CPU worker does not apply the rule (its step times measure the processes "
        "sharing its cores). "
        "Simulator, saturated Magnus trace: spf mean latency 0.73 -> 0.70x cb-fcfs on V100, unchanged on "
        "H100; docs/benchmarks.md.")
    page_tokens: int = Field(default=16, ge=1, description="continuous: tokens per KV page.")
    step_token_budget: int = Field(
        default=512, ge=16, description="continuous: tokens one step may run (decode rows first, then "
        "prefill chunks), so a long prompt never stalls the rows that are decoding.")
    background_slowdown: float = Field(
        default=0.02, ge=0.0, le=10.0, description="continuous: how much rows of a less urgent priority (a batch "
        "job's) may lengthen the mean step time of more urgent ones (interactive) they run beside. The engine measures "
        "steps with and without them and runs them in the share of steps that keeps within this (on a CPU each row "
        "lengthens a step: a small share; on a GPU nearly every step); the rest of the time they stay resident, KV "
        "kept, and skip the step. The share rises to every step as a job's window nears (batcher.row_priority). 0.02, "
        "not 0.1: an interactive probe's p50 beside a 1,000-row job was 1.51x / 1.29x its time alone at 0.1, "
        "1.06x / 1.11x at 0, 1.11x at 0.02, job throughput unchanged (docs/batch.md).")
    background_min_duty: float = Field(
        default=0.0, ge=0.0, le=1.0, description="continuous: the least share of steps rows of a less urgent priority "
        "run beside more urgent ones, whatever COHORT_CONTINUOUS__BACKGROUND_SLOWDOWN measures (1: never yield).")
