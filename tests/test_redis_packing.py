"""The gateway's hiredis-packed Redis connections send the bytes redis-py's own packer sends."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from cohort.redis_packing import (
    HiredisConnection,
    HiredisSSLConnection,
    HiredisUnixConnection,
    connection_class,
)

COMMANDS = [
    ("XREAD", "BLOCK", 50, "STREAMS", "cohort:stream:a", "cohort:stream:b", "0", "1764330000123-2"),
    ("SET", "k", 1.5), ("CONFIG GET", "maxmemory"), ("SET", b"k", memoryview(b"v")), ("HSET", "h", "f", "é✓"),
    ("ZADD", "z", 1764330000.123456, "m"), ("SET", "k", 10**20), ("EVALSHA", "abc", 3, "a", "b", "c", -1),
]


@pytest.mark.parametrize("args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_the_same_bytes_as_redis_py(args):
    ours = b"".join(HiredisConnection().pack_command(*args))
    theirs = b"".join(bytes(x) for x in Connection().pack_command(*args))
    assert ours == theirs


@pytest.mark.parametrize("bad", [True, None, object()])
def test_what_redis_py_refuses_is_refused(bad):
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)
    with pytest.raises(DataError):
        HiredisConnection().pack_command("SET", "k", bad)


def test_the_url_scheme_picks_the_connection():
    assert connection_class("redis://redis.example/0") is HiredisConnection
    assert connection_class("rediss://host:6380") is HiredisSSLConnection
    assert connection_class("unix:///tmp/redis.sock") is HiredisUnixConnection
