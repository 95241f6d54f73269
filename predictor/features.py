"""Magnus feature vector: grouped compression of two embeddings plus the input length."""

from __future__ import annotations

import numpy as np

USER_GROUPS = 16
APP_GROUPS = 4


def compress(vectors: np.ndarray, groups: int) -> np.ndarray:
    """Split each row into ``groups`` equal groups, sum each, divide by sqrt(group size).

    Dividing by sqrt(group size) keeps the compressed values on the scale of one component
    (a sum of n roughly independent unit-scale values grows like sqrt(n)).
    """
    n, d = vectors.shape
    if d % groups:
        raise ValueError(f"embedding size {d} is not divisible into {groups} groups")
    size = d // groups
    return vectors.reshape(n, groups, size).sum(axis=2) / np.sqrt(size)


def magnus_features(user_vecs: np.ndarray, app_vecs: np.ndarray, input_tokens: np.ndarray) -> np.ndarray:
    """[16 user values, 4 app values, input length in tokens] per request."""
    return np.hstack([
        compress(user_vecs, USER_GROUPS),
        compress(app_vecs, APP_GROUPS),
        np.asarray(input_tokens, dtype=np.float32).reshape(-1, 1),
    ]).astype(np.float32)
