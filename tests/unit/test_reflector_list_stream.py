"""A list's items are passed on as the body arrives (list_pager.py with
listsplit.ItemStream): the first item reaches the handler while the server has not sent
the rest, and the time the handler takes does not count against request_timeout."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import orjson

from proxy.kube.reflector import Reflector, ReflectorOptions, WatchEvent
from proxy.kube.resources import SERVICES

OPTIONS = ReflectorOptions(request_timeout=2.0)


def _body(n: int) -> bytes:
    items = [{"metadata": {"name": f"s-{i}", "namespace": "default", "resourceVersion": "5",
                           "uid": f"u-{i}"}, "spec": {"ports": [{"port": 80}]}}
             for i in range(n)]
    return orjson.dumps({"kind": "ServiceList", "apiVersion": "v1",
                         "metadata": {"resourceVersion": "9"}, "items": items})


class _Response:
    def __init__(self, chunks: list[bytes | Callable[[], Awaitable[None]]]) -> None:
        self.status = 200
        self.headers: Mapping[str, str] = {}
        self._chunks = chunks

    async def read(self) -> bytes:
        raise AssertionError("the list is read in chunks")

    async def readany(self) -> bytes:
        while self._chunks:
            chunk = self._chunks.pop(0)
            if isinstance(chunk, bytes):
                return chunk
            await chunk()
        return b""

    def close(self) -> None:
        pass


class _Api:
    host = "test"

    def __init__(self, response: _Response) -> None:
        self.response = response

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Any:
        return self.response

    async def close(self) -> None:
        pass


def test_items_reach_the_handler_before_the_body_has_all_arrived() -> None:
    body = _body(3)
    half = body.index(b',{"metadata":{"name":"s-2"') + 30
    seen: list[str] = []
    first_seen = asyncio.Event()

    def handler(ev: WatchEvent) -> None:
        seen.append(ev.name)
        first_seen.set()

    async def server_waits_for_the_first_item() -> None:
        await asyncio.wait_for(first_seen.wait(), 1.0)  # TimeoutError: not streamed

    async def main() -> None:
        api = _Api(_Response([body[:half], server_waits_for_the_first_item, body[half:]]))
        reflector = Reflector(api, SERVICES, handler, OPTIONS)
        await reflector._list()
        assert seen == ["s-0", "s-1", "s-2"]
        assert reflector.resource_version == "9"

    asyncio.run(main())


def test_the_handlers_time_does_not_count_against_request_timeout() -> None:
    body = _body(6)
    step = len(body) // 6
    chunks: list[bytes | Callable[[], Awaitable[None]]] = [
        body[i:i + step] for i in range(0, len(body), step)]
    seen: list[str] = []

    def slow_handler(ev: WatchEvent) -> None:
        time.sleep(0.1)  # 0.6 s in all, three times the timeout
        seen.append(ev.name)

    async def main() -> None:
        options = replace(OPTIONS, request_timeout=0.2)
        reflector = Reflector(_Api(_Response(chunks)), SERVICES, slow_handler, options)
        await reflector._list()
        assert seen == [f"s-{i}" for i in range(6)]

    asyncio.run(main())


def test_the_body_is_taken_in_at_the_networks_pace_while_items_are_handled() -> None:
    """The server's answer must not wait in its memory for our decoding: the body is read
    on while items are handled. Here the network delivers one chunk of 64 items per turn
    of the event loop (as a socket read does); the last one must be in before the
    handler is halfway through the 512 items."""
    body = _body(512)
    starts = [i for i in range(len(body)) if body.startswith(b',{"metadata":', i)]
    cuts = [0, *starts[63::64], len(body)]
    pending = [body[a:b] for a, b in itertools.pairwise(cuts)]
    buffered = bytearray()
    handled = 0
    handled_when_all_read: list[int] = []

    class Network(_Response):
        async def readany(self) -> bytes:
            while not buffered and pending:
                await asyncio.sleep(0)
            data = bytes(buffered)
            buffered.clear()
            if not pending and not buffered and not handled_when_all_read:
                handled_when_all_read.append(handled)
            return data

    async def deliver() -> None:
        while pending:
            buffered.extend(pending.pop(0))
            await asyncio.sleep(0)

    def handler(ev: WatchEvent) -> None:
        nonlocal handled
        handled += 1

    async def main() -> None:
        task = asyncio.create_task(deliver())
        reflector = Reflector(_Api(Network([])), SERVICES, handler, OPTIONS)
        await reflector._list()
        await task
        assert handled == 512
        assert handled_when_all_read and handled_when_all_read[0] < 256, handled_when_all_read

    asyncio.run(main())


def test_a_list_larger_than_max_list_bytes_is_read_whole_when_its_items_can_be_cut() -> None:
    """max_list_bytes bounds what is held of a body not yet cut into items, not the body:
    a list many times its size passes, its reading waiting for the items to be taken
    (HIGH_WATER: at most half the limit ahead of them)."""
    body = _body(3000)
    chunks: list[bytes | Callable[[], Awaitable[None]]] = [
        body[i:i + 4096] for i in range(0, len(body), 4096)]
    seen: list[str] = []

    async def main() -> None:
        options = replace(OPTIONS, max_list_bytes=16384)
        reflector = Reflector(_Api(_Response(chunks)), SERVICES,
                              lambda ev: seen.append(ev.name), options)
        await reflector._list()
        assert len(body) > 20 * options.max_list_bytes
        assert seen == [f"s-{i}" for i in range(3000)]

    asyncio.run(main())
