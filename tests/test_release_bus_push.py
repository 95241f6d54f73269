"""cohort.release_bus.push_in_order: what a failed push held goes out again before what came since,
one push at a time, with a pause that doubles and resets."""

from __future__ import annotations

import asyncio

from cohort import release_bus
from cohort.release_bus import push_in_order


class _FlakyRedis:
    """Pipelines whose first ``fail`` executions raise; the rest append to ``lists``."""

    def __init__(self, fail: int, arrive_during_failure: dict[str, list[str]] | None = None,
                 waiting: dict[str, list[str]] | None = None) -> None:
        self.fail, self.lists, self.pushes = fail, {}, 0
        self._arrive, self._waiting = arrive_during_failure or {}, waiting

    def pipeline(self, transaction: bool = False):
        return _Pipe(self)


class _Pipe:
    def __init__(self, r: _FlakyRedis) -> None:
        self.r, self.cmds = r, []

    def rpush(self, key: str, *values: str) -> None:
        self.cmds.append((key, values))

    async def execute(self) -> None:
        r = self.r
        r.pushes += 1
        if r.fail:
            r.fail -= 1
            for dest, msgs in r._arrive.items():  # the owner adds news while the push waits
                r._waiting.setdefault(dest, []).extend(msgs)
            r._arrive = {}
            raise ConnectionError("Redis is restarting")
        for key, values in self.cmds:
            r.lists.setdefault(key, []).extend(values)


def _run(monkeypatch, redis, waiting) -> list[float]:
    pauses: list[float] = []
    real = asyncio.sleep

    async def sleep(s: float) -> None:
        pauses.append(s)
        await real(0)

    monkeypatch.setattr(release_bus.asyncio, "sleep", sleep)  # its pauses are recorded, not slept
    asyncio.run(push_in_order(redis, waiting, lambda d: f"inbox:{d}", lambda ms: [str(m) for m in ms], "messages",
                              pause_s=0.2, max_pause_s=0.5))
    return pauses


def test_a_failed_push_goes_again_before_what_arrived_meanwhile(monkeypatch):
    waiting = {"a": [1, 2], "b": [10]}
    redis = _FlakyRedis(fail=3, arrive_during_failure={"a": [3], "c": [20]}, waiting=waiting)
    pauses = _run(monkeypatch, redis, waiting)
    assert redis.lists == {"inbox:a": ["1", "2", "3"], "inbox:b": ["10"], "inbox:c": ["20"]}
    assert waiting == {}
    assert pauses == [0.2, 0.4, 0.5]  # doubling, capped
    assert redis.pushes == 4


def test_more_commands_go_with_the_first_push_and_again_until_one_went_through(monkeypatch):
    """``also``: an upstream worker's admission markers ride its releases' push; a failed push
    queues them again, and once one went through they are not sent again."""
    waiting = {"a": [1]}
    redis = _FlakyRedis(fail=1, arrive_during_failure={"a": [2]}, waiting=waiting)
    added: list[int] = []

    def also(pipe) -> None:
        added.append(redis.pushes)
        pipe.rpush("markers", "b1")

    pauses: list[float] = []
    real = asyncio.sleep

    async def sleep(s: float) -> None:
        pauses.append(s)
        await real(0)

    monkeypatch.setattr(release_bus.asyncio, "sleep", sleep)
    asyncio.run(push_in_order(redis, waiting, lambda d: f"inbox:{d}", lambda ms: [str(m) for m in ms], "messages",
                              also=also))
    assert redis.lists == {"inbox:a": ["1", "2"], "markers": ["b1"]}
    assert added == [0, 1] and redis.pushes == 2 and pauses == [0.2]


def test_more_commands_alone_are_pushed_too(monkeypatch):
    redis = _FlakyRedis(fail=0)
    asyncio.run(push_in_order(redis, {}, str, list, "messages", also=lambda pipe: pipe.rpush("markers", "b1")))
    assert redis.lists == {"markers": ["b1"]} and redis.pushes == 1


def test_nothing_waiting_pushes_nothing(monkeypatch):
    redis = _FlakyRedis(fail=0)
    assert _run(monkeypatch, redis, {}) == []
    assert redis.pushes == 0


def test_an_inbox_reader_rides_out_an_outage_and_a_bad_message(monkeypatch) -> None:
    """``serve_inbox``: a failed read is retried after a pause; a message its handler cannot apply
    is skipped and the next one still arrives."""
    reads: list = [ConnectionError("Redis is restarting"), ["bad", "one"], ["two"]]
    got: list[str] = []
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def take(conn, key):
        if not reads:
            await asyncio.Event().wait()  # nothing more: the reader waits, as a blocking read does
        r = reads.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    async def sleep(s: float) -> None:
        pauses.append(s)
        await real_sleep(0)

    def handle(js: str) -> None:
        if js == "bad":
            raise ValueError("not a message")
        got.append(js)

    async def go() -> None:
        task = asyncio.ensure_future(release_bus.serve_inbox(None, "k", handle, "test messages"))
        for _ in range(20):
            await real_sleep(0)
        task.cancel()

    monkeypatch.setattr(release_bus, "take_inbox", take)
    monkeypatch.setattr(release_bus.asyncio, "sleep", sleep)
    asyncio.run(go())
    assert got == ["one", "two"] and pauses == [0.2]
