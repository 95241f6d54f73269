"""Loading the LLM an instance serves. The only module (with engine.py) that touches torch models.

The built-in default is a small Llama-architecture model with seeded random weights and the
bundled MiniLM tokenizer: no download, runs on a CPU in seconds, and exercises the real code
path (KV cache, padding, batch cost). Any HF causal-LM path works the same way.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from cohort.settings import DEFAULT_MODEL, Settings
from cohort.tokenizer import load_tokenizer
from deployer import plan_device_map as plan
from workers.lm_head import install_measured_head
from workers.tiny_llama import TINY_LLAMA

log = logging.getLogger(__name__)


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[setting]


def tiny_llama_config(vocab_size: int, pad_id: int, eos_id: int, bos_id: int | None):
    # transformers' model classes pull in torch._dynamo (seconds): imported when a model is built,
    # not by every process that imports the worker package (the CLI, the batcher, `cohort --help`).
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, pad_token_id=pad_id, eos_token_id=eos_id,
                       bos_token_id=bos_id, tie_word_embeddings=True, **TINY_LLAMA)


def load_model(settings: Settings) -> tuple[Any, Any, torch.device]:
    """(model, tokenizer, input device). Honours COHORT_DEVICE_MAP=helr|he|lr via the deployer."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # seconds to import: see above

    # HELR plans use nvidia-smi indices; make CUDA number devices the same way (before CUDA starts).
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    tok = load_tokenizer(settings.model)
    device = resolve_device(settings.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, settings.cpu_threads))
    dtype = resolve_dtype(settings.dtype, device)
    if settings.model == DEFAULT_MODEL:
        torch.manual_seed(0)
        cfg = tiny_llama_config(len(tok), tok.pad_token_id, tok.eos_token_id, tok.cls_token_id)
        model = LlamaForCausalLM(cfg).to(dtype=dtype, device=device)
    else:
        kwargs: dict[str, Any] = {"dtype": dtype}
        device_map = worker_device_map(settings) if device.type == "cuda" else None
        if device_map is not None:
            kwargs["device_map"] = device_map
        model = AutoModelForCausalLM.from_pretrained(settings.model, **kwargs)
        if device_map is None:
            model = model.to(device)
        else:
            device = next(model.parameters()).device
    model.eval()
    if device.type == "cpu":  # the head's product layout that is fastest on this CPU (workers.lm_head)
        install_measured_head(model)
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    log.info("loaded %s on %s (%s), %.1fM parameters", settings.model, device, dtype,
             sum(p.numel() for p in model.parameters()) / 1e6)
    return model, tok, device


def worker_device_map(settings: Settings) -> dict[str, int] | None:
    """A layer placement from the HELR deployer when COHORT_DEVICE_MAP names a mode."""
    if not settings.device_map:
        return None
    dm = plan(settings.model, settings.device_map, topology_file=settings.topology_file,
              gpus_file=settings.gpus_file)
    if dm is not None:
        log.info("device map (%s): %d modules over devices %s", settings.device_map, len(dm),
                 sorted(set(dm.values())))
    return dm
