"""The one rule for keying the KV pages of a prompt (prefix caching).

A prompt's KV cache is cut into pages of ``page_tokens`` tokens. Two requests may share a page's
KV only if *everything before and in it* is equal: attention makes a token's keys and values
depend on every earlier token, so a page is identified by the whole prefix that ends with it, not
by its own tokens. Hashing the whole prefix per page would cost O(n²); chaining does it in O(n):
page k's hash covers page k−1's hash and page k's tokens, so equal hashes mean equal prefixes
(up to 64-bit collisions), and one changed token changes its page's hash and every later one.

Only *full* pages get a hash: a trailing partial page is still being filled (the next turn's
tokens land in it), so it is never shared.

The salt (the model name and the LoRA adapter id, see :func:`page_salt`) enters the first page's
hash, so the same tokens under different weights never share KV.

The hash is BLAKE2b with an 8-byte digest over the token ids as little-endian int64s: stable across
processes and machines (Python's ``hash()`` is randomised per process), and fast (hashlib's C
code; a page is 16 ids = 128 bytes at 8 bytes an id).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Container, Iterable, Sequence
from hashlib import blake2b

DEFAULT_PAGE_TOKENS = 16
_ID_BYTES = 8  # token ids as signed 64-bit little-endian: any vocabulary fits


def page_salt(model: str, adapter: str | None = None) -> str:
    """The salt for ``page_hashes``: the model and the LoRA adapter (none: the base weights)."""
    return f"{model}\x00{adapter or ''}"


def page_hashes(token_ids: Sequence[int], page_tokens: int = DEFAULT_PAGE_TOKENS, salt: str = "") -> list[int]:
    """One 64-bit hash per full page of ``token_ids``: page k's hash is BLAKE2b(hash of page k−1 ‖
    page k's ids), the chain starting from BLAKE2b(salt). A trailing partial page gets none."""
    if page_tokens < 1:
        raise ValueError("page_tokens must be >= 1")
    full = len(token_ids) // page_tokens * page_tokens
    data = struct.pack(f"<{full}q", *token_ids[:full])  # one C call for the whole prompt
    step = page_tokens * _ID_BYTES
    prev = blake2b(salt.encode(), digest_size=8).digest()
    out: list[int] = []
    for start in range(0, len(data), step):
        prev = blake2b(prev + data[start:start + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def shared_prefix_pages(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading page hashes ``a`` and ``b`` (two ``page_hashes`` lists) have in common: the
    pages one prompt can reuse from the other. Chaining makes the first difference final: no
    later page can match again, so counting stops there."""
    n = 0
    for x, y in zip(a, b, strict=False):  # different lengths: the shorter one ends the count
        if x != y:
            break
        n += 1
    return n


def held_prefix_pages(hashes: Iterable[int], *held: Container[int]) -> int:
    """How many leading page keys of ``hashes`` are in any of ``held`` (an instance's reported and
    sent keys, a group's): chaining makes the first missing page end the prefix a cache can reuse."""
    n = 0
    for h in hashes:
        if not any(h in c for c in held):
            break
        n += 1
    return n


def encode_summary(hashes: Iterable[int]) -> str:
    """The wire form of an instance's cached page keys (``PagePool.summary``): 8 little-endian bytes
    a key, base64 (Redis clients here decode replies as text). 4,096 keys: 44 KB."""
    keys = list(hashes)
    return base64.b64encode(struct.pack(f"<{len(keys)}Q", *keys)).decode("ascii")


def decode_summary(text: str) -> frozenset[int]:
    """The keys ``encode_summary`` wrote."""
    raw = base64.b64decode(text)
    return frozenset(struct.unpack(f"<{len(raw) // 8}Q", raw))
