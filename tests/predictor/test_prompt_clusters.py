"""Prompt clusters for the online bound (issue 20): unlabelled kinds of requests get bounds of their
own, cluster numbers survive refits and restarts, and a cluster taken over by new traffic is renamed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cohort.logdb import finish_request, finished_requests, get_db_engine, record_request
from predictor.base import PredictItem
from predictor.baselines import MeanPredictor
from predictor.conformal import GLOBAL, ConformalTable
from predictor.live_coverage import planned_coverage
from predictor.online_conformal import OnlineConformal
from predictor.online_state import load_state, snapshot_state, write_state
from predictor.prompt_clusters import PromptClusters, cluster_text
from predictor.service import PredictorService

DIRECTIONS = {"chat": 0, "code": 1, "tool": 2, "poem": 3}


def _embed(texts):
    """A stand-in encoder: each kind of prompt (its first word) points one way, plus a little noise."""
    rng = np.random.default_rng(len(texts))
    out = rng.normal(0, 0.05, (len(texts), 8))
    for i, t in enumerate(texts):
        out[i, DIRECTIONS[t.split()[0]]] += 1.0
    return out


def _items(kind: str, n: int, start: int = 0) -> list[PredictItem]:
    return [PredictItem(f"{kind} request number {start + i}", "input", 5) for i in range(n)]


def _fitted(k: int = 2, **kw) -> PromptClusters:
    pc = PromptClusters(k=k, min_fit=40, refit_every=40, buffer=200, embed=_embed, **kw)
    for s in range(0, 60, 20):
        batch = _items("chat", 10, s) + _items("code", 10, s)
        if pc.observe(batch):
            pc.refit()
    return pc


def test_nothing_is_clustered_before_the_first_fit() -> None:
    pc = PromptClusters(k=2, min_fit=40, embed=_embed)
    assert pc.observe(_items("chat", 20)) is False
    assert pc.assign(_items("code", 3)) == [None, None, None]
    assert OnlineConformal.keys(_items("chat", 1)[0], "p", None) == (
        f"p|{OnlineConformal.keys(_items('chat', 1)[0])[0][1:]}", f"p|{GLOBAL}",
        *OnlineConformal.keys(_items("chat", 1)[0]))


def test_kinds_of_prompts_fall_into_their_own_clusters_and_keep_them_across_refits() -> None:
    pc = _fitted()
    chat, code = pc.assign(_items("chat", 5, 100)), pc.assign(_items("code", 5, 100))
    assert len(set(chat)) == 1 and len(set(code)) == 1 and chat[0] != code[0]
    for s in range(100, 200, 20):  # more of the same traffic: refits start from the centroids
        if pc.observe(_items("chat", 10, s) + _items("code", 10, s)):
            pc.refit()
    assert pc.fits >= 3
    assert pc.assign(_items("chat", 2, 500)) == chat[:2] and pc.assign(_items("code", 2, 500)) == code[:2]


def test_a_cluster_taken_over_by_new_traffic_gets_a_new_name() -> None:
    pc = _fitted()
    chat_key, code_key = pc.assign(_items("chat", 1))[0], pc.assign(_items("code", 1))[0]
    for s in range(0, 400, 20):  # code stops, tool prompts come: the code centroid moves to them
        if pc.observe(_items("chat", 10, s) + _items("tool", 10, s)):
            pc.refit()
    tool_key = pc.assign(_items("tool", 1))[0]
    assert pc.assign(_items("chat", 1))[0] == chat_key
    assert tool_key != code_key and tool_key.split(".")[0] == code_key.split(".")[0]  # same slot, new generation


def test_clusters_survive_a_restart_in_the_online_state(tmp_path) -> None:
    pc = _fitted()
    write_state(tmp_path / "s.json", snapshot_state(OnlineConformal(), None, pc))
    _, _, back = load_state(tmp_path / "s.json", {}, None, {"k": 2, "embed": _embed})
    items = _items("chat", 2) + _items("code", 2)
    assert back is not None and back.assign(items) == pc.assign(items) and back.fits == pc.fits
    _, _, other_k = load_state(tmp_path / "s.json", {}, None, {"k": 3, "embed": _embed})
    assert other_k is not None and other_k.fitted is None  # another k: fitted again from new traffic
    assert load_state(tmp_path / "s.json", {}, None, None)[2] is None  # clusters off


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_each_kind_of_request_is_covered_near_the_target_with_clusters_and_not_without() -> None:
    """Chat answers as predicted, code answers 3x longer, interleaved and unlabelled: one pool-wide
    bound covers the mixture on average and code badly; per cluster both come near 0.9."""
    rng = np.random.default_rng(0)
    static = ConformalTable(level=0.9, quantiles={GLOBAL: 0.3})

    def run(clusters: PromptClusters | None) -> dict[str, float]:
        oc = OnlineConformal()
        covered: dict[str, list[bool]] = {"chat": [], "code": []}
        for step in range(80):
            kinds = rng.choice(["chat", "code"], 25, p=[0.7, 0.3])
            items = [_items(k, 1, step * 25 + i)[0] for i, k in enumerate(kinds)]
            point = np.full(25, 50.0)
            actual = np.expm1(np.log1p(point) + rng.normal(0, 0.3, 25) + np.where(kinds == "code", np.log(3), 0))
            keys = None if clusters is None else clusters.assign(items)
            up = oc.upper(items, point, static, None, keys)
            if step >= 40:
                for k, a, u in zip(kinds, actual, up, strict=True):
                    covered[str(k)].append(bool(a <= u))
            oc.update(items, point, actual, up, static, None, keys)
            if clusters is not None and clusters.observe(items):
                clusters.refit()
        return {k: float(np.mean(v)) for k, v in covered.items()}

    pooled = run(None)
    assert pooled["code"] < 0.8 and pooled["chat"] > 0.95  # right on average, wrong for each kind
    by_cluster = run(PromptClusters(k=2, min_fit=100, refit_every=100, embed=_embed))
    assert 0.84 <= by_cluster["code"] <= 0.96 and 0.84 <= by_cluster["chat"] <= 0.96, by_cluster


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_the_service_clusters_real_prompts_with_the_static_encoder(settings) -> None:
    """The gateway's service, the real MiniLM static vectors and the SQLite log DB: once enough
    completions are read, code and tool prompts get different clusters and different bounds."""
    settings = settings.model_copy(update={"online": settings.online.model_copy(update={"interval_s": 3600.0, "clusters": 4})})
    model = MeanPredictor(40)
    model.conformal = ConformalTable(level=0.9, quantiles={GLOBAL: 0.1})
    svc = PredictorService(settings)
    svc._swap.current = (model, "v1")
    svc.clusters.min_fit = 100
    code = [f"Write a Python function that returns the {i}th Fibonacci number using a loop." for i in range(60)]
    tool = [f"toolformer: enabled\ntoolformer access: weather\nweather(query)\nGive the weather in city {i}"
            for i in range(60)]
    engine = get_db_engine(settings.database_url)
    for i in range(60):  # code answers run long, tool calls short
        for kind, instr, actual in (("code", code[i], 150 + i), ("tool", tool[i], 12)):
            rid = f"{kind}{i}"
            record_request(engine, {"id": rid, "model": "m", "instruction": instr, "user_input": "",
                                    "input_tokens": 20, "max_tokens": 2000, "predicted_tokens": 40,
                                    "predicted_upper": 44, "predictor_version": "v1"})
            finish_request(engine, rid, status="done", actual_tokens=actual, finished=1000.0 + 2 * i + len(kind))
    assert svc.sync_completions() == 120 and svc.clusters.fitted is not None
    a = PredictItem("Write a Python function that sorts a list of 7 numbers.", "", 20)
    b = PredictItem(f"toolformer: enabled\ntoolformer access: weather\nweather(query)\nGive the weather in town {7}",
                    "", 20)
    assert cluster_text(b).startswith("toolformer")
    ka, kb = svc.clusters.assign([a, b])
    assert ka != kb
    upper_a = asyncio.run(svc.predict_bounds(a, 2000)).upper
    upper_b = asyncio.run(svc.predict_bounds(b, 2000)).upper
    assert upper_a is not None and upper_b is not None and upper_a > 3 * upper_b
    # `cohort predictor coverage` splits the logged rows by the clusters saved in the online state:
    # every code row outgrew the 44 tokens it was planned with, every tool call stayed within it
    _, _, saved = load_state(svc.online_path, {}, None, {"k": 4})
    report = planned_coverage(finished_requests(engine, since=0.0), None, saved)
    assert report["all"]["n"] == 120 and report["all"]["q90_coverage"] == 0.5
    assert report["clusters"][ka]["q90_coverage"] == 0.0 and report["clusters"][kb]["q90_coverage"] == 1.0


def test_the_point_correction_learns_a_bias_per_cluster_that_the_words_of_the_ask_do_not_carry() -> None:
    """Two kinds of prompts with the same last line (the ask) and the same input, told apart only
    earlier in the instruction (as the tool a tool-use prompt grants): one answers 3x the model's
    prediction, the other 1/3. Without clusters the correction can only split the difference; with
    a slot per cluster it corrects each kind; a state saved with another number of slots is dropped
    on loading, not misread."""
    from predictor.online_residual import OnlineResidual

    rng = np.random.default_rng(3)
    kinds = rng.choice([0, 1], 800)
    items = [PredictItem(f"tool: {'alpha' if k else 'omega'}\nAnswer the question.", "What is 7?", 5)
             for k in kinds]
    point = rng.uniform(20, 80, 800)
    actual = np.expm1(np.log1p(point) + np.where(kinds == 1, np.log(3.0), -np.log(3.0)) + rng.normal(0, 0.1, 800))
    slots = [int(k) for k in kinds]
    plain, by_cluster = OnlineResidual(), OnlineResidual(clusters=2)
    for i in range(0, 600, 50):
        plain.update(items[i:i + 50], point[i:i + 50], actual[i:i + 50])
        by_cluster.update(items[i:i + 50], point[i:i + 50], actual[i:i + 50], slots=slots[i:i + 50])

    def worst(res: OnlineResidual, s) -> float:
        got = res.correct(items[600:], point[600:], slots=s)
        return float(np.abs(np.log1p(got) - np.log1p(actual[600:])).mean())

    assert worst(plain, None) > 0.8  # log(3) ≈ 1.1: each kind still off by most of its factor
    assert worst(by_cluster, slots[600:]) < 0.25
    back = OnlineResidual.from_dict({**by_cluster.to_dict(), "clusters": 4})
    assert back.a == {}  # features of another width: start again
    same = OnlineResidual.from_dict(by_cluster.to_dict())
    np.testing.assert_allclose(same.correct(items[600:], point[600:], slots=slots[600:]),
                               by_cluster.correct(items[600:], point[600:], slots=slots[600:]))
