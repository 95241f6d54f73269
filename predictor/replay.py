"""Replay benchmark: stream a source's rows in order through predict → complete → learn.

Why: a one-shot ``eval`` says how a model does on new traffic *before* it has seen any; what a
deployment lives with is how fast it recovers. ``replay`` sends rows, in file order, in chunks of
``chunk`` (requests arrive and finish in groups) through ``PredictorService.predict_many_bounds``
— the call the gateway makes — and then hands their actual lengths to
``PredictorService.observe`` — the step the live service runs on completions it reads from the log
DB. So the numbers are those of the code that runs live, not of a re-implementation.

Reported per window of ``window`` rows and over the last ``final`` rows: Kendall τ and MAE of the
point prediction the service handed out (online correction included), and the coverage of the
upper bound the row was planned with (``q90_coverage``); next to them the no-adaptation baseline:
the model alone (``model_tau``, ``model_mae``) and its static table on its own point
(``static_q90_coverage``), so the recovery is visible against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from predictor.base import PredictItem
from predictor.conformal import coverage
from predictor.metrics import kendall_tau, mae
from predictor.service import PredictorService

WINDOW_ROWS = 250
FINAL_ROWS = 500
MAX_MARKED_SHIFTS = 12  # more source changes than this: interleaved traffic, plotted per source


def _window_metrics(actual: np.ndarray, point: np.ndarray, upper: np.ndarray | None,
                    static: np.ndarray | None, raw: np.ndarray) -> dict[str, Any]:
    return {"n": int(len(actual)), "tau": float(kendall_tau(actual, point)), "mae": float(mae(actual, point)),
            "q90_coverage": None if upper is None else coverage(actual, upper),
            "static_q90_coverage": None if static is None else coverage(actual, static),
            "model_tau": float(kendall_tau(actual, raw)), "model_mae": float(mae(actual, raw)),
            # what memory planning reserves per row (tokens): a bound that covers by being huge is waste
            "upper_mean": None if upper is None else float(np.mean(upper)),
            "static_upper_mean": None if static is None else float(np.mean(static))}


def replay(service: PredictorService, items: Sequence[PredictItem], actual: np.ndarray,
           sources: Sequence[str] | None = None, chunk: int = 50, window: int = WINDOW_ROWS,
           final: int = FINAL_ROWS, pool: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Stream ``items`` (in order) through the service; see the module docstring for the report."""
    model = service.model
    if model is None:
        raise ValueError("replay needs a model: the service has none loaded")
    table = getattr(model, "conformal", None)
    actual = np.asarray(actual, float)
    n = len(items)
    point = np.zeros(n)
    raw = np.zeros(n)
    upper = np.full(n, np.nan)
    static = np.full(n, np.nan)
    bar = None
    if progress:
        bar = tqdm(total=n, desc="replay", unit="row")
    for i in range(0, n, chunk):
        part = list(items[i:i + chunk])
        pools = [pool] * len(part)
        p, up, _ = service.predict_many_bounds(part, pools)
        r = np.asarray(model.predict(part), float)  # the model alone: the no-adaptation baseline
        point[i:i + len(part)], raw[i:i + len(part)] = p, r
        if up is not None:
            upper[i:i + len(part)] = up
        if table is not None:
            static[i:i + len(part)] = table.upper(part, r)
        service.observe(part, p, actual[i:i + len(part)], up, pools, raw=r)  # the rows complete: learn
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    has_up = not np.isnan(upper).all()
    has_static = table is not None

    def metrics(sel: slice | np.ndarray) -> dict[str, Any]:
        return _window_metrics(actual[sel], point[sel], upper[sel] if has_up else None,
                               static[sel] if has_static else None, raw[sel])

    windows = []
    for start in range(0, n, window):
        sel = slice(start, min(start + window, n))
        w = {"rows": sel.stop, "first_row": start, **metrics(sel)}
        if sources is not None:
            w["source"] = max(set(sources[sel]), key=list(sources[sel]).count)
            if has_up:  # mixed traffic: is each kind covered, not only the mixture?
                w["q90_coverage_per_source"] = {
                    str(name): coverage(actual[sel][m], upper[sel][m]) for name in dict.fromkeys(sources[sel])
                    if (m := np.asarray(sources[sel]) == name).sum() >= 10}
        windows.append(w)
    segments = [] if sources is None else [
        {"source": str(sources[i]), "first_row": i} for i in range(n) if i == 0 or sources[i] != sources[i - 1]]
    mixed = len(segments) > MAX_MARKED_SHIFTS  # interleaved sources: a change at every other row says nothing
    if mixed:
        segments = []
    last = np.arange(n) >= n - final
    picked = {} if sources is None else {
        str(name): np.flatnonzero(last & (np.asarray(sources) == name)) for name in dict.fromkeys(sources)}
    per_source = {name: metrics(idx) for name, idx in picked.items() if len(idx) > 1}
    return {"rows": n, "chunk": chunk, "window": window, "windows": windows, "segments": segments, "mixed": mixed,
            "final": metrics(slice(max(0, n - final), n)),
            # each source's rows among the last ``final``: on mixed traffic, coverage per kind of request
            "final_per_source": per_source,
            "online": None if service.online is None else {
                "window": service.online.window, "gamma": service.online.gamma,
                "min_rows": service.online.min_rows, "level": service.online.level}}


