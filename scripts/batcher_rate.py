"""How many scheduling decisions the batcher makes per second of its own CPU: requests taken in,
ordered by the policy and dispatched as groups to an upstream-only pool, against a real (embedded)
Redis. A stand-in worker takes each group off its set, marks it admitted and completes it, so the
batcher always has room; only the batcher's ``step`` is timed (``time.process_time``). Run from the
repository root:

    taskset -c 1 .venv/bin/python scripts/batcher_rate.py [N] [POLICY]

N requests (default 5000) arrive in bursts of 50, as gateways push them.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from batcher.service import BatcherService
from cohort import bus
from cohort.protocol import BatchOutcome, CompletionEvent
from cohort.release_bus import group_payload, group_set
from cohort.settings import Settings
from cohort.types import Batch, InstanceInfo, ProfiledRequest
from predictor.estimator import AnalyticBatchTime
from procstack.embedded_redis import EmbeddedRedis


def main(n: int, policy: str) -> None:
    folder = Path(tempfile.mkdtemp())
    emb = EmbeddedRedis(folder / "redis")
    try:
        r = bus.connect(emb.url)
        keys = bus.pool_keys("default")
        info = InstanceInfo("u1", "default", "m", theta_bytes=10**7, delta_bytes=1, device="upstream:http://e/v1")
        r.hset(bus.INSTANCES, "u1", json.dumps(info.to_dict()))
        s = Settings(_env_file=None, database_url=f"sqlite:///{folder}/log.db", policy=policy, execution="continuous")
        svc = BatcherService(s, r, AnalyticBatchTime(), send_task=lambda b, t=None: None)
        cpu, sent, groups = 0.0, 0, 0
        wall0 = time.monotonic()
        while sent < n or svc.inflight or svc._waiting:
            r.set(bus.alive_key("u1"), "1", ex=60)
            if sent < n:
                burst = [ProfiledRequest(id=f"q{sent + i}", prompt="p", input_tokens=64 + (sent + i) % 200,
                                         predicted_tokens=8 + (sent + i) * 7 % 120, max_tokens=256,
                                         arrival=time.time()).to_dict() for i in range(min(50, n - sent))]
                r.lpush(keys.incoming, *[json.dumps(d) for d in burst])
                sent += len(burst)
            t0 = time.process_time()
            svc.step()
            cpu += time.process_time() - t0
            sets = (group_set("default", "u1"), group_set("default"))  # placed on u1's own, or the pool's
            for js in (m for key in sets for m in r.zrange(key, 0, -1)):  # the stand-in worker
                b = Batch.from_dict(json.loads(group_payload(js)))
                r.set(bus.admitted_key(b.id), "u1")
                r.lpush(keys.completions, CompletionEvent(b.id, BatchOutcome.DONE, instance="u1", size=b.size,
                                                          answered=[q.id for q in b.requests]).to_json())
                groups += 1
            r.delete(*sets)
        wall = time.monotonic() - wall0
        print(f"{policy}: {n} requests in {groups} groups: batcher CPU {cpu:.2f} s = {1000 * cpu / n:.3f} ms a "
              f"request, {n / cpu:.0f} requests per CPU second ({wall:.1f} s wall)")
    finally:
        emb.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000, sys.argv[2] if len(sys.argv) > 2 else "magnus")
