"""A Redis client whose first pipeline is late, as one retrying through a Redis restart is: for the
tests that pushes waiting for Redis are not overtaken by later ones."""

from __future__ import annotations

import asyncio


class FirstPushWaits:
    """Wraps an asyncio Redis client; its first pipeline's ``execute`` waits ``delay_s`` first."""

    def __init__(self, redis, delay_s: float = 0.5) -> None:
        self._redis, self._delay_s, self._waited = redis, delay_s, False

    def __getattr__(self, name: str):
        return getattr(self._redis, name)

    def pipeline(self, *args, **kwargs):
        pipe = self._redis.pipeline(*args, **kwargs)
        if not self._waited:
            self._waited, execute = True, pipe.execute

            async def late(*a, **kw):
                await asyncio.sleep(self._delay_s)
                return await execute(*a, **kw)

            pipe.execute = late
        return pipe
