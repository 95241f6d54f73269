"""When a worker's message must wake the batcher: only while requests wait for room.

An arrival and a cancel always wake the pool's batcher (``bus.wake_batcher``): it has to act on
them. A batch's admission and its plain end (every row answered) change what the batcher knows
of its instances, but it only acts on that when requests wait for room; otherwise its next round
(the next arrival, or its tick) reads them first, before it places anything. At low load each
request is its own group, and waking the batcher for both cost it two rounds of its three per
request (docs/notes/front.md).

So the batcher announces whether requests wait (the pool's ``hungry`` key, with a TTL it renews
while they wait), and these two messages wake it only while that key is there, decided inside
Redis (``wake_if_hungry``: one script in the message's own pipeline, no round trip more). A
message that lands between the batcher's read and its announcement is not missed: the
announcement itself looks for completions and admissions that came meanwhile and wakes the
batcher when it finds any (``announce``). A completion that asks for work (continuations, an
OOM split, a failed batch) always wakes it.
"""

from __future__ import annotations

from cohort import bus
from cohort.protocol import BatchOutcome, CompletionEvent

HUNGRY_TTL_S = 10    # a batcher that died while requests waited stops being woken after this
RENEW_EVERY_S = 1.0  # while requests wait, the announcement is renewed this often

_WAKE_IF_HUNGRY = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('LPUSH', KEYS[2], 1)
  redis.call('LTRIM', KEYS[2], 0, 0)
end
return 0
"""

# KEYS: hungry, wake, completions, then the admission markers of the batches still waiting for
# theirs; ARGV: the TTL. Returns 1 when something came since the round's read (the batcher is woken).
_ANNOUNCE = """
redis.call('SET', KEYS[1], 1, 'EX', ARGV[1])
local due = redis.call('LLEN', KEYS[3]) > 0
local i = 4
while not due and i <= #KEYS do
  due = redis.call('EXISTS', KEYS[i]) == 1
  i = i + 1
end
if due then
  redis.call('LPUSH', KEYS[2], 1)
  redis.call('LTRIM', KEYS[2], 0, 0)
  return 1
end
return 0
"""


def wake_if_hungry(pipe, pool: str) -> None:
    """Queue, in ``pipe`` (sync or asyncio), the wake of the pool's batcher if requests wait there."""
    k = bus.pool_keys(pool)
    pipe.eval(_WAKE_IF_HUNGRY, 2, k.hungry, k.wake)


def wake_for_end(pipe, pool: str, event: CompletionEvent) -> None:
    """Queue, in ``pipe``, the wake a batch's end owes the batcher: always when it asks for work
    (continuations, an OOM split, a failure), else only while requests wait (``wake_if_hungry``)."""
    if event.outcome is BatchOutcome.DONE and not event.continuations:
        wake_if_hungry(pipe, pool)
    else:
        bus.wake_batcher(pipe, pool)


def announce(r, pool: str, hungry: bool, unadmitted: list[str]) -> bool:
    """The batcher's announcement after a round (sync client): requests wait (``hungry``) or not.
    ``unadmitted``: the batches it sent whose admission it has not seen. True when a completion or
    an admission came since its read: the batcher was woken, and its next round takes it at once."""
    k = bus.pool_keys(pool)
    if not hungry:
        r.delete(k.hungry)
        return False
    keys = [k.hungry, k.wake, k.completions, *(bus.admitted_key(b) for b in unadmitted)]
    return bool(r.eval(_ANNOUNCE, len(keys), *keys, HUNGRY_TTL_S))
