"""The tokenizer side of the simulated engine: prompts to ids, and the ids and text it "generates".

Loading: the ``tokenizers`` library straight from ``tokenizer.json`` when the folder has one and
no chat template (a fifth of a second, no torch import: the fixed-delay engine starts in tests and
benchmarks many times), else HF ``AutoTokenizer.from_pretrained`` (which renders chat templates).

Output: a request's ids are drawn, seeded by the request, from an *output vocabulary*: a seeded
sample of the tokenizer's ordinary tokens whose text, tokenized again, is that one token. So text
streamed one token per chunk re-tokenizes to exactly the ids streamed (what a client counting
tokens from text, cohort's text-only upstream path among them, relies on). Each id's text, its
JSON-escaped form and its length are computed once at start-up: emitting a token costs a list
lookup, never a decode.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cohort.tokenizer import builtin_chat_prompt, split_chat

OUTPUT_VOCAB = 2048       # candidate ids sampled for the output vocabulary
ANCHOR_TEXT = "the"       # a token decoded before each candidate, so its leading space survives


class TokenTable:
    """Prompt encoding and the output vocabulary of one tokenizer."""

    def __init__(self, path: str, seed: int = 0, vocab_sample: int = OUTPUT_VOCAB) -> None:
        self.path = path
        self._hf: Any = None
        self._fast: Any = None
        folder = Path(path)
        cfg = _json(folder / "tokenizer_config.json")
        if (folder / "tokenizer.json").is_file() and not cfg.get("chat_template") \
                and not (folder / "chat_template.jinja").is_file():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
            self._fast.no_padding()
            self._fast.no_truncation()
            self.vocab_size = self._fast.get_vocab_size()
            special = {t.content for t in self._fast.get_added_tokens_decoder().values() if t.special}
            self.special_ids = {self._fast.token_to_id(t) for t in special} - {None}
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path)
            self.vocab_size = len(self._hf)
            self.special_ids = set(self._hf.all_special_ids)
        self.ids, self.texts = self._output_vocab(seed, vocab_sample)
        self.escaped = [json.dumps(t)[1:-1] for t in self.texts]   # JSON string bodies, no quotes
        self._slot = {tid: i for i, tid in enumerate(self.ids)}

    # --- prompts ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=False)
        return self._hf.decode(list(ids))

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """A chat's prompt ids: the tokenizer's own template with a generation prompt when it has
        one (its special tokens written by the template), else cohort's built-in chat format."""
        if self._hf is not None and getattr(self._hf, "chat_template", None):
            text = self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.encode(text, add_special_tokens=False)
        turns = [(str(m.get("role", "user")), _content_text(m.get("content"))) for m in messages]
        system, convo = split_chat(turns)
        return self.encode(builtin_chat_prompt(system, convo), add_special_tokens=False)

    # --- output ----------------------------------------------------------------------------
    def _output_vocab(self, seed: int, sample: int) -> tuple[list[int], list[str]]:
        rng = random.Random(seed)
        pool = [i for i in range(self.vocab_size) if i not in self.special_ids]
        cands = rng.sample(pool, min(sample, len(pool)))
        anchor = self.encode(ANCHOR_TEXT, add_special_tokens=False)[:1]
        head = self.decode(anchor)
        ids, texts = [], []
        for tid in cands:
            whole = self.decode(anchor + [tid])
            text = whole[len(head):] if whole.startswith(head) else self.decode([tid])
            if text and text.isprintable() and self.encode(text, add_special_tokens=False) == [tid]:
                ids.append(tid)
                texts.append(text)
        if not ids:
            raise ValueError(f"{self.path}: no token of the vocabulary round-trips through its text")
        return ids, texts

    def drawer(self, seed: int) -> Callable[[], int]:
        """The next-token function of one request: a seeded stream of output-vocabulary ids."""
        rng = random.Random(seed)
        ids, n = self.ids, len(self.ids)
        return lambda: ids[int(rng.random() * n)]

    def text_of(self, ids: Sequence[int]) -> str:
        return "".join(self.texts[self._slot[i]] for i in ids)

    def escaped_of(self, ids: Sequence[int]) -> str:
        """The JSON string body (no quotes) of ``ids``' text: pieces escaped once, joined here."""
        esc, slot = self.escaped, self._slot
        return "".join(esc[slot[i]] for i in ids)


def request_seed(base: int, prompt_ids: Sequence[int], seed: int | None) -> int:
    """A request's output seed: its own ``seed`` when it sends one, else its prompt's checksum
    (the same prompt gets the same answer, as greedy decoding would), mixed with ``--seed``."""
    own = seed if seed is not None else zlib.crc32(repr(list(prompt_ids)).encode())
    return (base * 1_000_003) ^ own


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content-parts list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
