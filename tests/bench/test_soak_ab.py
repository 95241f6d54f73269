"""The learning on/off A/B compares like with like: both sides start from the same trained model
versions, so "on" differs from "off" only by the learner's work (a fresh stack predicts cold
until its first retrain, which the "off" side never gets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import bench.soak_cli as soak_cli
from bench.soak import SoakConfig


def test_both_sides_start_from_the_primed_models(monkeypatch, tmp_path: Path) -> None:
    primed = tmp_path / "prime" / "var" / "models"
    seen: list[tuple[str, bool, str | None, float | None]] = []

    def fake_prime(cfg: SoakConfig, folder: Path) -> Path:
        assert folder == tmp_path / "prime"
        return primed

    def fake_run(cfg: SoakConfig, folder: Path, progress: Any = None) -> dict[str, Any]:
        seen.append((folder.name, cfg.learning, cfg.models_from, cfg.retrain_every_s))
        rps = 10.0 if cfg.learning else 8.0
        return {"summary": {"throughput_rps_after_warmup": rps},
                "samples": [{"cpu_pct": {"worker": 50.0}}]}

    monkeypatch.setattr(soak_cli, "prime_models", fake_prime)
    monkeypatch.setattr(soak_cli, "run_soak", fake_run)
    report = soak_cli.learning_ab(SoakConfig(retrain_every_s=40.0), tmp_path, repeats=2)
    assert seen == [("learning-off0", False, str(primed), None), ("learning-on0", True, str(primed), 40.0),
                    ("learning-off1", False, str(primed), None), ("learning-on1", True, str(primed), 40.0)]
    assert report["ratio"] == 10.0 / 8.0 and report["pair_ratios"] == [1.25, 1.25]


def test_given_models_are_used_without_priming(monkeypatch, tmp_path: Path) -> None:
    def no_prime(cfg: SoakConfig, folder: Path) -> Path:
        raise AssertionError("primed although models were given")

    froms: list[str | None] = []
    monkeypatch.setattr(soak_cli, "prime_models", no_prime)
    monkeypatch.setattr(soak_cli, "run_soak", lambda cfg, folder, progress=None: froms.append(cfg.models_from) or {
        "summary": {"throughput_rps_after_warmup": 1.0}, "samples": []})
    soak_cli.learning_ab(SoakConfig(models_from="/m"), tmp_path)
    assert froms == ["/m", "/m"]


def test_a_lost_request_says_which_transport_error_lost_it(monkeypatch) -> None:
    """The 2-hour soak lost 15 of 71,798 requests without saying how; now each carries its error
    and whether its 200 had arrived (a stream broken midway) or not (no answer at all)."""
    import asyncio

    import httpx

    import bench.soak as soak
    from bench.soak_stats import Outcome, summarize

    async def broken(client, kind, i, rng, max_tokens, out, model):
        if kind == "chat_stream":
            out.status = 200
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    monkeypatch.setattr(soak, "one_request", broken)
    outs = [Outcome("chat", 0.0), Outcome("chat_stream", 0.0), Outcome("leave", 0.0)]
    for o in outs:
        asyncio.run(soak._guarded(None, o, 0, None, 8, "m"))
    summary = summarize(outs, warmup_s=0.0, end_s=60.0, wall_s=60.0)
    assert summary["lost"] == 2
    assert summary["lost_by_error"] == {"RemoteProtocolError": 1, "RemoteProtocolError after 200": 1}