def plot_replay(result: dict[str, Any], out: Path, title: str) -> None:
    """Coverage of the planned bound per window (online vs static table) and τ / MAE per window."""
    import matplotlib.pyplot as plt  # optional and slow to import: only when a plot is asked for

    plt.switch_backend("Agg")  # files only, no display

    ws = result["windows"]
    x = [w["rows"] for w in ws]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    if ws and ws[0]["q90_coverage"] is not None:
        ax1.plot(x, [w["q90_coverage"] for w in ws], "o-", label="online (rolling window + ACI)")
    if ws and ws[0]["static_q90_coverage"] is not None:
        ax1.plot(x, [w["static_q90_coverage"] for w in ws], "s--", label="static table only")
    level = (result.get("online") or {}).get("level", 0.9)
    ax1.axhline(level, color="k", lw=1, ls=":", label=f"target {level:.2f}")
    ax1.axhspan(0.85, 0.95, color="green", alpha=0.08)
    ax1.set_ylabel(f"q90 coverage per {result['window']} rows")
    ax1.set_ylim(0.4, 1.02)
    if not result.get("mixed"):
        for seg in result.get("segments", [])[1:]:  # where the source changes (the shift)
            for ax in (ax1, ax2):
                ax.axvline(seg["first_row"], color="red", lw=1, alpha=0.6)
            ax1.text(seg["first_row"], 0.42, f" → {seg['source']}", color="red", fontsize=7)
    else:  # interleaved sources: one online coverage line per source instead of a marker per change
        for name in dict.fromkeys(k for w in ws for k in w.get("q90_coverage_per_source", {})):
            pts = [(w["rows"], w["q90_coverage_per_source"][name]) for w in ws
                   if name in w.get("q90_coverage_per_source", {})]
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], ".:", lw=1, label=f"online, {name} rows")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_title(title)
    ax2.plot(x, [w["tau"] for w in ws], "o-", color="tab:purple", label="τ, online-corrected")
    ax2.plot(x, [w["model_tau"] for w in ws], "o--", color="tab:purple", alpha=0.5, label="τ, model alone")
    ax2.set_ylabel("Kendall τ")
    ax3 = ax2.twinx()
    ax3.plot(x, [w["mae"] for w in ws], "^-", color="tab:gray", label="MAE, online-corrected")
    ax3.plot(x, [w["model_mae"] for w in ws], "^--", color="tab:gray", alpha=0.5, label="MAE, model alone")
    ax3.set_ylabel("MAE (tokens)")
    h2, l2 = ax2.get_legend_handles_labels()
    h3, l3 = ax3.get_legend_handles_labels()
    ax2.legend(h2 + h3, l2 + l3, fontsize=7, loc="upper right")
    ax2.set_xlabel("rows replayed (end of window)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
