"""What enters the batcher each round, off the pool's lists: arrivals into ``pending`` (and the
policy), cancelled requests out of the waiting set. Each list is read in one round trip and
trimmed in the round trip that takes its messages in (a part of ``batcher.service.BatcherService``)."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from cohort import batcher_hunger, bus
from cohort.types import ProfiledRequest

if TYPE_CHECKING:
    from redis.client import Pipeline

log = logging.getLogger("cohort.batcher")
ROUND_LIMIT = 1000  # messages of each list one round takes in
CANCELLED_KEEP_S = 600.0  # how long a withdrawn request is remembered (``Intake._note_cancelled``)


class Intake:
    """The intake of ``BatcherService``: it owns the lists, the policy and the waiting set."""

    def _read(self, wait_s: float = 0.0) -> tuple[list[str], list[str], list[str], bool]:
        """The round's one round trip: the wait for a producer's wake (``bus.queue_wait``; 0: no
        wait), then the oldest messages of the arrivals, cancels and completions lists (LPUSH'd;
        left in place until the round trims them: a crash in between re-reads them instead of losing them, and
        only the one active batcher reads these lists), and, under continuous execution, which
        in-flight batches their instance admitted since the last round. The last item: a list held
        more than one round takes (the next round reads at once)."""
        pipe = self.redis.pipeline(transaction=False)
        bus.queue_wait(pipe, self.settings.pool, wait_s)
        lists = (self.keys.incoming, self.keys.cancels, self.keys.completions)
        for key in lists:
            pipe.lrange(key, -ROUND_LIMIT, -1)
        unknown = self._unadmitted()
        bus.queue_admitted(pipe, unknown)
        replies = pipe.execute()
        for bid, hit in zip(unknown, replies[1 + len(lists):], strict=True):
            self.inflight[bid].admitted = bool(hit)
        arrivals, cancels, completions = (list(reversed(msgs)) for msgs in replies[1:1 + len(lists)])
        more = any(len(m) >= ROUND_LIMIT for m in (arrivals, cancels, completions))
        return arrivals, cancels, completions, more

    def _unadmitted(self) -> list[str]:
        """The in-flight batches whose admission the batcher has not seen (continuous execution is
        the only one that waits for admission: none otherwise)."""
        if self.settings.execution != "continuous":
            return []
        return [bid for bid, fl in self.inflight.items() if not fl.admitted]

    def _take_arrivals(self, now: float, msgs: list[str]) -> Pipeline | None:
        """Every arrival of the round into ``pending`` and off ``incoming``, and the least urgent
        priority now waiting, as one transaction, returned unsent (None: no arrivals, or sent
        already because some had to be shed): the round sends it with its dispatch (``step``), so
        a request that arrives and leaves in one round costs the batcher one round trip, not two.
        Until it is sent the arrivals are still on ``incoming``: a crash in between re-reads them.
        A request already waiting is not taken twice: its message was read before a crash that
        came before the trim (``_recover`` put it back), or by a call whose reply a dropped
        connection lost before the client retried it (the HSETNX leaves ``pending`` as it is)."""
        if not msgs:
            return None
        reqs = [ProfiledRequest.from_dict(json.loads(js)) for js in msgs]
        pipe = self.redis.pipeline()
        for req, js in zip(reqs, msgs, strict=True):
            pipe.hsetnx(self.keys.pending, req.id, js)
        pipe.ltrim(self.keys.incoming, 0, -len(msgs) - 1)
        for req in reqs:
            if req.id not in self._waiting:
                self._add(req, now)
        if len(self._waiting) <= self.settings.max_pending:
            self._publish_worst(pipe)  # nothing to shed: the priority rides along
            return pipe
        pipe.execute()  # in ``pending`` before the shed takes some out again
        self._shed()
        return None

    def _note_cancelled(self, ids: list[str]) -> None:
        """Remember withdrawn requests until dispatch drops them from their batch (the policy still
        holds them). A cancel that comes after the round's read reaches the worker instead, which
        checks the cancel keys of the rows it runs. Bounded: ids of requests that had already left
        are forgotten after ``CANCELLED_KEEP_S``."""
        now = time.monotonic()
        self._cancelled.update(dict.fromkeys(ids, now))
        if len(self._cancelled) > 10_000:
            self._cancelled = {k: t for k, t in self._cancelled.items() if now - t < CANCELLED_KEEP_S}

    def _take_cancels(self, msgs: list[str]) -> bool:
        """Requests whose client went away: out of the waiting set now, out of their batch at
        dispatch (``_note_cancelled``), out of a running batch by the worker."""
        if not msgs:
            return False
        self._note_cancelled(msgs)
        for rid in msgs:
            self._waiting.pop(rid, None)
        pipe = self.redis.pipeline(transaction=False)
        for rid in msgs:
            pipe.hdel(self.keys.pending, rid)
        pipe.ltrim(self.keys.cancels, 0, -len(msgs) - 1)
        if gone := sum(pipe.execute()[:-1]):
            self.redis.hincrby(bus.STATS, "cancelled_waiting", gone)
            log.info("dropped %d cancelled request(s) from the waiting queue", gone)
        return True

    def _announce_hunger(self) -> None:
        """Tell the workers whether their admissions and plain batch ends must wake this batcher:
        only while requests wait (``cohort.batcher_hunger``). Sent when that changes, and renewed
        while they wait; a round with nothing waiting before or after sends nothing."""
        hungry, (was, at), now = bool(self._waiting), self._hunger, time.monotonic()
        if hungry == was and (not hungry or now - at < batcher_hunger.RENEW_EVERY_S):
            return
        batcher_hunger.announce(self.redis, self.settings.pool, hungry, self._unadmitted())
        self._hunger = (hungry, now)
