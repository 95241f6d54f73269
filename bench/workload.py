"""Benchmark workloads: one definition shared by the simulator and the live runner.

A workload is drawn from the *validation* split of the shared data files (the predictor never
saw those rows; see ``cohort.datasets.load_split``):

* **Task mix**: each request picks a file (task) with the given weights (default: equal, as in
  Magnus's evaluation, which uses the same number of requests per task), then a row of that
  file's validation part uniformly, with replacement (60k requests > ~9k validation rows).
* **Arrivals**: a Poisson process at ``rate`` requests/s: exponential inter-arrival gaps from a
  seeded ``numpy`` generator, the first request at t = gap₀.
* **Lengths**: L(p) = tokens of the prompt exactly as the gateway and worker count it
  (``predictor.data.input_token_counts``: ``build_prompt`` under the configured tokenizer),
  G(p) = tokens of the reference output (``count_tokens``), capped at ``max_tokens``: the
  emulated length.
* **Predictions**: G'(p) from a trained predictor directory run on the request texts (the
  same ``PredictItem`` the gateway builds), rounded and clipped to [1, max_tokens]; or
  ``oracle`` (G' = G). Magnus predictors go through the shared on-disk embedding cache.
* **SLO rule**: slo_s = max(slo_min_s, k · T_solo(p)), T_solo the batch-time model's time of
  p run alone with its true length, k drawn per request uniformly from [k_min, k_max]. A
  deadline proportional to the work a request needs is what an interactive client can expect;
  the spread of k makes deadlines differ between requests of equal size, which is what SLO-aware
  ordering can exploit (UELLM draws SLOs at random, 1 to 350 s).

Tokenizing and predicting all validation rows is slow on a CPU (sentence encoder), so
per-row lengths and predictions are cached under ``var/bench/cache`` keyed by the files, the
predictor directory and its files' mtimes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cohort.datasets import Record, load_split
from cohort.settings import get_settings
from cohort.types import ProfiledRequest
from predictor.conformal import ConformalTable
from predictor.loading import load_predictor

log = logging.getLogger(__name__)

CACHE_DIR = Path("var/bench/cache")
ORACLE = "oracle"


@dataclass
class RowTable:
    """The validation rows of the chosen files with their token counts and predictions."""

    records: list[Record]
    file_index: np.ndarray      # which file (0..F-1) each row comes from
    input_tokens: np.ndarray    # L(p): the prompt's tokens as the gateway counts them
    output_tokens: np.ndarray   # reference output length, uncapped
    predicted: np.ndarray | None = None  # G' per row (float), None for oracle-only tables
    upper: np.ndarray | None = None  # the predictor's q90 bound per row (None: no calibrated bound)


@dataclass
class WorkloadConfig:
    """Everything that determines a workload (recorded in the benchmark JSON)."""

    files: list[str]
    requests: int = 1000
    rate: float = 1.0
    seed: int = 0
    max_tokens: int = 1024
    predictor: str | None = None     # a model dir, or "oracle" / None for true lengths
    weights: list[float] | None = None
    slo_k_min: float = 2.0
    slo_k_max: float = 20.0
    slo_min_s: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"files": [str(f) for f in self.files], "requests": self.requests, "rate": self.rate,
                "seed": self.seed, "max_tokens": self.max_tokens, "predictor": self.predictor,
                "weights": self.weights, "slo_rule": {"k_min": self.slo_k_min, "k_max": self.slo_k_max,
                                                      "min_s": self.slo_min_s,
                                                      "formula": "max(min_s, U[k_min,k_max]·T_solo(L, G_true))"}}


@dataclass
class Workload:
    """A concrete, seeded request trace (arrays indexed by request)."""

    config: WorkloadConfig
    rows: RowTable
    row: np.ndarray            # row index into ``rows`` per request
    arrival: np.ndarray        # seconds from the start
    input_tokens: np.ndarray
    true_tokens: np.ndarray    # G(p), capped at max_tokens
    predicted_tokens: np.ndarray
    slo_s: np.ndarray
    task: list[str] = field(default_factory=list)
    predicted_upper: np.ndarray | None = None  # q90 bound (memory planning), None: plan with the point

    def __len__(self) -> int:
        return len(self.arrival)

    def requests(self, oracle: bool = False, prefix: str = "req") -> list[ProfiledRequest]:
        """ProfiledRequests for a policy; ``oracle`` puts the true lengths in place of predictions.

        Prompts stay empty here (the simulator never reads them); the live runner reads texts
        from ``rows`` instead.
        """
        pred = self.true_tokens if oracle else self.predicted_tokens
        mt = self.config.max_tokens
        out = []
        for i in range(len(self.arrival)):
            out.append(ProfiledRequest(
                id=f"{prefix}-{i}", prompt="", input_tokens=int(self.input_tokens[i]),
                predicted_tokens=int(pred[i]), max_tokens=mt, arrival=float(self.arrival[i]),
                slo_s=float(self.slo_s[i]), task=self.task[i] if self.task else None,
                predicted_upper=None if oracle or self.predicted_upper is None else int(self.predicted_upper[i]),
                emulated_tokens=int(self.true_tokens[i]), true_tokens=int(self.true_tokens[i])))
        return out


def _cache_key(files: Sequence[str], predictor: str | None) -> str:
    h = hashlib.sha256()
    for f in files:
        p = Path(f).resolve()
        h.update(str(p).encode())
        h.update(str(p.stat().st_mtime_ns if p.exists() else 0).encode())
    if predictor and predictor != ORACLE:
        d = Path(predictor).resolve()
        h.update(str(d).encode())
        for q in sorted(d.glob("*")):
            h.update(f"{q.name}:{q.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def build_rows(files: Sequence[str | Path], predictor: str | None = None, use_cache: bool = True,
               cache_dir: Path = CACHE_DIR) -> RowTable:
    """Validation rows of ``files`` with token counts and (optionally) predictions, cached on disk."""
    files = [str(f) for f in files]
    records: list[Record] = []
    file_index: list[int] = []
    for i, f in enumerate(files):
        recs = load_split([f], "val")
        records.extend(recs)
        file_index.extend([i] * len(recs))
    key = _cache_key(files, predictor)
    cache = cache_dir / f"rows-{key}.npz"
    if use_cache and cache.exists():
        z = np.load(cache)
        if len(z["input_tokens"]) == len(records):
            pred = z["predicted"] if "predicted" in z.files else None
            upper = z["upper"] if "upper" in z.files else None
            return RowTable(records, np.asarray(file_index), z["input_tokens"], z["output_tokens"], pred, upper)
    from predictor.data import records_to_items  # transformers (seconds to import): only on a cache miss

    items, targets = records_to_items(records)
    inp = np.array([it.input_tokens for it in items], dtype=np.int64)
    out = np.asarray(targets, dtype=np.int64)
    pred = upper = None
    if predictor and predictor != ORACLE:
        log.info("predicting %d validation rows with %s", len(items), predictor)
        pred = predict_rows(predictor, items)
        upper = _upper_rows(predictor, items, pred)
    arrays = {"input_tokens": inp, "output_tokens": out}
    if pred is not None:
        arrays["predicted"] = pred
    if upper is not None:
        arrays["upper"] = upper
    if use_cache:
        cache_dir.mkdir(parents=True, exist_ok=True)
        np.savez(cache, **arrays)
        (cache_dir / f"rows-{key}.json").write_text(json.dumps({"files": files, "predictor": predictor}))
    return RowTable(records, np.asarray(file_index), inp, out, pred, upper)


def _upper_rows(predictor: str | Path, items: list, point: np.ndarray) -> np.ndarray | None:
    """The predictor's conformal upper bound for ``items`` given its point values (None without one)."""
    table = ConformalTable.load(predictor)
    return None if table is None else table.upper(items, point)


