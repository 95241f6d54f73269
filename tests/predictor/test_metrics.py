import math

import numpy as np
import pytest

from predictor import metrics
from predictor.buckets import bucket_index, bucket_values, parse_edges


def test_metrics_hand_computed():
    a = [10, 20, 30, 100]
    p = [12, 18, 90, 100]
    # errors 2, 2, 60, 0
    assert metrics.mae(a, p) == pytest.approx(64 / 4)
    assert metrics.rmse(a, p) == pytest.approx(math.sqrt((4 + 4 + 3600 + 0) / 4))
    assert metrics.acc_within(a, p, 50) == pytest.approx(0.75)
    assert metrics.acc_within(a, p, 100) == pytest.approx(1.0)
    # buckets: 10->[8,16) 12->[8,16); 20,18->[16,32); 30->[16,32) 90->[64,128); 100,100 same
    assert metrics.bucket_accuracy(a, p) == pytest.approx(0.75)
    assert metrics.pearson(a, p) == pytest.approx(np.corrcoef(a, p)[0, 1])
    # Kendall: pairs (i<j) of a are all increasing; p = 12,18,90,100 also strictly increasing -> tau = 1
    assert metrics.kendall_tau(a, p) == pytest.approx(1.0)
    assert metrics.kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_all_metrics_keys_and_nan_to_none():
    m = metrics.all_metrics([5, 5, 5], [5, 5, 5])
    assert set(m) == set(metrics.METRIC_KEYS)
    assert m["n"] == 3 and m["mae"] == 0
    assert m["pearson"] is None and m["kendall_tau"] is None  # undefined for constants


def test_buckets():
    e = parse_edges(None)
    assert e[:4] == (0, 8, 16, 32) and e[-1] == 2048
    assert bucket_index([0, 7, 8, 15, 16, 1023, 1024, 2047, 5000], e).tolist() == [0, 0, 1, 1, 2, 7, 8, 8, 8]
    up = bucket_values(e, "upper")
    assert up[0] == 7 and up[1] == 15 and up[-1] == 2047
    assert bucket_values(e, "lower")[0] == 1 and bucket_values(e, "mid")[1] == 12
    mean = bucket_values(e, "mean", train_lengths=[10, 12, 100])
    assert mean[1] == 11 and mean[6] == 384  # empty bucket -> midpoint
    with pytest.raises(ValueError):
        parse_edges("1,2,3")
    assert parse_edges("0,10,100") == (0, 10, 100)
