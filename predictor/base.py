"""What every length predictor offers: predict G'(p) for a batch of requests, save and load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

META_FILE = "meta.json"  # every model directory: its kind, options and training facts


@dataclass(frozen=True)
class PredictItem:
    """The predictor's view of a request: the two texts Magnus encodes, and the input length."""

    instruction: str
    user_input: str
    input_tokens: int
    task: str | None = None


class LengthPredictor(Protocol):
    """A trained generation-length predictor. ``predict`` takes many items (micro-batching)."""

    kind: str

    def predict(self, items: Sequence[PredictItem]) -> np.ndarray: ...

    def save(self, directory: Path) -> None: ...
