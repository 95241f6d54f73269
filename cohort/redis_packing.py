"""The gateway's Redis connections pack commands with hiredis (C), as redis-py's sync ones do.

redis-py's asyncio connection packs every command in Python, argument by argument. The gateway's
stream hub sends one XREAD naming every answer stream it follows (two arguments each) each time
any of them has news: in a streamed run that packing was 16 % of the gateway's CPU (cProfile,
docs/notes/upstream.md). ``hiredis.pack_command`` gives the same bytes; the argument rules of redis-py's
own hiredis packer are kept (a command name with a space is split, bool is refused).
"""

from __future__ import annotations

from urllib.parse import urlparse

import hiredis
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

_PLAIN = frozenset({str, bytes, int, float})  # what hiredis packs as redis-py's Encoder does


class _HiredisPacking:
    def pack_command(self, *args) -> list[bytes]:
        head = args[0]
        if isinstance(head, str):
            args = (*head.encode().split(), *args[1:])
        elif b" " in head:
            args = (*head.split(), *args[1:])
        if not _PLAIN.issuperset(map(type, args)):  # rare: bool (refused), views and buffers (copied)
            if any(isinstance(a, bool) for a in args):
                raise DataError("Invalid input of type: 'bool'. Convert to a bytes, string, int or float first.")
            args = tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a for a in args)
        try:
            return [hiredis.pack_command(args)]
        except TypeError as e:
            raise DataError(str(e)) from e


class HiredisConnection(_HiredisPacking, Connection):
    pass


class HiredisSSLConnection(_HiredisPacking, SSLConnection):
    pass


class HiredisUnixConnection(_HiredisPacking, UnixDomainSocketConnection):
    pass


def connection_class(url: str) -> type[AbstractConnection]:
    """The packing connection for a Redis URL's scheme (redis://, rediss://, unix://)."""
    scheme = urlparse(url).scheme
    return {"rediss": HiredisSSLConnection, "unix": HiredisUnixConnection}.get(scheme, HiredisConnection)
