"""The predictor as the gateway uses it: async, micro-batched, hot-reloaded, never blocking the loop.

Why micro-batching: one sentence-encoder forward pass over 32 texts costs far less than 32 passes
over one, so the requests that arrive together (in one turn of the event loop, or within
``max_wait_s`` where a caller sets one) are predicted together in one worker thread (the event
loop keeps accepting requests meanwhile). While one batch runs, the next one accumulates, so
under load batches grow by themselves (up to ``max_batch``) and a lone request waits for nothing:
the default wait is 0 (it was 1 ms, which a sleep on a busy loop made 1–2 ms of every request's
first token at idle).

Which model: ``settings.predictor_dir`` if set (a fixed directory), else the registry's ACTIVE
predictor version. ACTIVE is checked at most once a second (one ``stat``); a changed version is
loaded in a background thread and swapped in with one assignment of a (model, version) tuple,
so a batch always runs on one consistent model. Before any model exists (cold start) the
prediction is ``max_tokens`` (memory-safe) or the number in ``settings.cold_start``.
Predictions are clamped to [1, max_tokens]. A failing model never fails a request: it logs and
answers with the cold-start value. ``predict_bounds`` also returns the model's conformal upper
quantile (see ``predictor.conformal``), which the batcher plans memory with.

The upper quantile is the *current* one: with ``COHORT_ONLINE__CONFORMAL``
(default on) the service reads completed requests from the log DB every
``online.interval_s`` (off the event loop), corrects the point prediction by a
residual model learnt online (``predictor.online_residual``, ``COHORT_ONLINE__CORRECTION``)
and recalibrates the bound online per pool × task / instruction / prompt cluster
(``predictor.online_conformal``, ``predictor.prompt_clusters``);
the state is saved next to the registry's versions (``predictor.online_state``), so a restart
continues from it. ``observe`` is that learning step, shared by the live
path and ``cohort predictor replay``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
from threadpoolctl import threadpool_limits  # comes with scikit-learn

from cohort.logdb import finished_requests, get_db_engine
from cohort.settings import Settings
from predictor.base import META_FILE, LengthPredictor, PredictItem
from predictor.conformal import predict_bounds
from predictor.hotswap import HotSwap
from predictor.loading import load_predictor
from predictor.online_conformal import OnlineConformal
from predictor.online_residual import OnlineResidual
from predictor.online_state import load_state, snapshot_state, state_path, write_state
from predictor.prompt_clusters import PromptClusters, cluster_slot
from predictor.registry import Registry
from predictor.state_writer import StateWriter

log = logging.getLogger(__name__)
# The online state (~200 KB of JSON) is saved at most this often, and at close: it is for restarts,
# and a restart that finds an older cursor reads those completions again. Saving it at every read
# (2 s) was 4 % of the gateway's CPU under load.
SAVE_EVERY_S = 30.0


class Prediction(NamedTuple):
    """What the gateway puts on a request: the point value (grouping: WMA, buckets, HRRN) and the
    upper quantile (memory planning; None when the model has no calibrated bound)."""

    tokens: int
    upper: int | None
    version: str | None


def model_planned(row: dict) -> bool:
    """Whether a completed log-DB row was planned by a model, so its error says something about the
    model: cold-start answers (no model version) and rows planned at ``max_tokens`` (cold start,
    ``ignore_eos``) say nothing, and learning from them would only pull the bound down."""
    return (row.get("predicted_tokens") is not None and row.get("actual_tokens") is not None
            and row.get("predictor_version") is not None
            and (row.get("max_tokens") is None or row["predicted_tokens"] < row["max_tokens"]))


def _limit_threads(n: int) -> None:
    """On the predictor thread, once: OpenMP's thread count is a per-thread setting, so limiting
    it here bounds every prediction and online update that runs on this thread (and nothing else)."""
    threadpool_limits(limits=n, user_api="openmp")


def _slots(keys: list[str | None] | None) -> list[int | None] | None:
    return None if keys is None else [cluster_slot(k) for k in keys]


def logged_item(row: dict) -> PredictItem:
    """A completed log-DB row as the item it was predicted for (what learning and reports read)."""
    return PredictItem(row.get("instruction") or "", row.get("user_input") or "", int(row.get("input_tokens") or 0),
                       row.get("task"))


class PredictorService:
    """``await predict(item, max_tokens) -> (tokens, version | None)``; see the module docstring."""

    def __init__(self, settings: Settings, max_batch: int = 64, max_wait_s: float = 0.0,
                 reload_interval_s: float = 1.0) -> None:
        self.settings = settings
        self.max_batch = int(max_batch)
        self.max_wait_s = float(max_wait_s)
        self.reload_interval_s = float(reload_interval_s)
        self.registry = Registry(settings.data_dir, "predictor")
        self._swap: HotSwap[LengthPredictor | None] = HotSwap("predictor", self._source, None,
                                                              reload_interval_s)
        self._reloading = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predictor",
                                            initializer=_limit_threads, initargs=(settings.predictor_threads,))
        self._pending: list[tuple[PredictItem, str | None, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self._runner_loop: asyncio.AbstractEventLoop | None = None
        self.batches_run = 0
        self.items_predicted = 0
        self._online_lock = threading.Lock()
        self.online_path = state_path(settings.data_dir)
        self._writer = StateWriter(self.online_path)  # several gateway processes learn; one saves
        self.online: OnlineConformal | None = None
        self.residual: OnlineResidual | None = None
        self.clusters: PromptClusters | None = None
        if settings.online.conformal:
            self.online, self.residual, self.clusters = self._load_online()
        self._syncing = False
        self._next_sync = time.monotonic() + settings.online.interval_s
        self._next_save = 0.0  # the first read saves at once
        self._unsaved = False

    # --- model state ----------------------------------------------------------------------------
    @property
    def version(self) -> str | None:
        """Version of the model in use (registry version, or the fixed directory's name)."""
        return self._swap.current[1]

    @property
    def model(self) -> LengthPredictor | None:
        return self._swap.current[0]

    def _source(self):
        """(change key, version, loader) of the model that should be in use: the fixed directory
        when ``predictor_dir`` is set, else the registry's ACTIVE version."""
        if self.settings.predictor_dir is not None:
            d = Path(self.settings.predictor_dir)
            meta = d / META_FILE
            key = (str(d), meta.stat().st_mtime_ns if meta.exists() else None)
            return key, d.name, (lambda: load_predictor(d)) if meta.exists() else None
        mtime = self.registry.active_mtime()
        version = self.registry.active() if mtime is not None else None
        path = self.registry.path(version) if version else None
        return (version, mtime), version, (lambda: load_predictor(path)) if path else None

    def maybe_reload(self, force: bool = False) -> bool:
        """Load the model if the configured directory / ACTIVE version changed. Synchronous;
        cheap when nothing changed (one stat, at most once per ``reload_interval_s``).
        Returns True when a new model was swapped in."""
        return self._swap.maybe_reload(force)

    def _maybe_reload_background(self) -> None:
        """From the event loop: check cheaply, and load a new version off the loop."""
        if self._reloading or not self._swap.due():
            return
        self._reloading = True

        def work() -> None:
            try:
                self.maybe_reload()
            finally:
                self._reloading = False

        threading.Thread(target=work, name="predictor-reload", daemon=True).start()

    def warmup(self) -> None:
        """Load the model and run one prediction so the first request does not pay for loading
        the encoder / base model. The gateway calls this at startup (blocking).

        Why on the predictor thread: torch's OpenMP runtime keeps a worker team per calling thread,
        and a second team makes every small parallel region slower (measured: a GELU 0.23 -> 0.33 ms
        once two threads had run torch ops); loading and warming up where predictions run keeps one."""
        self._executor.submit(self._warm).result()

    def _warm(self) -> None:
        self.maybe_reload(force=True)
        model = self.model
        if model is not None:
            try:
                model.predict([PredictItem("warm up", "warm up", 2)])
            except Exception:
                log.exception("predictor warm-up failed")

    # --- prediction -------------------------------------------------------------------------------
    def cold_value(self, max_tokens: int) -> int:
        """Prediction when no model is available: max_tokens, or settings.cold_start as a number."""
        cs = str(self.settings.cold_start).strip().lower()
        if cs in ("max_tokens", "max", ""):
            return max(1, int(max_tokens))
        try:
            return int(min(max(round(float(cs)), 1), max(1, int(max_tokens))))
        except ValueError:
            return max(1, int(max_tokens))

    @staticmethod
    def _clamp(value: float, max_tokens: int) -> int:
        v = float(value)
        if not np.isfinite(v):
            return max(1, int(max_tokens))
        return int(min(max(round(v), 1), max(1, int(max_tokens))))

    def predict_many(self, items: Sequence[PredictItem]) -> tuple[np.ndarray | None, str | None]:
        """Synchronous batch prediction with the current model (None when cold)."""
        point, _, version = self.predict_many_bounds(items)
        return point, version

    def predict_many_bounds(self, items: Sequence[PredictItem], pools: Sequence[str | None] | None = None
                            ) -> tuple[np.ndarray | None, np.ndarray | None, str | None]:
        """(point, upper quantile, version) for a batch; both are None when cold. The upper
        quantile is the online one where it has learnt a bound for the item's group, else the
        model's static table; upper is None only for a model without a table and no online bound."""
        model, version = self._swap.current
        if model is None or not items:
            return None, None, version
        point, upper = predict_bounds(model, items)
        if self.online is not None:
            static = getattr(model, "conformal", None)
            clustered = self.clusters is not None and self.clusters.fitted is not None
            vectors = self.clusters.vectors(items) if clustered else None  # no encoding before the first fit
            with self._online_lock:
                clusters = None if self.clusters is None else self.clusters.assign(items, vectors)
                if self.residual is not None:
                    self.residual.follow(version)
                    point = self.residual.correct(items, point, pools, _slots(clusters))
                    upper = None if static is None else static.upper(items, point)
                live = self.online.upper(items, point, static, pools, clusters)
            if upper is None and not np.isfinite(live).any():
                return point, None, version
            upper = np.where(np.isfinite(live), live, point if upper is None else upper)
        return point, upper, version

    # --- online recalibration ----------------------------------------------------------
    def _load_online(self) -> tuple[OnlineConformal, OnlineResidual | None, PromptClusters | None]:
        s = self.settings
        conformal = {"window": s.online.window, "gamma": s.online.gamma,
                     "min_rows": s.online.min_rows}
        residual = ({"forget": s.online.forget, "ridge": s.online.ridge,
                     "clusters": s.online.clusters} if s.online.correction else None)
        clusters = {"k": s.online.clusters} if s.online.clusters > 0 else None
        return load_state(self.online_path, conformal, residual, clusters)

    def observe(self, items: Sequence[PredictItem], point: np.ndarray, actual: np.ndarray,
                upper: np.ndarray | None = None, pools: Sequence[str | None] | None = None,
                raw: np.ndarray | None = None) -> None:
        """Learn from completed requests (in completion order): ``point`` and ``upper`` are what they
        were predicted / planned with, ``raw`` the model's own prediction before the online
        correction (None: predicted again now). No-op with online learning off."""
        if self.online is None or not items:
            return
        model = self.model
        if self.residual is not None and raw is None and model is not None:
            # on the prediction thread: models keep LRU vector caches that one thread may touch at a time
            raw = np.asarray(self._executor.submit(model.predict, list(items)).result(), float)
        # on the prediction thread too: the static encoder's tokenizer is the one the models use, and a
        # HF fast tokenizer called from two threads at once can fail ("Already borrowed")
        vectors = None if self.clusters is None else self._executor.submit(self.clusters.vectors, list(items)).result()
        with self._online_lock:
            clusters = None if self.clusters is None else self.clusters.assign(items, vectors)
            self.online.update(items, np.asarray(point, float), np.asarray(actual, float),
                               None if upper is None else np.asarray(upper, float),
                               getattr(model, "conformal", None), pools, clusters)
            if self.residual is not None and raw is not None:
                self.residual.follow(self.version)
                self.residual.update(items, raw, np.asarray(actual, float), pools, _slots(clusters))
            # after the update: the rows were learnt under the keys they were planned with
            refit = self.clusters is not None and self.clusters.observe(items, vectors)
        if refit:  # outside the lock: predictions go on with the old centroids meanwhile
            self.clusters.refit()

    def sync_completions(self, limit: int = 5000) -> int:
        """Read requests completed since the saved cursor from the log DB, ``observe`` them and save
        the state (restart-safe). Returns how many rows were learnt from."""
        if self.online is None:
            return 0
        engine = get_db_engine(self.settings.database_url)
        rows = finished_requests(engine, self.online.cursor, limit=limit)
        if not rows:
            return 0
        used = [r for r in rows if model_planned(r)]
        self.observe([logged_item(r) for r in used],
                     np.array([r["predicted_tokens"] for r in used], float),
                     np.array([r["actual_tokens"] for r in used], float),
                     # the bound each row was planned with (the ACI miss); NaN: not logged, use today's
                     upper=np.array([np.nan if r.get("predicted_upper") is None else r["predicted_upper"]
                                     for r in used], float),
                     pools=[r.get("model") for r in used])
        with self._online_lock:
            self.online.cursor = max(float(r["finished"]) for r in rows)
        self._unsaved = True
        if time.monotonic() >= self._next_save:
            self._next_save = time.monotonic() + SAVE_EVERY_S
            self.save_online()
        return len(used)

    def save_online(self) -> None:
        """The online state and its cursor to their file (restart-safe)."""
        if self.online is None or not self._unsaved or not self._writer.held():
            return
        with self._online_lock:  # a copy under the lock; the file is written after it (predictions wait on it)
            state = snapshot_state(self.online, self.residual, self.clusters)
            self._unsaved = False
        write_state(self.online_path, state)

    def _maybe_sync_background(self) -> None:
        """From the event loop: at most every ``online.interval_s``, read completions off the loop."""
        now = time.monotonic()
        if self.online is None or self._syncing or now < self._next_sync:
            return
        self._syncing = True
        self._next_sync = now + self.settings.online.interval_s

        def work() -> None:
            try:
                self.sync_completions()
            except Exception:  # the log DB may be briefly unavailable: the bound just stays as it is
                log.exception("online conformal: reading completions failed")
            finally:
                self._syncing = False

        threading.Thread(target=work, name="predictor-online", daemon=True).start()

    async def predict(self, item: PredictItem, max_tokens: int) -> tuple[int, str | None]:
        """Predicted generation tokens, clamped to [1, max_tokens], and the model version (None = cold).
        Kept for callers that only group by the point value; memory planning wants ``predict_bounds``."""
        p = await self.predict_bounds(item, max_tokens)
        return p.tokens, p.version

    async def predict_bounds(self, item: PredictItem, max_tokens: int, pool: str | None = None) -> Prediction:
        """Point prediction and upper quantile, both clamped to [1, max_tokens] (upper ≥ point).
        Cold start: the cold value and ``max_tokens`` as the bound (nothing is known, so memory
        planning must assume the worst); a model without a conformal table gives ``upper=None``."""
        self._maybe_reload_background()
        self._maybe_sync_background()
        if self.model is None:
            return Prediction(self.cold_value(max_tokens), max(1, int(max_tokens)), None)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.append((item, pool, fut))
        if self._runner is None or self._runner.done() or self._runner_loop is not loop:
            self._runner_loop = loop
            self._runner = loop.create_task(self._drain())
        value, upper, version = await fut
        if value is None:
            return Prediction(self.cold_value(max_tokens), max(1, int(max_tokens)), None)
        tokens = self._clamp(value, max_tokens)
        return Prediction(tokens, None if upper is None else max(tokens, self._clamp(upper, max_tokens)), version)

    async def _drain(self) -> None:
        """Collect for ``max_wait_s`` (0: what this turn of the loop brought), then predict pending
        items in batches until none are left."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.max_wait_s)
        while self._pending:
            batch = self._pending[:self.max_batch]
            del self._pending[:self.max_batch]
            items = [it for it, _, _ in batch]
            try:
                preds, uppers, version = await loop.run_in_executor(self._executor, self.predict_many_bounds,
                                                                    items, [p for _, p, _ in batch])
            except Exception:
                log.exception("prediction failed for a batch of %d; answering with cold start", len(items))
                preds, uppers, version = None, None, None
            self.batches_run += 1
            self.items_predicted += len(items)
            for i, (_, _, fut) in enumerate(batch):
                if not fut.done():
                    fut.set_result((None if preds is None else float(preds[i]),
                                    None if uppers is None else float(uppers[i]), version))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            self.save_online()
        except OSError:  # a read-only or vanished data dir: the next start reads the completions again
            log.exception("could not save the online predictor state")
        self._writer.release()
