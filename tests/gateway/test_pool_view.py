"""The gateway's cached view of the instances (gateway.pools.PoolView), on fakeredis."""

from __future__ import annotations

import asyncio
import json

from fakeredis import aioredis

from cohort import bus
from cohort.settings import Settings
from cohort.types import InstanceInfo
from gateway.pools import PoolView


def test_requests_that_find_the_view_stale_at_once_share_one_read():
    async def scenario() -> None:
        redis = aioredis.FakeRedis(decode_responses=True)
        info = InstanceInfo("w1", "default", "m", theta_bytes=1000, delta_bytes=1)
        await redis.hset(bus.INSTANCES, "w1", json.dumps(info.to_dict()))
        await redis.set(bus.alive_key("w1"), "1")
        reads = 0
        hgetall = redis.hgetall

        async def counted(*a, **k):
            nonlocal reads
            reads += 1
            await asyncio.sleep(0.01)  # the read takes a while: everyone else arrives meanwhile
            return await hgetall(*a, **k)

        redis.hgetall = counted
        view = PoolView(Settings(_env_file=None), redis)
        alive = await asyncio.gather(*(view.alive() for _ in range(50)))
        assert reads == 1 and all([i.name for i in a] == ["w1"] for a in alive)
        await view.alive()  # fresh: no read
        assert reads == 1
        await view._refresh(force=True)  # a miss in resolve: read again now
        assert reads == 2

    asyncio.run(scenario())
