"""`cohort predictor recompute-search`: AdaptiveLLM's model search for the recompute-cost
predictor (its own module: the predictor command group is long enough). ``--save`` stores the
pick where the live worker reads it (``predictor.recompute_cost.load_cost_file``). Its imports are
at the top: its one importer, ``predictor.cli``, loads scikit-learn and numpy anyway."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer

from cohort.settings import get_settings
from predictor.recompute_cost import load_prefill_samples, model_search, save_cost_file, search_table


def recompute_search(
    samples: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="Profile files of "
                                         "`cohort worker profile-prefill` or `cohort worker profile --gen-lens 1` "
                                         "(repeats of a shape are reduced by --reduce)."),
    layers: int = typer.Option(None, help="The profiled model's layers (default: the file's, else 4, the "
                               "built-in tiny Llama)."),
    hidden: int = typer.Option(None, help="The profiled model's hidden size (default: the file's, else 128)."),
    test_frac: float = typer.Option(0.2, help="Share of the shapes held back for the error."),
    seed: int = typer.Option(0),
    reduce: str = typer.Option("min", help="How repeated shapes become one time: min | median."),
    json_out: Path = typer.Option(None, "--json", help="Write the whole search here."),
    save: Path = typer.Option(None, help="Store the pick for the live worker here (its default: "
                              "<data_dir>/profile/recompute-cost.json, COHORT_RECOMPUTE_COST_PATH)."),
) -> None:
    """AdaptiveLLM's model search for the recompute-cost predictor: 8 regressors × polynomial
    degree 1–5 on (tokens, batch size, layers, hidden), held-back MAPE, beside Magnus's KNN."""
    head = json.loads(samples[0].read_text())
    head = head if isinstance(head, dict) else {}
    layers = layers or int(head.get("layers", 4))
    hidden = hidden or int(head.get("hidden", 128))
    data = load_prefill_samples(samples, layers, hidden, reduce=reduce)
    result = model_search(data, test_frac=test_frac, seed=seed)
    typer.echo(search_table(result))
    spreads = [s["spread_pct"] for p in samples for s in json.loads(p.read_text()).get("samples", [])
               if isinstance(s, dict) and "spread_pct" in s]
    if spreads:
        result["repeat_spread_pct"] = {"mean": float(np.mean(spreads)), "median": float(np.median(spreads))}
        typer.echo(f"repeats per shape: median over fastest {result['repeat_spread_pct']['mean']:.2f} % on "
                   f"average ({result['repeat_spread_pct']['median']:.2f} % median)")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"files": [str(p) for p in samples], "layers": layers, "hidden": hidden,
                                        "reduce": reduce, **result}, indent=2))
    if save:
        model = head.get("model") or get_settings().model
        device = str(head.get("device", "cpu")).split(":")[0]
        save_cost_file(save, data, result, model, device, samples)
        typer.echo(f"saved for {model} on {device}: {save}")
