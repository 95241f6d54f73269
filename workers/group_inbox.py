"""An upstream instance's inbox of groups: the batcher hands an upstream-only pool's groups over on
Redis sorted sets (``release_bus.group_set``: the pool's, and the instance's own for routed ones),
taken best first in the policy's order (``release_bus.hand_over``), in the same round trip that records them in flight, instead of one Celery task each (a task cost
the batcher a publish and the worker a delivery, an ack and their bookkeeping: about half of an
upstream worker's CPU per request at 30 req/s, measured with `cohort bench front`).

A group is claimed and handed over by the Celery task's own body (``tasks.run_batch``), so the
batcher knows whose it is: a group popped by an instance that dies before claiming it is re-queued once
it has been unclaimed for two heartbeat TTLs (``BatcherService._check_lost``), one that dies after
as any running batch. The instance keeps its Celery worker for pools that mix engines.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import redis

from cohort.release_bus import group_payload, group_set
from cohort.types import Batch
from workers.runtime import Runtime
from workers.tasks import run_batch

log = logging.getLogger(__name__)


def serve_groups(rt: Runtime, stop: threading.Event) -> None:
    """Take groups off the instance's sets until ``stop``, the best waiting first (its own set's
    before the pool's: ``BZPOPMIN`` pops from the first key that holds one); each goes to the
    instance's publisher."""
    keys = [group_set(rt.settings.pool, rt.name), group_set(rt.settings.pool)]  # its own first
    backoff = 0.2
    while not stop.is_set():
        try:
            got = rt.redis.bzpopmin(keys, timeout=1)
            backoff = 0.2
            if not got:
                continue
            run_batch(rt, Batch.from_dict(json.loads(group_payload(got[1]))))  # claimed, then handed to the engine loop
        except redis.RedisError as e:  # rides out an outage, as the Celery consumer does
            log.warning("reading groups failed (%s); retrying in %.1f s", e, backoff)
            time.sleep(backoff)
            backoff = min(5.0, backoff * 2)
        except Exception:  # a group that cannot be read: logged; the batcher re-queues it as unclaimed
            log.exception("a group could not be taken")


def start_group_inbox(rt: Runtime) -> threading.Event:
    """Serve the instance's group sets on a thread of their own; set the event returned to stop."""
    stop = threading.Event()
    threading.Thread(target=serve_groups, args=(rt, stop), name="group-inbox", daemon=True).start()
    return stop
