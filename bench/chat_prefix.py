"""A multi-turn chat workload with shared prompt prefixes (for prefix caching), seeded.

Real chat traffic repeats itself at the front: an application sends the same long system prompt
with every request, and each turn of a conversation resends the whole history before its new
message. This trace has both, built from the shared data files (../shared/data):

* **System prompts**: ``n_system_prompts`` texts, each a seeded draw of instruction texts (the
  training part of the files) joined by newlines until its length, drawn uniformly from
  [``system_tokens_min``, ``system_tokens_max``] tokens, is reached.
* **Conversations**: each picks a system prompt with Zipf popularity (weight 1/rank^``zipf_a``),
  a file (uniform, or ``weights``) and 2-6 turns (``turns_min``..``turns_max``). Turn k's messages
  are the system prompt, the k−1 earlier (user, assistant) pairs and a new user message: a
  validation row's instruction and input (``build_prompt``), answered by the row's reference
  output (cut to ``max_tokens`` tokens in the history, as the model would have stopped there).
  A conversation ends early before a turn whose prompt would exceed ``max_prompt_tokens``.
* **Prompts** are rendered and tokenized exactly as the gateway renders a chat completion
  (gateway/views/openai.py ``_chat_submission``): the tokenizer's chat template when it has one
  (``chat_prompt_ids``), else ``builtin_chat_prompt(system, "role: content" lines)``. So each turn's
  prompt extends the previous turn's, token for token.
* **Arrivals**: a Poisson process at ``rate`` requests/s (as ``make_workload``). Each arrival goes
  to the conversation that has waited longest since it became ready (its previous turn's arrival
  plus a think gap of ``think_min_s`` + Exp(``think_s``)); when none is ready a new one starts.
  Conversations interleave, their turns arrive in order, and the total rate is exactly ``rate``.
* **Lengths, predictions, SLOs** as ``make_workload``: G = the reference output's tokens capped at
  ``max_tokens``; G' = G (oracle) or a predictor's, reading the system text as the instruction
  and the conversation as the input (as the gateway does); the same SLO rule.

The result is a ``bench.workload.Workload`` (the simulator and the live replay read it unchanged:
each request's row is a record whose ``build_prompt(instruction, input)`` is the built-in chat
prompt) with per-request extras: the token ids, their page hashes (``batcher.prefix_pages``), the
conversation, turn, system prompt and the tokens shared with an earlier request.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from batcher.prefix_pages import DEFAULT_PAGE_TOKENS, page_hashes, page_salt
from bench.workload import ORACLE, RowTable, Workload, WorkloadConfig, predict_rows, solo_times
from cohort.datasets import Record, data_files, load_jsonl, split
from cohort.settings import DEFAULT_MODEL
from cohort.tokenizer import (
    build_prompt,
    builtin_chat_prompt,
    chat_prompt_ids,
    has_chat_template,
    load_tokenizer,
    prompt_token_ids,
    split_chat,
)
from cohort.types import ProfiledRequest
from predictor.base import PredictItem
from predictor.conformal import ConformalTable

CHAT_TASKS = ("alpaca", "codealpaca", "gpteacher_toolformer")  # general instruction data: chat-like
Message = dict[str, str]


@dataclass
class ChatPrefixConfig(WorkloadConfig):
    """A chat workload's knobs; the inherited ones (requests, rate, seed, max_tokens, predictor,
    weights, SLO rule) mean what they mean for ``make_workload``. ``files`` empty: ``CHAT_TASKS``."""

    files: list[str] = field(default_factory=list)
    n_system_prompts: int = 32
    system_tokens_min: int = 200
    system_tokens_max: int = 1000
    turns_min: int = 2
    turns_max: int = 6
    zipf_a: float = 1.0          # system prompt k (0-based) is picked with weight 1/(k+1)^zipf_a
    think_min_s: float = 2.0     # a user's think gap: think_min_s + Exp(mean think_s)
    think_s: float = 10.0
    max_prompt_tokens: int = 8192
    page_tokens: int = DEFAULT_PAGE_TOKENS

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["workload"] = "chat_prefix"
        d["chat"] = {k: getattr(self, k) for k in (
            "n_system_prompts", "system_tokens_min", "system_tokens_max", "turns_min", "turns_max", "zipf_a",
            "think_min_s", "think_s", "max_prompt_tokens", "page_tokens")}
        return d


@dataclass
class ChatPrefixWorkload(Workload):
    """A ``Workload`` whose requests are chat turns; the extras are indexed by request like the rest."""

    model: str = DEFAULT_MODEL
    prompt_ids: list[list[int]] = field(default_factory=list)
    hashes: list[list[int]] = field(default_factory=list)   # page_hashes(prompt_ids[i]) under the model's salt
    messages: list[list[Message]] = field(default_factory=list)  # the chat each prompt renders
    conversation: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    turn: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))       # 0-based
    system_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # the longest token prefix each prompt has in common with an earlier request's prompt
    shared_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    system_texts: list[str] = field(default_factory=list)   # the system prompts, by system_id

    def requests(self, oracle: bool = False, prefix: str = "req") -> list[ProfiledRequest]:
        """As ``Workload.requests``, with each request's prompt text and token ids set."""
        out = super().requests(oracle, prefix)
        recs = self.rows.records
        return [replace(r, prompt=build_prompt(recs[i].instruction, recs[i].input), prompt_ids=list(self.prompt_ids[i]))
                for i, r in enumerate(out)]


