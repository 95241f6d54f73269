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
        default=64, ge=1, description="Batches one instance runs at once (the batcher sends no more): a group "
        "costs the worker no thread, so this only bounds the rows in flight when groups are single requests.")
    lookahead: int = Field(
        default=4, ge=1, description="Batches the batcher keeps waiting at each instance, so a group is there "
        "at every step boundary where room appears (a dispatch round trip takes several steps).")
    group_frac: float = Field(
        default=0.01, gt=0.0, le=1.0, description="The share of Θ the policy plans one admission group with: "
        "small groups join a busy running set often instead of waiting for room for a big one "
        "(measured in docs/notes/benchmarks.md).")
    max_rows: int = Field(
        default=256, ge=1, description="Most rows one instance runs at once (vLLM's max_num_seqs); the "
        "marginal-cost rule caps rows by the step's make-up below it, a fixed cap is the blunter tool.")
    marginal_cost: float = Field(
        default=0.815, ge=0.0, le=1.0, description="A row joins only while its marginal decode-step cost is at "
        "most this share of the running rows' mean cost per row (0 = off; batcher.row_cost): where steps are "
        "bound by the rows another row slows every row for little throughput. A CUDA worker learns its step "
        "cost from its own steps; a CPU worker does not apply it (its step times measure its neighbours too).")
    page_tokens: int = Field(default=16, ge=1, description="Tokens per KV page.")
    step_token_budget: int = Field(
        default=512, ge=16, description="Tokens one step may run (decode rows first, then "
        "prefill chunks), so a long prompt never stalls the rows that are decoding.")
    background_slowdown: float = Field(
        default=0.02, ge=0.0, le=10.0, description="How much rows of a less urgent priority (a batch job's) may "
        "lengthen the mean step time of more urgent ones beside them: the engine measures steps with and without "
        "them and runs them in the share of steps that keeps within this; otherwise they stay resident and skip "
        "the step, until the job's window nears (batcher.row_priority; measured in docs/notes/batch.md).")
    background_min_duty: float = Field(
        default=0.0, ge=0.0, le=1.0, description="The least share of steps rows of a less urgent priority "
        "run beside more urgent ones, whatever COHORT_CONTINUOUS__BACKGROUND_SLOWDOWN measures (1: never yield).")
