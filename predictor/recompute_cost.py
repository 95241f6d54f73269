"""Recompute-cost predictor (AdaptiveLLM §3.2): how long re-prefilling a preempted row takes.

AdaptiveLLM predicts the cost of recomputing a victim's KV from four factors of one inference
step: tokens per request, batch size, layers and hidden size, with a random forest on degree-2
polynomial features (the best of its model search: linear, ridge, lasso, elastic net, decision
tree, random forest, gradient boosting and KNN, each on polynomial features of degree 1–5, kept
by the lowest held-back error). This module is that predictor and that search, trained on the
worker's own profile samples (``cohort worker profile --gen-lens 1``: a batch of β prompts of L
tokens generating one token is one prefill, the recompute of β rows of L tokens).

Why here and not in ``batcher.preemption``: the rule there only compares two costs; fitting a
regression needs scikit-learn and the samples, which belong with cohort's other estimators
(``predictor.estimator``, Magnus's KNN batch-time model, which the search reports beside it).
Repeated shapes (several profile runs) are reduced to one time before fitting, by default their
minimum: on a shared CPU a neighbour can only slow a run down, so the fastest run of a shape is
the closest to its cost.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
from sklearn.linear_model import ElasticNet, Lasso, LinearRegression, Ridge
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsRegressor
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import PolynomialFeatures, StandardScaler
from sklearn.tree import DecisionTreeRegressor

from predictor.estimator import KNNBatchTime

# the paper's eight model families, each behind polynomial features and a scaler
MODELS: dict[str, Callable[[int], Any]] = {
    "linear": lambda seed: LinearRegression(),
    "ridge": lambda seed: Ridge(alpha=1e-3),
    "lasso": lambda seed: Lasso(alpha=1e-6, max_iter=50_000),
    "elastic_net": lambda seed: ElasticNet(alpha=1e-6, l1_ratio=0.5, max_iter=50_000),
    "decision_tree": lambda seed: DecisionTreeRegressor(random_state=seed),
    "random_forest": lambda seed: RandomForestRegressor(n_estimators=200, random_state=seed, n_jobs=1),
    "gradient_boosting": lambda seed: GradientBoostingRegressor(random_state=seed),
    "knn": lambda seed: KNeighborsRegressor(n_neighbors=5, weights="distance"),
}
DEGREES = (1, 2, 3, 4, 5)
PAPER_CHOICE = ("random_forest", 2)


@dataclass(frozen=True)
class PrefillSamples:
    """Profiled prefills: features (tokens per row, batch size, layers, hidden) and seconds."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


REDUCERS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": lambda v: float(np.median(v))}


def load_prefill_samples(paths: Sequence[str | Path], layers: int, hidden: int, max_gen: int = 1,
                         reduce: str = "min") -> PrefillSamples:
    """Samples of ``cohort worker profile`` files whose gen_len ≤ ``max_gen`` (prefills), each
    repeated (β, L) reduced to one time (``min``: contention on a shared machine only ever adds
    time; ``median``), with the model's ``layers`` and ``hidden`` as features."""
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for p in paths:
        data = json.loads(Path(p).read_text())
        for s in data.get("samples", []) if isinstance(data, dict) else data:
            if int(s["gen_len"]) <= max_gen:
                times[(int(s["size"]), int(s["input_len"]))].append(float(s["seconds"]))
    if not times:
        raise ValueError(f"no prefill samples (gen_len <= {max_gen}) in {list(map(str, paths))}")
    keys = sorted(times)
    x = np.array([(L, b, layers, hidden) for b, L in keys], dtype=float)
    y = np.array([float(REDUCERS[reduce](times[k])) for k in keys])
    return PrefillSamples(x, y)


def mape(y: np.ndarray, pred: np.ndarray) -> float:
    """Mean absolute percentage error, in percent (the paper's "prediction error")."""
    return float(np.mean(np.abs(pred - y) / np.maximum(np.abs(y), 1e-12)) * 100.0)


def make_model(name: str, degree: int, seed: int = 0) -> Pipeline:
    """One candidate: degree-``degree`` polynomial features, standardised, then the regressor."""
    return make_pipeline(PolynomialFeatures(degree, include_bias=False), StandardScaler(), MODELS[name](seed))


