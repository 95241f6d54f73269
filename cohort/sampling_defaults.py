"""The sampling parameters an OpenAI request gets for the fields it leaves out.

OpenAI's defaults are temperature 1 and top_p 1; like vLLM, a served model's own
``generation_config.json`` (its authors' recommended sampling) overrides them for the keys it
sets. One owner: the gateway fills requests from here, and ``/v1/models`` and ``cohort info``
show the same values and where they came from. The native ``/v1/generate`` keeps its own
documented defaults (greedy) and does not read this.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger("cohort.sampling")

OPENAI_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0}
# What a generation config may set, and the range a value must lie in to be taken.
GENERATION_CONFIG_KEYS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (-1, 2**31 - 1), "repetition_penalty": (0.01, 10.0),
}


@dataclass(frozen=True)
class SamplingDefaults:
    values: dict[str, float] = field(default_factory=lambda: dict(OPENAI_DEFAULTS))
    source: str = "openai"   # "openai" or "generation_config"

    def card(self) -> dict[str, Any]:
        return {**self.values, "source": self.source}


def _valid(key: str, value: Any) -> bool:
    lo, hi = GENERATION_CONFIG_KEYS[key]
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and lo <= value <= hi


@lru_cache(maxsize=32)
def sampling_defaults(model: str) -> SamplingDefaults:
    """OpenAI's defaults, overridden by the model directory's generation config where it sets a
    valid value (a value out of range is logged and ignored: the request would be refused)."""
    path = Path(model) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s): OpenAI's sampling defaults apply", path, e)
        config = {}
    values = dict(OPENAI_DEFAULTS)
    taken = False
    for key in GENERATION_CONFIG_KEYS:
        if key in config:
            if _valid(key, config[key]):
                values[key] = config[key]
                taken = True
            else:
                log.warning("%s: %s=%r is out of range; ignored", path, key, config[key])
    return SamplingDefaults(values, "generation_config" if taken else "openai")
