"""The tokenizer side of the simulated engine: prompts to ids, and the ids and text it "generates".

Two backends: ``FastTokenizer``, the ``tokenizers`` library straight from ``tokenizer.json``
(a fifth of a second, no torch: the fixed-delay engine starts in tests and benchmarks many times),
for a folder that has one and no chat template; else ``hf_tokens.HFTokenizer``
(``AutoTokenizer.from_pretrained``, which renders chat templates). ``cli.load_tokens`` chooses.

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
from typing import Any, Protocol

from tokenizers import Tokenizer

from cohort.tokenizer import builtin_chat_prompt, split_chat

OUTPUT_VOCAB = 2048       # candidate ids sampled for the output vocabulary
ANCHOR_TEXT = "the"       # a token decoded before each candidate, so its leading space survives


class Backend(Protocol):
    """What the table needs from a tokenizer."""

    vocab_size: int
    special_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """The template's prompt ids, or None when the tokenizer has no chat template."""
        ...


class FastTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library (no chat templates)."""

    def __init__(self, path: str) -> None:
        self._tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        self._tok.no_padding()
        self._tok.no_truncation()
        self.vocab_size = self._tok.get_vocab_size()
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self.special_ids = {self._tok.token_to_id(t) for t in special} - {None}

    @staticmethod
    def fits(path: str) -> bool:
        """Whether the folder has a ``tokenizer.json`` and no chat template to render."""
        folder = Path(path)
        cfg = _json(folder / "tokenizer_config.json")
        return (folder / "tokenizer.json").is_file() and not cfg.get("chat_template") \
            and not (folder / "chat_template.jinja").is_file()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int] | None:
        return None


class TokenTable:
    """Prompt encoding and the output vocabulary of one tokenizer."""

    def __init__(self, backend: Backend, seed: int = 0, vocab_sample: int = OUTPUT_VOCAB, path: str = "") -> None:
        self.path = path
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self.special_ids = backend.special_ids
        self.ids, self.texts = self._output_vocab(seed, vocab_sample)
        self.escaped = [json.dumps(t)[1:-1] for t in self.texts]   # JSON string bodies, no quotes
        self._slot = {tid: i for i, tid in enumerate(self.ids)}

    # --- prompts ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids))

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """A chat's prompt ids: the tokenizer's own template with a generation prompt when it has
        one (its special tokens written by the template), else cohort's built-in chat format."""
        ids = self.backend.chat_prompt(messages)
        if ids is not None:
            return ids
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