def predict_rows(predictor: str | Path, items: list) -> np.ndarray:
    """G' for ``items``; Magnus models read embeddings through the shared cache (minutes saved)."""
    model = load_predictor(Path(predictor))
    if getattr(model, "kind", "") == "magnus" and hasattr(model, "predict_features"):
        from predictor.data import magnus_feature_matrix  # transformers: only with a Magnus predictor

        s = get_settings()
        x = magnus_feature_matrix(items, Path(s.data_dir) / "cache" / "emb",
                                  getattr(model, "encoder_path", None) or s.encoder_path,
                                  dtype=getattr(model, "encoder_dtype", None))
        return np.asarray(model.predict_features(x), dtype=float)
    return np.asarray(model.predict(items), dtype=float)


def solo_times(time_model: Any, input_tokens: np.ndarray, gen_tokens: np.ndarray) -> np.ndarray:
    """T_solo(p): the batch-time model's time for p alone (β = 1)."""
    shapes = np.stack([np.ones_like(input_tokens), input_tokens, gen_tokens], axis=1)
    return np.asarray(time_model.estimate_many(shapes), dtype=float)


def make_workload(config: WorkloadConfig, time_model: Any, rows: RowTable | None = None) -> Workload:
    """Sample a seeded trace from the rows: task mix, Poisson arrivals, lengths, predictions, SLOs."""
    if config.rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    rows = rows or build_rows(config.files, config.predictor)
    rng = np.random.default_rng(config.seed)
    n_files = len(config.files)
    w = np.asarray(config.weights if config.weights else [1.0] * n_files, dtype=float)
    if len(w) != n_files or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights: one non-negative weight per file, not all zero")
    by_file = [np.flatnonzero(rows.file_index == i) for i in range(n_files)]
    for i, idx in enumerate(by_file):
        if len(idx) == 0:
            w[i] = 0.0
    if w.sum() <= 0:
        raise ValueError("no validation rows in the given files")
    which = rng.choice(n_files, size=config.requests, p=w / w.sum())
    row = np.empty(config.requests, dtype=np.int64)
    for i, idx in enumerate(by_file):
        m = which == i
        if m.any():
            row[m] = idx[rng.integers(0, len(idx), size=int(m.sum()))]
    arrival = np.cumsum(rng.exponential(1.0 / config.rate, size=config.requests))
    mt = config.max_tokens
    true = np.clip(rows.output_tokens[row], 1, mt)
    L = rows.input_tokens[row]
    if config.predictor and config.predictor != ORACLE:
        if rows.predicted is None:
            raise ValueError("rows were built without a predictor")
        pred = np.clip(np.rint(rows.predicted[row]), 1, mt).astype(np.int64)
        upper = None if rows.upper is None else np.clip(np.rint(rows.upper[row]), pred, mt).astype(np.int64)
    else:
        pred, upper = true.copy(), None
    k = rng.uniform(config.slo_k_min, config.slo_k_max, size=config.requests)
    slo = np.maximum(config.slo_min_s, k * solo_times(time_model, L, true))
    tasks = [rows.records[r].task for r in row]
    return Workload(config, rows, row, arrival, L, true, pred, slo, tasks, upper)
