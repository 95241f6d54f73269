"""Byte units and bytes per element of the dtypes models are stored in: one table for the KV
memory model, the deployer and the benchmarks."""

from __future__ import annotations

KIB = 1024
MIB = 1024**2
GIB = 1024**3

DTYPE_BYTES = {"float64": 8, "float32": 4, "float": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2,
               "bfloat16": 2, "bf16": 2, "int8": 1, "float8": 1}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``float16``, ``torch.bfloat16``, ``bf16`` …)."""
    key = str(name).replace("torch.", "").lower()
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None
