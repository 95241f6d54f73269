"""Admin retrains coalesce: one that waited while a retrain of its target started is not run again."""

from __future__ import annotations

import time

import learning.tasks as tasks
from cohort.settings import Settings
from predictor.learning import _save_state


def test_a_request_older_than_the_last_start_is_coalesced(tmp_path, monkeypatch):
    s = Settings(data_dir=tmp_path)
    monkeypatch.setattr(tasks, "get_settings", lambda: s)
    calls = []

    def fit(settings, force):
        calls.append(force)
        _save_state(settings, predictor_started=time.time())
        return {"version": "v1", "retrained": True}

    asked = time.time()
    assert tasks._retrain("retrain_predictor", fit, True, requested_at=asked)["retrained"]
    assert tasks._retrain("retrain_predictor", fit, True, requested_at=asked) == {"retrained": False,
                                                                                  "coalesced": True}
    assert tasks._retrain("retrain_predictor", fit, True, requested_at=time.time() + 1)["retrained"]
    assert tasks._retrain("retrain_predictor", fit, False)["retrained"]  # periodic: no request time
    assert len(calls) == 3
