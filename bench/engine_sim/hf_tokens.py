"""The HF ``AutoTokenizer`` backend of ``tokens.TokenTable``: for a tokenizer folder with a chat
template (rendered as vLLM renders it, with a generation prompt) or without a ``tokenizer.json``.

Its own module because importing transformers takes most of a second, which the fast backend's
users (the fixed-delay engine in tests and benchmarks) never pay.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer


class HFTokenizer:
    def __init__(self, path: str) -> None:
        self._tok = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self._tok)
        self.special_ids = set(self._tok.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int] | None:
        if not getattr(self._tok, "chat_template", None):
            return None
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text, add_special_tokens=False)
