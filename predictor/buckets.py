"""UELLM output-length buckets: [0,8), [8,16), [16,32), …, [1024,2048).

Why buckets: the classifier only needs to say which power-of-two range a response falls in,
which is what batching by length needs, and a classification head is easier to learn than an
exact count. The representative of a bucket (what the batcher sees as G'(p)) is configurable;
the upper edge is the default because it over-estimates memory rather than under-estimates it.
Lengths at or beyond the last edge land in the last bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_EDGES: tuple[int, ...] = (0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
REPRESENTATIVES = ("upper", "lower", "mid", "mean")


def parse_edges(spec: str | Sequence[int] | None) -> tuple[int, ...]:
    """Edges from '0,8,16,...' or a sequence; must start at 0 and increase strictly."""
    if spec is None:
        return DEFAULT_EDGES
    edges = tuple(int(x) for x in (spec.split(",") if isinstance(spec, str) else spec))
    if len(edges) < 2 or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"bucket edges must start at 0 and increase strictly: {edges}")
    return edges


def n_buckets(edges: Sequence[int] = DEFAULT_EDGES) -> int:
    return len(edges) - 1


def bucket_index(lengths: Sequence[float] | np.ndarray, edges: Sequence[int] = DEFAULT_EDGES) -> np.ndarray:
    """Bucket number of each length: i such that edges[i] <= length < edges[i+1] (clipped)."""
    x = np.asarray(lengths, dtype=float)
    idx = np.searchsorted(np.asarray(edges, dtype=float), x, side="right") - 1
    return np.clip(idx, 0, len(edges) - 2).astype(int)


def bucket_values(edges: Sequence[int] = DEFAULT_EDGES, representative: str = "upper",
                  train_lengths: Sequence[float] | None = None) -> np.ndarray:
    """The length reported for each bucket.

    upper: the upper edge minus one (largest length in the half-open bucket; memory-safe);
    lower: the lower edge (at least 1); mid: the midpoint; mean: the mean training length in
    the bucket (midpoint where a bucket had no training rows).
    """
    e = np.asarray(edges, dtype=float)
    lo, hi = e[:-1], e[1:]
    if representative == "upper":
        vals = hi - 1
    elif representative == "lower":
        vals = np.maximum(lo, 1)
    elif representative == "mid":
        vals = (lo + hi) / 2
    elif representative == "mean":
        vals = (lo + hi) / 2
        if train_lengths is not None and len(train_lengths):
            t = np.asarray(train_lengths, dtype=float)
            idx = bucket_index(t, edges)
            for b in range(len(vals)):
                if np.any(idx == b):
                    vals[b] = float(t[idx == b].mean())
    else:
        raise ValueError(f"representative must be one of {REPRESENTATIVES}, not {representative!r}")
    return np.maximum(vals, 1.0)
