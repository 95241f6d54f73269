"""What the planner needs to know about a model, read from the model itself.

HELR places whole transformer blocks, so it needs: the name of the block container
(``model.layers`` for Llama/Qwen, ``transformer.encoder.layers`` for ChatGLM, ...), the
bytes of each block, and the modules outside the blocks (embeddings, final norm, head) with
their bytes and whether they run before or after the blocks. Rather than a table per
architecture, the model is instantiated on the meta device (accelerate's
``init_empty_weights``: no memory, no weights read) and its module tree is walked. The block
container is the ``nn.ModuleList`` holding most parameters (preferring one whose length is
the configured layer count); everything registered before it is a *pre* module (goes to the
first pipeline device), everything after it a *post* module (last device). Buffer-only
modules (rotary tables) and heads tied to the input embedding go with the first device,
because that is where their inputs/storage live.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn

from cohort.units import dtype_bytes


@dataclass
class Unit:
    """One entry of a device_map: a module (or parameter) placed as a whole."""

    name: str
    bytes: int
    role: str  # "layer" | "pre" | "post"
    layer_index: int | None = None
    buffer_only: bool = False
    tied_to_pre: bool = False
    read_bytes: int = 0  # weight bytes read per token outside the blocks (final norm, head matmul)

    @property
    def on_first(self) -> bool:
        """Placed on the first pipeline device (embeddings, rotary tables, tied heads)."""
        return self.role == "pre" or self.buffer_only or self.tied_to_pre


@dataclass
class ModelShape:
    """Layer structure and byte sizes of a causal LM, independent of the architecture."""

    layer_prefix: str
    units: list[Unit]
    dtype_bytes: int
    hidden_size: int | None = None
    no_split_module_classes: list[str] = field(default_factory=list)
    model: nn.Module | None = field(default=None, repr=False)  # the meta model (for accelerate)
    source: str = ""

    @property
    def layers(self) -> list[Unit]:
        return sorted((u for u in self.units if u.role == "layer"), key=lambda u: u.layer_index or 0)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_layer(self) -> int:
        """m: the largest block (conservative when blocks differ, e.g. mixed MoE/dense)."""
        return max((u.bytes for u in self.layers), default=0)

    @property
    def first_bytes(self) -> int:
        """Bytes that must sit on the first pipeline device (embeddings & co.)."""
        return sum(u.bytes for u in self.units if u.role != "layer" and u.on_first)

    @property
    def last_bytes(self) -> int:
        """Bytes that must sit on the last pipeline device (final norm, untied head)."""
        return sum(u.bytes for u in self.units if u.role != "layer" and not u.on_first)

    @property
    def first_read_bytes(self) -> int:
        """Per-token weight reads on the first device outside blocks (a head tied to the embedding)."""
        return sum(u.read_bytes for u in self.units if u.role == "post" and u.on_first)

    @property
    def last_read_bytes(self) -> int:
        """Per-token weight reads on the last device outside blocks (final norm + untied head).

        Embedding lookups read one row per token and are not counted; the head is a full
        matmul over vocab x hidden, often as large as several blocks, so it is.
        """
        return sum(u.read_bytes for u in self.units if u.role == "post" and not u.on_first)

    @property
    def total_bytes(self) -> int:
        return sum(u.bytes for u in self.units)

    @property
    def layer_names(self) -> list[str]:
        return [u.name for u in self.layers]


def dtype_nbytes(dtype: str | torch.dtype | None) -> int:
    """Bytes per element of a dtype name (``float16``, ``torch.bfloat16``, ``bf16`` ...)."""
    if dtype is None:
        return 2
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return dtype_bytes(dtype)


def _config_dtype(config: Any) -> str | None:
    for attr in ("dtype", "torch_dtype"):
        v = getattr(config, attr, None)
        if v is not None:
            return str(v).replace("torch.", "")
    return None


def _num_layers_hint(config: Any) -> int | None:
    for attr in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        v = getattr(config, attr, None)
        if isinstance(v, int):
            return v
    return None


def find_layer_container(model: nn.Module, num_layers: int | None = None) -> str:
    """Name of the ``ModuleList`` of transformer blocks.

    The blocks hold nearly all parameters, so the ModuleList with the most parameters is
    them; a list whose length equals the configured layer count wins ties and guards
    against e.g. a big list of experts inside a block.
    """
    best: tuple[int, int, str] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        params = sum(p.numel() for p in mod.parameters())
        score = (int(num_layers is not None and len(mod) == num_layers), params, name)
        key = (score[0], score[1])
        if best is None or key > (best[0], best[1]):
            best = score
    if best is None:
        raise ValueError("model has no nn.ModuleList of blocks; cannot pipeline it")
    return best[2]


def shape_from_module(model: nn.Module, dtype: str | torch.dtype | None = None,
                      num_layers: int | None = None, layer_container: str | None = None) -> ModelShape:
    """Walk ``model``'s module tree into placement units with byte sizes.

    Floating-point tensors are counted at ``dtype`` (the dtype the model will be loaded in);
    other tensors at their own size. Shared (tied) parameters are counted once, on the
    first unit that owns them.
    """
    nbytes = dtype_nbytes(dtype)
    container = layer_container or find_layer_container(model, num_layers)
    modules = dict(model.named_modules())
    blocks = modules[container]

    def tensor_bytes(t: torch.Tensor) -> int:
        # Parameters are loaded in the target dtype; buffers (rotary tables, masks) keep theirs.
        if isinstance(t, nn.Parameter) and t.is_floating_point():
            return t.numel() * nbytes
        return t.numel() * t.element_size()

    seen: dict[int, str] = {}  # id(param) -> unit name that owns it

    def unit_bytes(uname: str, mod: nn.Module | None, tensors: list[tuple[str, torch.Tensor]]) -> tuple[int, bool]:
        total, tied_elsewhere = 0, False
        items = tensors if mod is None else list(mod.named_parameters(remove_duplicate=False)) + \
            list(mod.named_buffers(remove_duplicate=False))
        for _, t in items:
            key = id(t)
            if key in seen:
                if seen[key] != uname:
                    tied_elsewhere = True
                continue
            seen[key] = uname
            total += tensor_bytes(t)
        return total, tied_elsewhere

    units: list[Unit] = []
    state = {"role": "pre"}

    def has_tensors(mod: nn.Module) -> bool:
        return any(True for _ in mod.parameters()) or any(True for _ in mod.buffers())

    def visit(prefix: str, mod: nn.Module) -> None:
        if mod is blocks:
            for i, (cname, child) in enumerate(mod.named_children()):
                name = f"{prefix}.{cname}" if prefix else cname
                b, _ = unit_bytes(name, child, [])
                units.append(Unit(name=name, bytes=b, role="layer", layer_index=i))
            state["role"] = "post"
            return
        contains_blocks = container == prefix or container.startswith(prefix + ".") or prefix == ""
        if not contains_blocks:
            if has_tensors(mod):
                b, tied = unit_bytes(prefix, mod, [])
                buffer_only = not any(True for _ in mod.parameters())
                read = sum(tensor_bytes(t) for t in mod.parameters()) if state["role"] == "post" else 0
                units.append(Unit(name=prefix, bytes=b, role=state["role"], buffer_only=buffer_only,
                                  tied_to_pre=tied and state["role"] == "post", read_bytes=read))
            return
        # An ancestor of the block list: its own tensors become parameter-level entries.
        own = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
        for tname, t in own:
            name = f"{prefix}.{tname}" if prefix else tname
            b, tied = unit_bytes(name, None, [(tname, t)])
            is_param = isinstance(t, nn.Parameter)
            units.append(Unit(name=name, bytes=b, role=state["role"], buffer_only=not is_param,
                              tied_to_pre=tied and state["role"] == "post",
                              read_bytes=tensor_bytes(t) if is_param and state["role"] == "post" else 0))
        for cname, child in mod.named_children():
            visit(f"{prefix}.{cname}" if prefix else cname, child)

    visit("", model)
    no_split = sorted({type(blocks[0]).__name__} | set(getattr(model, "_no_split_modules", None) or []))
    hidden = None
    cfg = getattr(model, "config", None)
    if cfg is not None:
        hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    return ModelShape(layer_prefix=container, units=units, dtype_bytes=nbytes, hidden_size=hidden,
                      no_split_module_classes=no_split, model=model)


def load_config(path: str | Path, trust_remote_code: bool = False) -> Any:
    """An HF config from a model directory or a bare ``config.json`` file.

    ``trust_remote_code`` is needed for models that ship their own code (ChatGLM); it runs
    that code, exactly as loading the model would.
    """
    from transformers import AutoConfig  # transformers (~2 s): only when a model is read

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    return AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)


def meta_model(config: Any, trust_remote_code: bool = False) -> nn.Module:
    """Instantiate ``config``'s causal-LM class on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM  # transformers (~2 s): only when a model is read

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    # init_empty_weights re-registers parameters, which unties tied heads; tie them again
    # so shared storage is counted (and placed) once.
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def load_model_shape(path: str | Path, dtype: str | torch.dtype | None = None,
                     trust_remote_code: bool = False) -> ModelShape:
    """Shape of the model at ``path`` (HF directory or bare config.json).

    ``dtype`` defaults to the config's dtype, else float16 (what a GPU worker loads).
    """
    config = load_config(path, trust_remote_code)
    if dtype is None:
        dtype = _config_dtype(config) or "float16"
    model = meta_model(config, trust_remote_code)
    shape = shape_from_module(model, dtype=dtype, num_layers=_num_layers_hint(config))
    shape.source = str(path)
    return shape


def describe(shape: ModelShape) -> dict[str, Any]:
    """A JSON-able summary (used by the CLI and docs)."""
    return {
        "layer_prefix": shape.layer_prefix,
        "num_layers": shape.num_layers,
        "bytes_per_layer": shape.bytes_per_layer,
        "first_bytes": shape.first_bytes,
        "last_bytes": shape.last_bytes,
        "total_bytes": shape.total_bytes,
        "units": [u.name for u in shape.units],
    }


if __name__ == "__main__":  # pragma: no cover - manual inspection
    print(json.dumps(describe(load_model_shape(sys.argv[1])), indent=1))
