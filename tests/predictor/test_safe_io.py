"""Model files load only with allow-listed types."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.ensemble import HistGradientBoostingRegressor, RandomForestRegressor

from predictor import safe_io


class NotSklearn:
    """A type a model file must never instantiate."""

    def __init__(self) -> None:
        self.x = 1


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_models_round_trip_and_foreign_types_are_refused(tmp_path):
    x, y = np.random.default_rng(0).random((50, 3)), np.arange(50.0)
    for i, model in enumerate((RandomForestRegressor(n_estimators=2).fit(x, y),
                               HistGradientBoostingRegressor(max_iter=3).fit(x, y))):
        safe_io.dump(model, tmp_path / f"m{i}.skops")
        assert np.allclose(safe_io.load(tmp_path / f"m{i}.skops").predict(x), model.predict(x))
    safe_io.dump({"evil": NotSklearn()}, tmp_path / "evil.skops")
    with pytest.raises(ValueError, match="allow-list.*NotSklearn"):
        safe_io.load(tmp_path / "evil.skops")
