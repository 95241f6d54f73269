"""Load any saved length predictor by the ``kind`` in its meta.json."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from predictor.base import META_FILE, LengthPredictor
from predictor.conformal import ConformalTable

# kind (meta.json) -> "module:Class". Imported only when a model of that kind is loaded: the
# gateway serves one kind and should not pay for torch/peft imports of the others.
CLASSES: dict[str, str] = {
    "magnus": "predictor.magnus:MagnusPredictor",
    "magnus_fast": "predictor.magnus_fast:MagnusFastPredictor",
    "semantic": "predictor.semantic:SemanticPredictor",
    "lora": "predictor.lora:LoraBucketPredictor",
    "linear": "predictor.baselines:LinearLengthPredictor",
    "mean": "predictor.baselines:MeanPredictor",
}
KINDS = tuple(CLASSES)


def predictor_class(kind: str) -> type[LengthPredictor]:
    """The class of a predictor kind (the one registry of kinds)."""
    try:
        module, _, name = CLASSES[kind].partition(":")
    except KeyError:
        raise ValueError(f"unknown predictor kind {kind!r} (expected one of {KINDS})") from None
    return getattr(importlib.import_module(module), name)


def predictor_kind(directory: str | Path) -> str:
    return json.loads((Path(directory) / META_FILE).read_text()).get("kind", "")


def load_predictor(directory: str | Path) -> LengthPredictor:
    """The saved predictor (dispatched on meta.json's kind) with its conformal table attached as
    ``model.conformal`` (None for a model saved without one)."""
    directory = Path(directory)
    try:
        model = predictor_class(predictor_kind(directory)).load(directory)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    model.conformal = ConformalTable.load(directory)
    inner = getattr(model, "model", None)
    if hasattr(inner, "n_jobs"):
        # A loaded model predicts batches of at most a few hundred rows (the gateway's micro-batches,
        # eval's batches of 64): joblib's per-call thread dispatch over 100 trees costs more (~25 ms a
        # batch, measured) than the trees themselves, and the event loop needs the other core.
        inner.n_jobs = 1
    return model