def render_chat(messages: list[Message], model: str) -> tuple[str, str, list[int]]:
    """(system text, conversation text, prompt ids) of a chat, as the gateway's chat completions
    render it: the system messages joined as the instruction, the others as 'role: content' lines;
    the model's chat template if it has one, else the built-in one."""
    system, convo = split_chat([(m["role"], m["content"]) for m in messages])
    if has_chat_template(model):
        return system, convo, list(chat_prompt_ids(messages, model)[1])
    return system, convo, prompt_token_ids([builtin_chat_prompt(system, convo)], model)[0]


@lru_cache(maxsize=16)
def _file_parts(path: str, mtime_ns: int) -> tuple[tuple[str, ...], tuple[Record, ...]]:
    """A data file's instructions (training part) and validation rows, read once per process and
    version (the Alpaca file takes a second to parse)."""
    train, val = split(load_jsonl(Path(path)))
    return tuple(r.instruction for r in train if r.instruction), tuple(val)


def _system_prompts(config: ChatPrefixConfig, pool: list[str], rng: np.random.Generator,
                    model: str) -> list[str]:
    """``n_system_prompts`` texts of instructions from ``pool``, each about a drawn token length."""
    tok = load_tokenizer(model)
    out = []
    for _ in range(config.n_system_prompts):
        target = int(rng.integers(config.system_tokens_min, config.system_tokens_max + 1))
        pieces: list[str] = []
        total = 0
        while total < target:
            chunk = [pool[j] for j in rng.integers(0, len(pool), size=64)]
            for text, ids in zip(chunk, tok(chunk, add_special_tokens=False)["input_ids"], strict=True):
                pieces.append(text)
                total += len(ids) + 1   # + the newline
                if total >= target:
                    break
        out.append("\n".join(pieces))
    return out


@dataclass
class _Conv:
    id: int
    system_id: int
    file: int
    turns: int
    messages: list[Message]
    done: int = 0


def _shared_prefixes(prompts: list[list[int]]) -> np.ndarray:
    """Per prompt, the longest token prefix it has in common with any earlier one: among strings in
    sorted order that is the prefix shared with the sorted neighbour before or after it."""
    seen: list[tuple[int, ...]] = []
    out = np.zeros(len(prompts), dtype=np.int64)
    for i, p in enumerate(prompts):
        t = tuple(p)
        k = bisect.bisect_left(seen, t)
        best = 0
        for j in (k - 1, k):
            if 0 <= j < len(seen):
                a, b = np.asarray(seen[j]), np.asarray(t)
                m = min(len(a), len(b))
                diff = np.flatnonzero(a[:m] != b[:m])
                best = max(best, int(diff[0]) if len(diff) else m)
        out[i] = best
        seen.insert(k, t)
    return out


