"""Shared fixtures for the deployer tests: example files, a tiny Llama on disk, the 6B shape."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "deployer" / "examples"


@pytest.fixture(scope="session")
def examples() -> Path:
    return EXAMPLES


@pytest.fixture(scope="session")
def shape_6b():
    from deployer.model_shape import load_model_shape

    return load_model_shape(EXAMPLES / "chatglm6b-shaped" / "config.json")


def _tiny_llama(tmp_path_factory: pytest.TempPathFactory, tie: bool) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    path = tmp_path_factory.mktemp(f"tiny-llama-tied{int(tie)}")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_llama(tmp_path_factory, tie=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_llama(tmp_path_factory, tie=True)
