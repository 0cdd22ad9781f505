"""rollout.kit.aio.Lines: the lines of a streamed HTTP body, read from a real aiohttp
StreamReader, fairly to every other task on the loop."""

import asyncio
from unittest import mock

import aiohttp

from rollout.kit.aio import Lines


def reader_with(data: bytes) -> aiohttp.StreamReader:
    """A reader whose whole body has already arrived (a backlog after a stall)."""
    reader = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16,
                                  loop=asyncio.get_running_loop())
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_lines_of_any_length_and_a_last_line_without_newline():
    long = b"x" * (3 * 2**16)  # over aiohttp's own line limit

    async def run():
        return [line async for line in Lines(reader_with(b"a\n\n" + long + b"\nlast"))]

    assert asyncio.run(run()) == [b"a", long, b"last"]


def test_a_buffered_stream_does_not_hold_the_loop():
    """A stream that is read more slowly than it arrives never has to wait for data; the
    other requests on the loop still run between its lines, not after its end."""
    count = 5000

    async def run():
        seen: list[int] = []
        other_ran_at: list[int] = []

        async def read():
            async for line in Lines(reader_with(b"event\n" * count)):
                seen.append(len(line))

        async def other():
            await asyncio.sleep(0)
            other_ran_at.append(len(seen))

        await asyncio.gather(read(), other())
        return len(seen), other_ran_at[0]

    read, other_ran_at = asyncio.run(run())
    assert read == count
    assert other_ran_at < 10, f"the other task ran only after {other_ran_at} lines"


def test_a_cancelled_read_loses_no_line():
    """A sample stopped while its stream is read goes on reading what the server sends
    last: a read cancelled at any point (waiting for data, or for its turn between lines of
    a chunk) leaves every line that came to be read after."""
    sent = [b"line %d" % i for i in range(8)]

    async def run():
        reader = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16,
                                      loop=asyncio.get_running_loop())
        got = Lines(reader)
        read = []
        for i in range(0, 8, 2):  # two lines a chunk, the first read cancelled each time
            waiting = asyncio.ensure_future(got.__anext__())
            await asyncio.sleep(0)
            waiting.cancel()
            reader.feed_data(b"\n".join(sent[i:i + 2]) + b"\n")
            cancelled = asyncio.ensure_future(got.__anext__())
            cancelled.cancel()  # before its turn between lines
            read += [await got.__anext__(), await got.__anext__()]
        reader.feed_eof()
        return read, [line async for line in got]

    assert asyncio.run(run()) == (sent, [])