def make_chat_prefix_workload(config: ChatPrefixConfig, time_model: Any,
                              tokenizer_name: str | None = None) -> ChatPrefixWorkload:
    """Sample a seeded chat trace: system prompts, conversations, Poisson arrivals, lengths, SLOs."""
    if config.rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    if not 1 <= config.turns_min <= config.turns_max:
        raise ValueError("turns: 1 <= turns_min <= turns_max")
    if not 0 < config.system_tokens_min <= config.system_tokens_max:
        raise ValueError("system tokens: 0 < min <= max")
    if config.n_system_prompts < 1 or config.page_tokens < 1:
        raise ValueError("n_system_prompts and page_tokens must be >= 1")
    model = tokenizer_name or DEFAULT_MODEL
    files = [str(f) for f in (config.files or data_files(CHAT_TASKS))]
    config = replace(config, files=files)
    rng = np.random.default_rng(config.seed)
    pool: list[str] = []
    val: list[tuple[Record, ...]] = []
    for f in files:
        instructions, part = _file_parts(f, Path(f).stat().st_mtime_ns)
        pool.extend(instructions)
        val.append(part)
    pool = list(dict.fromkeys(pool))  # distinct, in file order
    if not pool or not any(val):
        raise ValueError("no instructions or validation rows in the given files")
    w = np.asarray(config.weights or [1.0] * len(files), dtype=float)
    if len(w) != len(files) or (w < 0).any():
        raise ValueError("weights: one non-negative weight per file")
    w[[not v for v in val]] = 0.0
    if w.sum() <= 0:
        raise ValueError("no validation rows in the weighted files")
    systems = _system_prompts(config, pool, rng, model)
    pop = 1.0 / np.arange(1, config.n_system_prompts + 1) ** config.zipf_a
    tok = load_tokenizer(model)
    mt = config.max_tokens

    def answer(r: Record) -> tuple[str, int]:
        ids = tok(r.output, add_special_tokens=False)["input_ids"]
        return (r.output if len(ids) <= mt else tok.decode(ids[:mt])), len(ids)

    arrival = np.cumsum(rng.exponential(1.0 / config.rate, size=config.requests))
    ready: list[tuple[float, int]] = []   # (time its next turn may arrive, conversation)
    convs: list[_Conv] = []
    cols: dict[str, list] = {k: [] for k in ("conv", "turn", "sys", "ids", "msgs", "rec", "file", "out")}
    for t in arrival:
        while True:
            if ready and ready[0][0] <= t:
                c = convs[heapq.heappop(ready)[1]]
            else:
                s = int(rng.choice(len(systems), p=pop / pop.sum()))
                c = _Conv(len(convs), s, int(rng.choice(len(files), p=w / w.sum())),
                          int(rng.integers(config.turns_min, config.turns_max + 1)),
                          [{"role": "system", "content": systems[s]}])
                convs.append(c)
            r = val[c.file][int(rng.integers(len(val[c.file])))]
            msgs = [*c.messages, {"role": "user", "content": build_prompt(r.instruction, r.input)}]
            system, convo, ids = render_chat(msgs, model)
            if len(ids) <= config.max_prompt_tokens:
                break
            if c.done == 0 and len(convs) > 10 * config.requests:
                raise ValueError("max_prompt_tokens is too small for the system prompts and messages")
            # too long: this conversation ends here (a new one's first turn: it never starts)
        text, out_tokens = answer(r)
        c.messages = [*msgs, {"role": "assistant", "content": text}]
        for k, v in (("conv", c.id), ("turn", c.done), ("sys", c.system_id), ("ids", ids), ("msgs", msgs),
                     ("file", c.file), ("out", out_tokens),
                     ("rec", Record(r.task, system, f"{convo}\nassistant:", r.output, r.source))):
            cols[k].append(v)
        c.done += 1
        if c.done < c.turns:
            heapq.heappush(ready, (float(t + config.think_min_s + rng.exponential(config.think_s)), c.id))
    n = config.requests
    L = np.array([len(i) for i in cols["ids"]], dtype=np.int64)
    out = np.asarray(cols["out"], dtype=np.int64).reshape(n)
    true = np.clip(out, 1, mt)
    pred_f = upper = None
    if config.predictor and config.predictor != ORACLE:
        items = [PredictItem(r.instruction, r.input.removesuffix("\nassistant:"), int(n_in), r.task)
                 for r, n_in in zip(cols["rec"], L, strict=True)]
        pred_f = predict_rows(config.predictor, items)
        table = ConformalTable.load(config.predictor)
        upper = None if table is None else table.upper(items, pred_f)
        pred = np.clip(np.rint(pred_f), 1, mt).astype(np.int64)
        upper = None if upper is None else np.clip(np.rint(upper), pred, mt).astype(np.int64)
    else:
        pred = true.copy()
    k = rng.uniform(config.slo_k_min, config.slo_k_max, size=n)
    slo = np.maximum(config.slo_min_s, k * solo_times(time_model, L, true))
    rows = RowTable(cols["rec"], np.asarray(cols["file"], dtype=np.int64).reshape(n), L, out, pred_f, upper)
    salt = page_salt(model)
    return ChatPrefixWorkload(
        config, rows, np.arange(n), arrival, L, true, pred, slo, [r.task for r in cols["rec"]], upper,
        model=model, prompt_ids=cols["ids"], hashes=[page_hashes(i, config.page_tokens, salt) for i in cols["ids"]],
        messages=cols["msgs"], conversation=np.asarray(cols["conv"], dtype=np.int64).reshape(n),
        turn=np.asarray(cols["turn"], dtype=np.int64).reshape(n),
        system_id=np.asarray(cols["sys"], dtype=np.int64).reshape(n),
        shared_tokens=_shared_prefixes(cols["ids"]), system_texts=systems)


def prefix_stats(workload: ChatPrefixWorkload) -> dict[str, float]:
    """How much of the trace's prompts an infinite prefix cache could serve.

    ``page_hit_fraction``: the share of all prompt tokens that lie in full pages whose hash was
    already seen earlier in the trace (arrival order): an upper bound on the hit rate of a cache
    that never evicts. ``shared_token_fraction``: the same at token granularity (the prefix each
    prompt shares with an earlier one, partial pages included)."""
    seen: set[int] = set()
    hit = 0
    pt = workload.config.page_tokens if isinstance(workload.config, ChatPrefixConfig) else DEFAULT_PAGE_TOKENS
    for hs in workload.hashes:
        hit += sum(h in seen for h in hs) * pt
        seen.update(hs)
    total = int(workload.input_tokens.sum())
    convs = len(np.unique(workload.conversation))
    return {"requests": float(len(workload)), "prompt_tokens": float(total), "page_hit_tokens": float(hit),
            "page_hit_fraction": hit / total if total else 0.0,
            "shared_token_fraction": float(workload.shared_tokens.sum()) / total if total else 0.0,
            "conversations": float(convs), "mean_turns": len(workload) / convs if convs else 0.0,
            "mean_prompt_tokens": total / len(workload) if len(workload) else 0.0}
