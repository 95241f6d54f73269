"""Paged KV memory with prefix caching, modelled on vLLM v1's block pool and KV cache manager.

What makes vLLM's capacity, its prefix hits and its preemptions what they are, and what this
keeps:

* ``num_gpu_blocks`` blocks of ``block_size`` tokens; block 0 is the null block, never handed out
  (so ``num_gpu_blocks - 1`` are usable, and usage is measured against those).
* A request holds a list of blocks; it gets new ones as its tokens grow, only as many as the
  tokens scheduled this step need.
* Full blocks are cached under their chained hash (``SimRequest.update_block_hashes``); a
  partial block never is. A new request reuses the longest run of cached blocks from its first
  block on, capped one token short of its whole length (the last token is always computed, so
  there are logits to sample from).
* Freed blocks keep their hash and go to the tail of the free queue, a request's last block
  first; a block is evicted (its hash forgotten) only when the head of the queue is handed out.
  The head is therefore the least recently freed block, and within one request its tail: a
  shared prefix outlives the suffixes hung on it.
* Reference counts: a cached block in use by several requests is freed only when the last lets
  it go, and reusing a free cached block takes it out of the free queue.

Prefix-cache counters follow vLLM's: a lookup counts ``num_tokens`` queried and the tokens hit,
and a lookup for a resumed (previously preempted) request is counted apart, not in the totals
that ``vllm:prefix_cache_queries``/``_hits`` publish.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.engine_sim.request import SimRequest


class Block:
    """One KV block: its id, how many requests hold it, the hash it is cached under (full only)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Every block, the free queue (an ordered dict: O(1) removal from the middle when a cached
    block is reused, ``popitem(last=False)`` for the head) and the hash → blocks map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, dict[int, Block]] = {}
        self.evictions = 0

    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """The fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def get_cached(self, block_hash: int) -> Block | None:
        hit = self.cached.get(block_hash)
        return next(iter(hit.values())) if hit else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take reused cached blocks: one more holder each; a free one leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[Block]:
        """``n`` blocks from the head of the free queue, evicting the cached hash each one had."""
        if n > len(self.free):
            raise ValueError(f"cannot get {n} free blocks, {len(self.free)} left")
        out = []
        for _ in range(n):
            _, b = self.free.popitem(last=False)
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        same = self.cached.get(b.block_hash)
        if same is not None:
            same.pop(b.block_id, None)
            if not same:
                del self.cached[b.block_hash]
        b.block_hash = None
        self.evictions += 1

    def cache(self, b: Block, block_hash: int) -> None:
        b.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[b.block_id] = b

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Let go of blocks in the order given (eviction order: first freed, first evicted)."""
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free[b.block_id] = b


@dataclass
class PrefixStats:
    """Prefix-cache lookups in tokens, as vLLM counts them (new requests apart from resumed ones)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """The scheduler's view of KV memory: cache lookups, slots for a step's tokens, freeing."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixStats()

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, req: SimRequest) -> tuple[list[Block], int]:
        """The longest run of cached full blocks from the request's start, and its length in
        tokens; at most ``num_tokens - 1`` tokens (the last is always recomputed for its logits)."""
        if not self.enable_caching:
            return [], 0
        hashes = req.update_block_hashes(self.block_size)
        limit = (req.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for h in hashes[:limit]:
            b = self.pool.get_cached(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def record_lookup(self, req: SimRequest, num_hits: int) -> None:
        """Count one lookup, once the request it was for is scheduled (as recent vLLM does: a
        request that waits several steps for room is not counted once per step)."""
        if self.enable_caching:
            self.stats.record(req.num_tokens, num_hits, preempted=req.num_preemptions > 0)

    def allocate_slots(self, req: SimRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[Block] = ()) -> list[Block] | None:
        """Blocks for ``num_new_tokens`` more tokens (after ``num_new_computed_tokens`` taken from
        the cache, whose blocks are ``new_computed_blocks``); None, changing nothing, when the free
        queue cannot supply them. The full blocks these tokens complete are cached at once (their
        KV will exist by the end of the step, which is when anyone could look them up)."""
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        need_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        held = self.req_blocks.setdefault(req.request_id, [])
        num_new_blocks = max(cdiv(need_tokens, self.block_size) - len(held) - len(new_computed_blocks), 0)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable > self.pool.num_free():
            if not held:
                del self.req_blocks[req.request_id]
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            held.extend(new_computed_blocks)
        new = self.pool.get_new_blocks(num_new_blocks)
        held.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(req, held, min(num_computed + num_new_tokens, req.num_tokens))
        return new

    def _cache_full_blocks(self, req: SimRequest, held: list[Block], num_tokens: int) -> None:
        full = num_tokens // self.block_size
        done = self.num_cached_blocks.get(req.request_id, 0)
        if full <= done:
            return
        hashes = req.update_block_hashes(self.block_size)
        for i in range(done, full):
            b = held[i]
            if b.block_hash is None:
                self.pool.cache(b, hashes[i])
        self.num_cached_blocks[req.request_id] = full

    def free(self, req: SimRequest) -> None:
        """Let go of every block the request holds, its last block first (evicted first)."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def blocks_of(self, req: SimRequest) -> list[Block]:
        return self.req_blocks.get(req.request_id, [])
