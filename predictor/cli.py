"""`cohort predictor ...` commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="predictor commands.", no_args_is_help=True)
