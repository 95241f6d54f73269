"""A fitted histogram-boosting regressor, evaluated as one numpy array walk instead of tree by tree.

Why: scikit-learn predicts a ``HistGradientBoostingRegressor`` by looping in Python over its
trees, one compiled call (and one OpenMP region) per tree. The gateway predicts one or two
requests at a time, so ``semantic``'s 300 trees cost a few milliseconds per request, nearly all
of it per-tree overhead: in the steady soak (docs/notes/steady.md) it was the largest single cost in
the gateway, which shares a 2-core host with the LLM worker. Here every tree's nodes sit in flat
arrays and all trees descend together, one level per numpy step, so a prediction costs about as
many array operations as the deepest tree has levels.

The answer is the regressor's own, bit for bit: the same descent (NaN follows
``missing_go_to_left``, else ``x <= threshold`` goes left), the leaf values added to the baseline
in the trees' order (``np.cumsum`` adds sequentially, as scikit-learn's loop does), and the
loss's inverse link at the end. Categorical splits are not compiled: ``compile_forest`` returns
None for such a model and the caller keeps scikit-learn's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Up to this many rows the array walk is faster; beyond it, scikit-learn's compiled per-tree loop
# over many rows wins (300 trees of 63 leaves on this 2-core host: 0.4–0.6 ms against 3–5 ms for
# one or two rows, 11 ms against 5 ms for 64)
COMPILED_ROWS = 16


@dataclass(frozen=True)
class CompiledForest:
    """Every tree's nodes in flat arrays, children as flat indices; a leaf is its own child, so
    rows that reached their leaf stay there while the others descend."""

    roots: np.ndarray  # int64 [trees]: each tree's root in the flat arrays
    feature: np.ndarray  # int64 [nodes]
    threshold: np.ndarray  # float64
    missing_left: np.ndarray  # bool
    left: np.ndarray  # int64, flat
    right: np.ndarray  # int64, flat
    is_leaf: np.ndarray  # bool
    value: np.ndarray  # float64
    baseline: float
    depth: int  # the deepest leaf's depth: the most levels any row descends
    inverse_link: object  # the loss's link inverse (identity for squared error); a mean: ÷ trees
    float32_inputs: bool = False  # scikit-learn's decision trees read X as float32

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self.float32_inputs:
            x = np.asarray(x, dtype=np.float32)
        x = np.ascontiguousarray(x, dtype=np.float64)
        n_rows, n_features = x.shape
        flat_x = x.ravel()
        row_base = (np.arange(n_rows) * n_features)[:, None]
        node = np.broadcast_to(self.roots, (n_rows, len(self.roots))).copy()
        for level in range(self.depth):
            if level % 4 == 3 and self.is_leaf[node].all():
                break
            xv = flat_x[row_base + self.feature[node]]
            go_left = (xv <= self.threshold[node]) | (np.isnan(xv) & self.missing_left[node])
            node = np.where(go_left, self.left[node], self.right[node])
        leaves = self.value[node]
        raw = np.cumsum(np.hstack([np.full((n_rows, 1), self.baseline), leaves]), axis=1)[:, -1]
        return self.inverse_link(raw)


def _links(sizes: list[int], left: np.ndarray, right: np.ndarray,
           leaf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each tree's root, left child, right child) in the trees' concatenated node arrays: a
    tree's own child indices shifted by where it starts; a leaf points at itself, so a row that
    reached one stays there while the walk runs its fixed number of levels."""
    roots = np.cumsum([0] + sizes[:-1]).astype(np.int64)
    offset = np.repeat(roots, sizes)
    own = np.arange(sum(sizes), dtype=np.int64)
    return (roots, np.where(leaf, own, offset + left.astype(np.int64)),
            np.where(leaf, own, offset + right.astype(np.int64)))


def compile_random_forest(model) -> CompiledForest | None:
    """The compiled form of a fitted single-output ``RandomForestRegressor`` (Magnus's model), or
    None where it is not one. Its answer is scikit-learn's: X read as float32 as its trees read
    it, the same descent, the trees' values added in order from zero and divided by their number
    (``_accumulate_prediction`` then ``/= len(estimators_)``). Why: scikit-learn predicts a forest
    tree by tree through joblib, ~0.13 ms of overhead per tree, so 100 trees cost the gateway
    10–15 ms per request (docs/notes/upstream.md, "The gateway's prediction")."""
    trees = [e.tree_ for e in getattr(model, "estimators_", [])]
    if not trees or any(t.n_outputs != 1 or t.value.shape[2] != 1 for t in trees):
        return None
    sizes = [t.node_count for t in trees]
    left = np.concatenate([t.children_left for t in trees])
    leaf = left == -1
    roots, left, right = _links(sizes, left, np.concatenate([t.children_right for t in trees]), leaf)
    missing = [getattr(t, "missing_go_to_left", None) for t in trees]
    return CompiledForest(
        roots=roots,
        feature=np.where(leaf, 0, np.concatenate([t.feature for t in trees])).astype(np.int64),
        threshold=np.concatenate([t.threshold for t in trees]).astype(np.float64),
        missing_left=np.concatenate([np.zeros(n, bool) if m is None else np.asarray(m, bool)
                                     for m, n in zip(missing, sizes, strict=True)]),
        left=left,
        right=right,
        is_leaf=leaf,
        value=np.concatenate([t.value[:, 0, 0] for t in trees]).astype(np.float64),
        baseline=0.0,
        depth=max(t.max_depth for t in trees) + 1,
        inverse_link=lambda raw, n=len(trees): raw / n,
        float32_inputs=True,
    )


def compile_forest(model) -> CompiledForest | None:
    """The compiled form of a fitted single-output ``HistGradientBoostingRegressor``, or None
    where it cannot be compiled exactly (categorical splits, more than one output per iteration)."""
    predictors = getattr(model, "_predictors", None)
    if not predictors or any(len(per_iteration) != 1 for per_iteration in predictors):
        return None
    trees = [per_iteration[0].nodes for per_iteration in predictors]
    if any(bool(nodes["is_categorical"].any()) for nodes in trees):
        return None
    nodes = np.concatenate(trees)
    leaf = nodes["is_leaf"].astype(bool)
    roots, left, right = _links([len(t) for t in trees], nodes["left"], nodes["right"], leaf)
    return CompiledForest(
        roots=roots,
        feature=np.where(leaf, 0, nodes["feature_idx"]).astype(np.int64),
        threshold=nodes["num_threshold"].astype(np.float64),
        missing_left=nodes["missing_go_to_left"].astype(bool),
        left=left,
        right=right,
        is_leaf=leaf,
        value=nodes["value"].astype(np.float64),
        baseline=float(np.asarray(model._baseline_prediction).ravel()[0]),
        depth=int(nodes["depth"].max()) + 1,
        inverse_link=model._loss.link.inverse,
    )
