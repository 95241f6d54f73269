"""`cohort predictor recompute-search`: AdaptiveLLM's model search for the recompute-cost
predictor (its own module: the predictor command group is long enough)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def recompute_search(
    samples: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="Profile files of "
                                         "`cohort worker profile-prefill` or `cohort worker profile --gen-lens 1` "
                                         "(repeats of a shape are reduced by --reduce)."),
    layers: int = typer.Option(4, help="The profiled model's layers (the built-in tiny Llama: 4)."),
    hidden: int = typer.Option(128, help="The profiled model's hidden size (the built-in tiny Llama: 128)."),
    test_frac: float = typer.Option(0.2, help="Share of the shapes held back for the error."),
    seed: int = typer.Option(0),
    reduce: str = typer.Option("min", help="How repeated shapes become one time: min | median."),
    json_out: Path = typer.Option(None, "--json", help="Write the whole search here."),
) -> None:
    """AdaptiveLLM's model search for the recompute-cost predictor: 8 regressors × polynomial
    degree 1–5 on (tokens, batch size, layers, hidden), held-back MAPE, beside Magnus's KNN."""
    from predictor.recompute_cost import load_prefill_samples, model_search, search_table

    data = load_prefill_samples(samples, layers, hidden, reduce=reduce)
    result = model_search(data, test_frac=test_frac, seed=seed)
    typer.echo(search_table(result))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"files": [str(p) for p in samples], "layers": layers, "hidden": hidden,
                                        "reduce": reduce, **result}, indent=2))