class RecomputeCostModel:
    """The fitted predictor: seconds to re-prefill ``rows`` rows of ``tokens`` tokens each."""

    def __init__(self, name: str = PAPER_CHOICE[0], degree: int = PAPER_CHOICE[1], seed: int = 0) -> None:
        self.name, self.degree = name, degree
        self.pipe = make_model(name, degree, seed)

    def fit(self, samples: PrefillSamples) -> RecomputeCostModel:
        self.pipe.fit(samples.x, samples.y)
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(self.pipe.predict(np.asarray(x, dtype=float).reshape(-1, 4)), 0.0)

    def seconds(self, tokens: int, rows: int, layers: int, hidden: int) -> float:
        return float(self.predict(np.array([[tokens, rows, layers, hidden]]))[0])


def model_search(samples: PrefillSamples, test_frac: float = 0.2, seed: int = 0,
                 models: Sequence[str] = tuple(MODELS), degrees: Sequence[int] = DEGREES) -> dict[str, Any]:
    """The paper's search: every family × degree fitted on the same split, MAPE on the held-back
    part; plus Magnus's KNN batch-time estimator (standardised (β, L, G=1)) on the same split."""
    if len(samples) < 10:
        raise ValueError(f"need at least 10 distinct prefill shapes, got {len(samples)}")
    idx = np.arange(len(samples))
    tr, te = train_test_split(idx, test_size=test_frac, random_state=seed)
    xtr, ytr, xte, yte = samples.x[tr], samples.y[tr], samples.x[te], samples.y[te]
    rows = []
    for name in models:
        for d in degrees:
            m = RecomputeCostModel(name, d, seed).fit(PrefillSamples(xtr, ytr))
            rows.append({"model": name, "degree": d, "mape_pct": mape(yte, m.predict(xte)),
                         "train_mape_pct": mape(ytr, m.predict(xtr))})
    best = min(rows, key=lambda r: r["mape_pct"])
    knn = KNNBatchTime().fit([(int(b), int(L), 1) for L, b, *_ in xtr], ytr)
    knn_mape = mape(yte, knn.estimate_many([(int(b), int(L), 1) for L, b, *_ in xte]))
    paper = next(r for r in rows if (r["model"], r["degree"]) == PAPER_CHOICE)
    return {"samples": len(samples), "train": len(tr), "held_back": len(te), "seed": seed, "table": rows,
            "best": best, "paper_choice": paper, "knn_batch_time_mape_pct": knn_mape,
            "use": "best" if best["mape_pct"] < knn_mape else "knn_batch_time"}


def search_table(result: dict[str, Any]) -> str:
    """The search as a table: held-back MAPE (%) per family (rows) and degree (columns)."""
    degrees = sorted({r["degree"] for r in result["table"]})
    models = list(dict.fromkeys(r["model"] for r in result["table"]))
    cell = {(r["model"], r["degree"]): r["mape_pct"] for r in result["table"]}
    lines = [f"{'model':18s}" + "".join(f" {'deg ' + str(d):>8s}" for d in degrees), "-" * (18 + 9 * len(degrees))]
    for m in models:
        lines.append(f"{m:18s}" + "".join(f" {cell[(m, d)]:8.2f}" for d in degrees))
    b, p = result["best"], result["paper_choice"]
    lines += ["", f"held-back MAPE on {result['held_back']} of {result['samples']} prefill shapes",
              f"best: {b['model']} degree {b['degree']}: {b['mape_pct']:.2f} %",
              f"paper's choice (random forest, degree 2): {p['mape_pct']:.2f} %",
              f"Magnus's KNN batch-time estimator: {result['knn_batch_time_mape_pct']:.2f} %",
              f"use: {result['use']}"]
    return "\n".join(lines)


# --- the live worker's recompute price ------------------------------------

COST_FILE_VERSION = 2
# families whose fitted f is smooth in the batch size: the marginal f(β+1, L) − f(β, L) of a tree,
# a forest, boosting or KNN is a step (0 between two leaves, a jump at the next), not a price
SMOOTH = ("linear", "ridge", "lasso", "elastic_net")


