"""Load any saved length predictor by the ``kind`` in its meta.json."""

from __future__ import annotations

import json
from pathlib import Path

from predictor.base import LengthPredictor
from predictor.conformal import ConformalTable

KINDS = ("magnus", "magnus_fast", "semantic", "lora", "linear", "mean")


def predictor_kind(directory: str | Path) -> str:
    return json.loads((Path(directory) / "meta.json").read_text()).get("kind", "")


def load_predictor(directory: str | Path) -> LengthPredictor:
    """The saved predictor (dispatched on meta.json's kind) with its conformal table attached as
    ``model.conformal`` (None for a model saved without one)."""
    directory = Path(directory)
    model = _load_kind(directory, predictor_kind(directory))
    model.conformal = ConformalTable.load(directory)
    return model


def _load_kind(directory: Path, kind: str) -> LengthPredictor:
    """magnus | magnus_fast | lora | linear | mean | semantic; heavy imports only when needed."""
    if kind == "magnus":
        from predictor.magnus import MagnusPredictor

        return MagnusPredictor.load(directory)
    if kind == "magnus_fast":
        from predictor.magnus_fast import MagnusFastPredictor

        return MagnusFastPredictor.load(directory)
    if kind == "semantic":
        from predictor.semantic import SemanticPredictor

        return SemanticPredictor.load(directory)
    if kind == "lora":
        from predictor.lora import LoraBucketPredictor

        return LoraBucketPredictor.load(directory)
    if kind == "linear":
        from predictor.baselines import LinearLengthPredictor

        return LinearLengthPredictor.load(directory)
    if kind == "mean":
        from predictor.baselines import MeanPredictor

        return MeanPredictor.load(directory)
    raise ValueError(f"{directory}: unknown predictor kind {kind!r} (expected one of {KINDS})")
