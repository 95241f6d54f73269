"""Prompt clusters for the online bound: unlabelled traffic grouped by what it asks.

Why: the online bound is learnt per group, most specific first: pool × task, else pool × exact
instruction, else pool-wide. Unlabelled traffic whose instructions do not repeat (chat, general
instructions) all falls into the pool-wide group, so its coverage is right *on average* and wrong
per kind of request. On an interleaved stream of Alpaca, code (codealpaca) and tool-use
(gpteacher) prompts the pool-wide bound covered 0.905 / 0.823 / 0.973 of them: code answers
outgrew their plans and tool calls were planned at 2.5× their length. Grouping by prompt cluster
gets each kind near the target without being told what it is (docs/notes/predictors.md).

What: spherical k-means over the MiniLM *static* vector of each request's instruction (its last
``TEXT_CHARS`` characters, where the ask and the template are; the input when there is no
instruction) — a tokenizer call and a gather, so it costs the gateway little. Online:
- nothing is assigned until ``min_fit`` completions were seen; then k-means (k-means++) over the
  buffer of the last ``buffer`` completed prompts;
- every ``refit_every`` completions it is refitted on the buffer, starting from the current
  centroids, so a cluster keeps its number while its traffic drifts and the windows learnt under
  that number stay meaningful;
- a centroid that moved far from where its generation began (cosine below ``RENAME_COS``: new
  traffic took over a cluster whose old traffic stopped, at once or over several refits) gets a
  new generation, so its key is new and it does not inherit the window of what it used to hold.

The key is ``clu:<number>.<generation>``. Centroids, generations and counters are saved in the
service's online state (restart-safe); the buffer is not (it refills from new completions).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from predictor.base import PredictItem

K = 8
BUFFER = 2000
REFIT_EVERY = 250
MIN_FIT = 200
TEXT_CHARS = 400
RENAME_COS = 0.8  # a centroid that moved this far is another cluster now


def cluster_text(item: PredictItem) -> str:
    """What a prompt is clustered by: the instruction's end (the ask, the template), else the input."""
    instr = item.instruction.strip()
    return instr[-TEXT_CHARS:] if instr else item.user_input[:TEXT_CHARS]


def cluster_slot(key: str | None) -> int | None:
    """The centroid number in a cluster key ``clu:<n>.<generation>`` (None for None)."""
    return None if key is None else int(key.split(":", 1)[1].split(".", 1)[0])


def _default_embed(texts: Sequence[str]) -> np.ndarray:
    from predictor.magnus_fast import static_encode  # loads the tokenizer and table once, on first use

    return static_encode(texts)


class PromptClusters:
    """``assign(items)`` → cluster keys (None before the first fit); ``observe(items)`` learns."""

    def __init__(self, k: int = K, buffer: int = BUFFER, refit_every: int = REFIT_EVERY, min_fit: int = MIN_FIT,
                 embed: Callable[[Sequence[str]], np.ndarray] | None = None, seed: int = 0) -> None:
        self.k, self.refit_every, self.min_fit, self.seed = int(k), int(refit_every), int(min_fit), seed
        self._embed = embed or _default_embed
        self.buffer: deque[np.ndarray] = deque(maxlen=int(buffer))
        # (unit centroids, generation of each): one attribute, swapped whole by ``refit``, so a reader
        # on another thread never sees new centroids with old generations
        self.fitted: tuple[np.ndarray, list[int]] | None = None
        self.anchors: np.ndarray | None = None  # where each centroid's current generation began
        self.seen = 0
        self.since_fit = 0
        self.fits = 0

    # --- use --------------------------------------------------------------------------------------
    def vectors(self, items: Sequence[PredictItem]) -> np.ndarray:
        """Unit vectors of the items' cluster texts (one embed call for the batch)."""
        v = np.asarray(self._embed([cluster_text(it) for it in items]), dtype=np.float32)
        return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-9)

    def assign(self, items: Sequence[PredictItem], vectors: np.ndarray | None = None) -> list[str | None]:
        """Each item's cluster key: its nearest centroid (cosine), or None before the first fit."""
        fitted = self.fitted
        if fitted is None or not items:
            return [None] * len(items)
        centroids, generations = fitted
        v = self.vectors(items) if vectors is None else vectors
        nearest = np.argmax(v @ centroids.T, axis=1)
        return [f"clu:{int(c)}.{generations[int(c)]}" for c in nearest]

    # --- learning ---------------------------------------------------------------------------------
    def observe(self, items: Sequence[PredictItem], vectors: np.ndarray | None = None) -> bool:
        """Remember completed prompts. Returns True when a (re)fit is due: the caller runs ``refit``,
        outside any lock that predictions wait on (a fit takes a fraction of a second)."""
        if not items:
            return False
        v = self.vectors(items) if vectors is None else vectors
        self.buffer.extend(v)
        self.seen += len(items)
        self.since_fit += len(items)
        if self.fitted is None:
            return len(self.buffer) >= self.min_fit
        return self.since_fit >= self.refit_every

    def refit(self) -> None:
        """k-means over the buffer, from the current centroids when there are as many as asked."""
        from sklearn.cluster import KMeans  # scikit-learn is slow to import: only where clusters are fitted

        x = np.stack(list(self.buffer))
        k = min(self.k, len(np.unique(x.round(4), axis=0)))
        if k < 1:
            return
        old = self.fitted
        if old is not None and len(old[0]) == k:
            km = KMeans(k, init=old[0], n_init=1, max_iter=50, random_state=self.seed).fit(x)
        else:
            km = KMeans(k, n_init=3, max_iter=100, random_state=self.seed).fit(x)
        c = km.cluster_centers_ / np.maximum(np.linalg.norm(km.cluster_centers_, axis=1, keepdims=True), 1e-9)
        c = c.astype(np.float32)
        if old is None or len(old[0]) != k or self.anchors is None:
            generations = [self.fits] * k  # a new numbering: its keys never collide with an older fit's
            self.anchors = c.copy()
        else:
            moved = np.sum(c * self.anchors, axis=1) < RENAME_COS
            # a generation is the number of the fit it began at: never the same key twice for a slot
            generations = [self.fits if m else g for g, m in zip(old[1], moved, strict=True)]
            self.anchors[moved] = c[moved]
        self.fitted = (c, generations)
        self.since_fit = 0
        self.fits += 1

    # --- persistence ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        fitted = self.fitted
        return {"k": self.k, "seen": self.seen, "since_fit": self.since_fit, "fits": self.fits,
                "generations": None if fitted is None else list(fitted[1]),
                "centroids": None if fitted is None else fitted[0].round(6).tolist(),
                "anchors": None if self.anchors is None else self.anchors.round(6).tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], **opts: Any) -> PromptClusters:
        """The saved clusters (``opts`` as for the constructor; a changed ``k`` refits from scratch)."""
        self = cls(**opts)
        if d.get("centroids") is not None and int(d.get("k", self.k)) == self.k:
            self.fitted = (np.asarray(d["centroids"], dtype=np.float32), [int(g) for g in d["generations"]])
            self.anchors = np.asarray(d.get("anchors") or d["centroids"], dtype=np.float32)
            self.fits = int(d.get("fits", 1))
        self.seen = int(d.get("seen", 0))
        self.since_fit = int(d.get("since_fit", 0))
        return self