class FittedRecomputeCost:
    """What the live per-victim decision reads: the fitted model of a profiled model/device.

    Its file (``save_cost_file``) holds the profile's reduced samples and the search's pick, not
    a pickled estimator: the worker refits at start (well under a second for a few hundred
    shapes), so the file is plain JSON and can never run code.
    """

    def __init__(self, name: str, degree: int, samples: PrefillSamples, layers: int, hidden: int,
                 marginal: tuple[str, int] | None = None) -> None:
        self.name, self.degree, self.layers, self.hidden = name, degree, layers, hidden
        self.marginal = marginal or (name, degree)
        self._f = self._fit(name, degree, samples)
        self._df = self._f if self.marginal == (name, degree) else self._fit(*self.marginal, samples)

    def _fit(self, name: str, degree: int, samples: PrefillSamples) -> Callable[[int, int], float]:
        if name == "knn_batch_time":  # Magnus's estimator won the search: (β, L, G = 1)
            knn = KNNBatchTime().fit([(int(b), int(L), 1) for L, b, *_ in samples.x], samples.y)
            return lambda tokens, rows: knn.estimate(rows, tokens, 1)
        m = RecomputeCostModel(name, degree).fit(samples)
        return lambda tokens, rows: m.seconds(tokens, rows, self.layers, self.hidden)

    def prefill_seconds(self, tokens: int, rows: int) -> float:
        """f(β, L): one packed prefill of ``rows`` rows of ``tokens`` tokens each (the search's pick)."""
        return float(self._f(int(tokens), int(rows)))

    def recompute_seconds(self, tokens: int, running_rows: int) -> float:
        """A victim of ``tokens`` tokens re-prefilled beside ``running_rows`` rows: the marginal
        f(β+1, L) − f(β, L) (a packed step's per-row work adds up; the step's fixed
        cost is paid anyway), or the lone prefill f(1, L) when nothing else runs. The difference
        is taken on ``marginal``, the best smooth family of the search where the pick is a step
        function (``SMOOTH``). Never below 0: a fitted surface can dip where the profile is thin."""
        if running_rows <= 0:
            return max(0.0, self.prefill_seconds(tokens, 1))
        return max(0.0, self._df(int(tokens), running_rows + 1) - self._df(int(tokens), running_rows))


def save_cost_file(path: str | Path, samples: PrefillSamples, result: dict[str, Any], model: str, device: str,
                   sources: Sequence[str | Path] = ()) -> Path:
    """Store the search's pick (the best family × degree, or Magnus's KNN where it wins) with the
    samples it is fitted on, for the worker of ``model`` on a ``device`` (cpu | cuda)."""
    best = result["best"]
    name, degree = ("knn_batch_time", 0) if result["use"] == "knn_batch_time" else (best["model"], best["degree"])
    smooth = [r for r in result["table"] if r["model"] in SMOOTH]
    marginal = min(smooth, key=lambda r: r["mape_pct"]) if name not in SMOOTH and smooth else None
    layers, hidden = int(samples.x[0, 2]), int(samples.x[0, 3])
    doc = {"version": COST_FILE_VERSION, "model": model, "device": device, "layers": layers, "hidden": hidden,
           "name": name, "degree": int(degree), "held_back_mape_pct": min(best["mape_pct"],
                                                                       result["knn_batch_time_mape_pct"]),
           "marginal": [marginal["model"], marginal["degree"]] if marginal else [name, int(degree)],
           "marginal_mape_pct": marginal["mape_pct"] if marginal else None,
           "sources": [str(s) for s in sources], "x": samples.x.tolist(), "y": samples.y.tolist()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def load_cost_file(path: str | Path, model: str, device: str) -> FittedRecomputeCost | None:
    """The fitted recompute cost for this model on this device type, or None when the file is
    missing, of another model or device, or unreadable (the worker then uses its measured rate)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != COST_FILE_VERSION or doc["model"] != model or doc["device"] != device:
            return None
        samples = PrefillSamples(np.asarray(doc["x"], dtype=float).reshape(-1, 4), np.asarray(doc["y"], dtype=float))
        return FittedRecomputeCost(doc["name"], int(doc["degree"]), samples, int(doc["layers"]), int(doc["hidden"]),
                                   (str(doc["marginal"][0]), int(doc["marginal"][1])))
    except (ValueError, KeyError, TypeError):
        return None
