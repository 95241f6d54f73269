"""The soak's per-window figures: the progress line's tail-only window equals the full report's last one."""

import random

from bench.soak_stats import Outcome, engine_windows, key_family, last_window, steadiness, windows


def _outcomes(n: int, rate: float, seed: int = 3) -> list[Outcome]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        kind = rng.choice(["chat", "chat", "stream", "leave", "bad"])
        status = 400 if kind == "bad" else rng.choice([200, 200, 200, 503])
        out.append(Outcome(kind, sent=t, status=status, latency=rng.uniform(0.1, 3.0)))
    return out


def test_last_window_equals_the_last_of_all_windows() -> None:
    outs = _outcomes(5000, rate=10.0)
    full = windows(outs, 60.0)
    assert len(full) == int(outs[-1].sent // 60.0) + 1
    assert last_window(outs, 60.0) == full[-1]
    assert sum(w["sent"] for w in full) == len(outs)


def test_last_window_counts_only_the_last_window() -> None:
    outs = _outcomes(300, rate=10.0)
    start = (outs[-1].sent // 10.0) * 10.0
    assert last_window(outs, 10.0)["sent"] == sum(1 for o in outs if o.sent >= start)
    assert last_window(outs, 10.0)["start_s"] == start
    assert last_window([], 10.0) == {}


def test_key_families_count_celery_results_as_one():
    assert key_family("celery-task-meta-3d6e41be-85de-49f5-83af-f05c36fae4c4") == "celery-task-meta-*"
    assert key_family("cohort:stream:abc:def") == "cohort:stream"
    assert key_family("_kombu.binding.celery.pidbox") == "_kombu.binding.celery.pidbox"


def test_engine_windows_turn_running_totals_into_step_time_and_rows_per_step():
    def sample(t, steps, busy, rows, queued, cpu):
        return {"t": t, "queued": queued, "cpu_pct": {"worker": cpu},
                "engines": {"w": {"steps": steps, "busy_s": busy, "row_steps": rows, "rows": 3, "waiting_groups": 1}}}

    samples = [sample(10, 100, 1.0, 400, 0, 80), sample(60, 600, 6.0, 2400, 2, 100),
               sample(70, 700, 8.0, 3000, 4, 90), sample(120, 1100, 16.0, 6200, 6, 110)]
    w = engine_windows(samples, 60.0)
    assert [x["start_s"] for x in w] == [0.0, 60.0]
    assert w[0]["engines"]["w"]["steps"] == 500 and w[0]["engines"]["w"]["step_ms"] == 10.0
    assert w[0]["engines"]["w"]["rows_per_step"] == 4.0
    assert w[1]["engines"]["w"]["step_ms"] == 20.0 and w[1]["engines"]["w"]["rows_per_step"] == 7.6
    assert w[1]["queued_mean"] == 5.0 and w[0]["cpu_pct"] == {"worker": 90.0}


def test_steadiness_compares_each_full_window_with_the_first():
    w = [{"p50_s": p, "sent": 600} for p in (0.4, 0.5, 0.58, 0.44, 0.46, 0.47)] + [{"p50_s": 2.0, "sent": 20}]
    s = steadiness(w)
    assert s["ratios"] == [1.0, 1.25, 1.45, 1.1, 1.15, 1.175]  # the 20-request tail is left out
    assert s["every_window_le_1_5"] and s["last_le_1_2"]
    w[2]["p50_s"] = 0.64
    assert not steadiness(w)["every_window_le_1_5"]
    assert steadiness([{"p50_s": None, "sent": 0}])["every_window_le_1_5"] is None


def test_windows_where_the_host_was_starved_are_named():
    """A VM's CPU taken by other guests (Linux ``steal``) slows every process at the same CPU%;
    steadiness names those windows so a miss there is read as the host's, not the stack's."""
    samples = [{"t": t, "cpu_pct": {}, "engines": {}, "host_steal_pct": st}
               for t, st in ((30, 0.5), (60, 1.5), (90, 20.0), (120, 30.0), (150, None), (180, 2.0))]
    ew = engine_windows(samples, 60.0)
    assert [x["host_steal_pct"] for x in ew] == [1.0, 25.0, 2.0]
    w = [{"p50_s": p, "sent": 600} for p in (0.4, 1.2, 0.42)]
    s = steadiness(w, engine_windows_=ew)
    assert s["host_steal_pct"] == [1.0, 25.0, 2.0] and s["starved_windows"] == [1]
    assert not s["every_window_le_1_5"]  # the check itself is unchanged
