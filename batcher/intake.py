"""What enters the batcher each round, off the pool's lists: arrivals into ``pending`` (and the
policy), cancelled requests out of the waiting set. Each list is read in one round trip and
trimmed in the round trip that takes its messages in (a part of ``batcher.service.BatcherService``)."""

from __future__ import annotations

import json
import logging

from cohort import bus
from cohort.types import ProfiledRequest

log = logging.getLogger("cohort.batcher")


class Intake:
    """The intake of ``BatcherService``: it owns the lists, the policy and the waiting set."""

    def _peek(self, *keys: str, limit: int = 1000) -> list[list[str]]:
        """The oldest messages of each list (LPUSH'd), in one round trip, left in place until
        ``_trim``: a crash in between re-reads them instead of losing them (only the one active
        batcher reads these lists)."""
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.lrange(key, -limit, -1)
        return [list(reversed(msgs)) for msgs in pipe.execute()]

    def _trim(self, key: str, n: int) -> None:
        if n:
            self.redis.ltrim(key, 0, -n - 1)

    def _take_arrivals(self, now: float, msgs: list[str]) -> bool:
        """Every arrival of the round into ``pending`` and off ``incoming`` in one round trip."""
        if not msgs:
            return False
        reqs = [ProfiledRequest.from_dict(json.loads(js)) for js in msgs]
        pipe = self.redis.pipeline(transaction=False)
        for req, js in zip(reqs, msgs, strict=True):
            pipe.hsetnx(self.keys.pending, req.id, js)
        pipe.ltrim(self.keys.incoming, 0, -len(msgs) - 1)
        # hsetnx 0: already taken, before a crash (then ``_recover`` put it in ``_waiting``) or by a
        # call whose reply a dropped connection lost before the client retried it (then nothing holds
        # it but ``pending``: it is taken now, never left there forever)
        for req, fresh in zip(reqs, pipe.execute()[:-1], strict=True):
            if fresh or req.id not in self._waiting:
                self._add(req, now)
        self._shed()
        return True

    def _take_cancels(self, msgs: list[str]) -> bool:
        """Requests whose client went away: out of the waiting set now, out of their batch at
        dispatch (``_dispatch`` filters on the cancel keys), out of a running batch by the worker."""
        if not msgs:
            return False
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
