"""On-disk cache of sentence embeddings, keyed by (encoder, text) hash.

Why: encoding tens of thousands of texts with MiniLM takes minutes on a 2-core CPU, and
training, evaluation and hyper-parameter sweeps all need the same vectors. The cache is a set
of ``.npz`` shards (``keys`` = hex digests, ``vecs`` = float32 rows) under
``<cache_dir>/<encoder-id>/``; new vectors go to a new shard, written atomically, so several
runs may share it and a crashed run never leaves a half-written file behind. Plain NumPy
arrays, loaded with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from predictor.encoder import configured_backend, default_encoder_path, encode, encoder_id, encoding_dtype


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _cache_dir_name(encoder_path: str | None, dtype: str) -> str:
    """The encoder and its dtype: bf16 vectors differ from fp32 ones in the 4th digit, and a cache
    must not hand one out for the other (fp32 keeps the id it always had)."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return f"{encoder_id(encoder_path or default_encoder_path())}{suffix}"


class EmbeddingCache:
    """Maps texts to embeddings, computing only the ones it has not seen."""

    def __init__(self, cache_dir: str | Path, encoder_path: str | None = None, dtype: str | None = None) -> None:
        self.encoder_path = encoder_path
        self.dtype = encoding_dtype(configured_backend(), dtype)
        self.dir = Path(cache_dir) / _cache_dir_name(encoder_path, self.dtype)
        self._index: dict[str, np.ndarray] = {}
        self._loaded: set[str] = set()

    def _load_shards(self) -> None:
        if not self.dir.is_dir():
            return
        for shard in sorted(self.dir.glob("*.npz")):
            if shard.name in self._loaded:
                continue
            with np.load(shard, allow_pickle=False) as z:
                for k, v in zip(z["keys"].tolist(), z["vecs"], strict=True):
                    self._index[k] = v
            self._loaded.add(shard.name)

    def encode(self, texts: Sequence[str], show_progress: bool = False, batch_size: int = 64) -> np.ndarray:
        """Embeddings for ``texts`` (float32 rows), from the cache where possible."""
        self._load_shards()
        keys = [_digest(t) for t in texts]
        missing: dict[str, str] = {}
        for k, t in zip(keys, texts, strict=True):
            if k not in self._index and k not in missing:
                missing[k] = t
        if missing:
            mkeys = list(missing)
            # Encode longest-first in chunks so each chunk is saved as we go (a long run that is
            # interrupted keeps what it computed) and padding inside a batch stays small.
            order = sorted(mkeys, key=lambda k: len(missing[k]))
            chunk = 4096
            for i in range(0, len(order), chunk):
                part = order[i:i + chunk]
                vecs = encode([missing[k] for k in part], self.encoder_path, batch_size=batch_size,
                              show_progress=show_progress, dtype=self.dtype)
                self._write_shard(part, vecs)
                for k, v in zip(part, vecs, strict=True):
                    self._index[k] = v
        if not keys:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([self._index[k] for k in keys]).astype(np.float32)

    def _write_shard(self, keys: list[str], vecs: np.ndarray) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{uuid.uuid4().hex}.npz"
        tmp = self.dir / f".{name}.tmp.npz"
        np.savez(tmp, keys=np.array(keys), vecs=np.asarray(vecs, dtype=np.float32))
        os.replace(tmp, self.dir / name)
        self._loaded.add(name)
