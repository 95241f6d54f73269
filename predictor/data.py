"""From shared-data records (or log-DB rows) to what predictors train on: items and targets.

Why one place: training, evaluation and continuous learning must count tokens the same way
the gateway does, or the model learns one quantity and is asked about another.

``input_tokens`` (L(p)) = tokens of the prompt exactly as the gateway and the worker count them
(``cohort.tokenizer.build_prompt`` + ``prompt_token_counts``) under the configured tokenizer. The target is the reference output's token count under
the same tokenizer (``cohort.tokenizer.count_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cohort.datasets import Record
from cohort.settings import DEFAULT_MODEL
from cohort.tokenizer import build_prompt, count_tokens, prompt_token_counts
from predictor.base import PredictItem
from predictor.embcache import EmbeddingCache
from predictor.encoder import encode
from predictor.features import magnus_features


def input_token_counts(instructions: Sequence[str], inputs: Sequence[str],
                       model: str = DEFAULT_MODEL) -> list[int]:
    """L(p) per request, as the gateway computes it (the prompt the worker will read)."""
    prompts = [build_prompt(i, u) for i, u in zip(instructions, inputs, strict=True)]
    return prompt_token_counts(prompts, model) if prompts else []


def records_to_items(records: Sequence[Record], model: str = DEFAULT_MODEL
                     ) -> tuple[list[PredictItem], np.ndarray]:
    """PredictItems and integer targets (output token counts) for shared-data records."""
    if not records:
        return [], np.zeros(0)
    lens = input_token_counts([r.instruction for r in records], [r.input for r in records], model)
    items = [PredictItem(r.instruction, r.input, n, r.task) for r, n in zip(records, lens, strict=True)]
    targets = np.asarray(count_tokens([r.output for r in records], model), dtype=float)
    return items, targets


def magnus_feature_matrix(items: Sequence[PredictItem], cache_dir: str | Path | None,
                          encoder_path: str | None = None, show_progress: bool = False,
                          dtype: str | None = None) -> np.ndarray:
    """Magnus features for many items, through the on-disk embedding cache when one is given.
    ``dtype``: the encoder dtype of the model the features are for (None: the configured one)."""
    cache = EmbeddingCache(cache_dir, encoder_path, dtype) if cache_dir is not None else None

    def vectors(texts: list[str], progress: bool = False) -> np.ndarray:
        if cache is not None:
            return cache.encode(texts, show_progress=progress)
        return encode(texts, encoder_path, show_progress=progress, dtype=dtype)

    user = vectors([it.user_input for it in items], show_progress)
    app_texts = list(dict.fromkeys(it.instruction for it in items))
    app_map = dict(zip(app_texts, vectors(app_texts), strict=True))
    app = np.stack([app_map[it.instruction] for it in items])
    return magnus_features(user, app, np.array([it.input_tokens for it in items]))
