"""Pipelined batches of the ``lm://`` client's extended mode: a batch spread over the pool's
free connections, each writing its requests while it reads the replies in order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvplug_lm.connection import Connection, Pool, ReplyError

Send = Callable[[Connection, int], Awaitable[int]]
"""Writes the request of one index on a connection and returns its request id."""
Read = Callable[[Connection, int, int], Awaitable[Any]]
"""Reads the reply to one request (connection, request id, index) and returns its result."""


async def pipelined(
    pool: Pool,
    names: Sequence[bytes],
    send: Send,
    read: Read,
    keep: Sequence[object | None] = (),
) -> list[Any]:
    """Spread ``names`` over the pool's free connections (at least one); on each, write
    every request (``send(connection, index)`` returns a request id) while reading the
    replies in order (``read(connection, request_id, index)``). Results are aligned; when
    it fails, every object read is released but those in ``keep`` (the caller's)."""
    results: list[Any] = [None] * len(names)
    keep = list(keep) or [None] * len(names)

    async def on(connection: Connection, indexes: Sequence[int]) -> None:
        ids: asyncio.Queue[int | Exception] = asyncio.Queue()

        async def writer() -> None:
            try:
                for index in indexes:
                    ids.put_nowait(await send(connection, index))
            except Exception as error:
                ids.put_nowait(error)  # the reader stops there, instead of waiting on

        async def reader() -> None:
            refused: ReplyError | None = None
            for index in indexes:
                request_id = await ids.get()
                if isinstance(request_id, Exception):
                    raise request_id
                try:
                    results[index] = await read(connection, request_id, index)
                except ReplyError as error:
                    refused = refused or error  # the later replies still come: read them
            if refused is not None:
                raise refused

        writing = asyncio.ensure_future(writer())
        try:
            await reader()
            await writing
        except BaseException:
            release_read(indexes)
            raise
        finally:
            if not writing.done():
                writing.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writing

    def release_read(indexes: Sequence[int]) -> None:
        from kvplug.memory import MemoryObj

        for index in indexes:
            result, results[index] = results[index], None
            if isinstance(result, MemoryObj) and result is not keep[index]:
                result.release()

    async def first(indexes: Sequence[int]) -> None:
        await pool.run(lambda c: on(c, indexes))

    async def extra(indexes: Sequence[int]) -> bool:
        try:
            async with pool.lease(wait=False) as connection:
                if connection is None:
                    return False
                await on(connection, indexes)
                return True
        except ReplyError as refused:
            raise refused.error from None
        except OSError as error:
            raise pool.lost(error) from None

    spread = min(len(names), pool.size)
    groups = [list(range(start, len(names), spread)) for start in range(spread)]
    outcomes = await asyncio.gather(
        first(groups[0]), *(extra(group) for group in groups[1:]), return_exceptions=True
    )
    leftover = [
        index
        for group, outcome in zip(groups[1:], outcomes[1:], strict=True)
        if outcome is False
        for index in group
    ]
    error = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if error is None and leftover:
        try:
            await first(leftover)
        except BaseException as late:
            error = late
    if error is not None:
        release_read(range(len(results)))
        raise error
    return results


__all__ = ["Read", "Send", "pipelined"]
