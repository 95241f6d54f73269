"""Which requests a gateway streams from their engine itself (COHORT_UPSTREAM_STREAMING=gateway):
an upstream-only pool's, unless they ask for logprobs; a pool with a built-in instance relays."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from cohort import bus
from cohort.types import InstanceInfo
from tests.gateway.harness import gateway, next_request


async def _upstream(redis, name: str = "i0") -> None:
    info = InstanceInfo(name, "default", "cohort/tiny-random-llama", 10**9, 1, device="upstream:http://e/v1",
                        started=time.time())
    await redis.hset(bus.INSTANCES, name, json.dumps(info.to_dict()))
    await redis.set(bus.alive_key(name), "1")


def _owners(tmp_path, builtin_too: bool) -> list:
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=0.3) as (app, client, redis):
            app.state.direct = SimpleNamespace(gateway_id="gw-test", cancel=lambda rid: None,
                                               forget=lambda rid: None)
            if not builtin_too:
                await _upstream(redis)  # replaces the harness's built-in instance
            out = []
            for extra in ({}, {"logprobs": 2}):
                _, req = await asyncio.gather(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                                                  **extra}), next_request(redis))
                out.append(req.owner)
            return out

    return asyncio.run(scenario())


@pytest.mark.slow  # 0.68 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_an_upstream_pools_requests_are_streamed_by_their_gateway_unless_they_ask_for_logprobs(tmp_path):
    assert _owners(tmp_path, builtin_too=False) == ["gw-test", None]


@pytest.mark.slow  # 0.71 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_pool_with_a_builtin_instance_is_relayed(tmp_path):
    assert _owners(tmp_path, builtin_too=True) == [None, None]
