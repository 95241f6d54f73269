"""Measured example: continuous learning follows the lengths the *served* model writes.

Why: the shared data's reference answers were written by other models (text-davinci-003, human
translators, ...). A served model answers at its own length, so a predictor warm-started on the
shared data is off by the served model's verbosity, and its q90 bound stops covering (memory
overflows). This runs the real retraining path (``predictor.learning.retrain_predictor``: log DB →
selection rule → stored set → fit + conformal calibration → registry) end to end, against a
SQLite log DB in a temporary directory:

1. warm start: retrain with an empty log → version 1, trained on the shared train split;
2. "serve" ``--served`` validation requests whose actual lengths are the served model's:
   here a stand-in model that answers ``--verbosity`` × the reference length (no LLM runs on this
   CPU; the factor is a stated assumption, not a measurement of a real model), logged with
   version 1's predictions;
3. retrain → version 2 (learns from the logged lengths; shared rows are dropped once
   ``SERVED_ONLY_ROWS`` logged rows exist);
4. both versions are scored on *other* validation requests with the served model's lengths.

Run: ``python -m predictor.served_shift --kind magnus_fast --verbosity 1.5``; prints one JSON line.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

from cohort.datasets import data_files, load_split
from cohort.logdb import finish_request, get_db_engine, record_request
from cohort.settings import Settings
from predictor.conformal import coverage, predict_bounds
from predictor.data import records_to_items
from predictor.learning import retrain_predictor
from predictor.loading import load_predictor
from predictor.metrics import all_metrics
from predictor.registry import Registry


def _score(directory: Path, items: list, actual: np.ndarray) -> dict[str, float | None]:
    point, upper = predict_bounds(load_predictor(directory), items)
    m = all_metrics(actual, point)
    return {"mae": m["mae"], "kendall_tau": m["kendall_tau"],
            "q90_coverage": None if upper is None else coverage(actual, upper)}


def served_shift_experiment(kind: str = typer.Option("magnus_fast", help="Predictor kind to retrain."),
         verbosity: float = typer.Option(1.5, help="Served model's length = this × reference length."),
         served: int = typer.Option(2000, help="Logged (served) requests used for retraining."),
         test: int = typer.Option(2000, help="Other served requests the two versions are scored on."),
         seed_rows: int = typer.Option(500, help="Shared-data warm-start rows per task."),
         seed: int = typer.Option(0, help="Which validation rows are served vs scored.")) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = Settings(_env_file=None, data_dir=Path(tmp) / "var", database_url=f"sqlite:///{tmp}/log.db",
                     learning_seed_rows_per_task=seed_rows)
        reg = Registry(s.data_dir, "predictor")
        v1 = retrain_predictor(s, force=True, kind=kind)["version"]
        recs = load_split(data_files(), "val")
        idx = np.random.default_rng(seed).permutation(len(recs))
        items, ref = records_to_items([recs[i] for i in idx[:served + test]], s.model)
        actual = np.maximum(1, np.ceil(verbosity * ref))
        model_v1 = load_predictor(reg.path(v1))
        pred_v1 = model_v1.predict(items[:served])
        engine = get_db_engine(s.database_url)
        now = time.time()
        for i, it in enumerate(items[:served]):
            rid = f"req-{i}"
            record_request(engine, {"id": rid, "created": now, "model": s.model, "task": it.task,
                                    "instruction": it.instruction, "user_input": it.user_input,
                                    "input_tokens": it.input_tokens, "max_tokens": 4096,
                                    "predicted_tokens": int(round(pred_v1[i])), "predictor_version": v1,
                                    "status": "queued"})
            finish_request(engine, rid, status="done", actual_tokens=int(actual[i]), finished=now + i * 1e-3)
        out = retrain_predictor(s, kind=kind)
        test_items, test_actual = items[served:], actual[served:]
        result = {"kind": kind, "verbosity": verbosity, "served_rows": served, "test_rows": len(test_items),
                  "added": out["n_added"], "v1_warm_start": _score(reg.path(v1), test_items, test_actual),
                  "v2_served": _score(reg.path(out["version"]), test_items, test_actual),
                  "v2_trained_on": reg.meta(out["version"]).get("data")}
        typer.echo(json.dumps(result, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))


if __name__ == "__main__":
    typer.run(served_shift_experiment)
