"""Lists, page by page, their items passed on as the body arrives.

Each page's body is cut into items as it streams in (listsplit.py: each parsed and handed
over as soon as its end has arrived, while the server is still writing the rest). A task
of its own takes the body in as fast as it comes, and the items are handled in batches
between which it runs: the server's answer leaves its memory at the network's pace, not
ours (5,000 agents list at once in a rollout).

The whole answer must come within request_timeout, as any request's: the time we spend on
its items meanwhile does not count (up to request_timeout of it; past that, the rest of
the body is read first and its items taken after). A body over `max_bytes`, more than
`max_pages` pages, or a page whose head has the wrong shape is given up (`_BadList`).
Which objects a list adds, changes or deletes is the reflector's business (reflector.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from proxy.kube.client import Api, BodyTooLarge, read_body
from proxy.kube.listsplit import ItemStream, TooLarge
from proxy.kube.request_errors import _BadList, _HttpError, check_status, time_limit
from proxy.kube.resources import Resource
from proxy.model.skips import shown

# List items handled between turns of the event loop while the body is arriving (each
# ~5-50 us): the reader task takes in what has arrived meanwhile.
LIST_BATCH = 32
# Bytes of a body not yet taken as items past which its reading waits for the items to
# be taken (down to half; at most half the pager's byte limit): a server writes a list
# faster than its items are decoded, and the whole body held at once was over 256 MiB
# at 100,000 services x 10 endpoints.
HIGH_WATER = 16 * 2**20

# Takes a page's items as they arrive (and the page's number); returns how many it took.
ItemTaker = Callable[[Iterator[Any], int], int]


class ListPager:
    """The pages of lists of one resource, within the bounds given."""

    def __init__(self, api: Api, resource: Resource, *, page_size: int, max_pages: int,
                 max_bytes: int, request_timeout: float) -> None:
        self.api = api
        self.resource = resource
        self.page_size = page_size
        self.max_pages = max_pages
        self.max_bytes = max_bytes
        self.request_timeout = request_timeout

    async def list(self, selectors: dict[str, str], since: str, unpaged: bool,
                   take: ItemTaker) -> tuple[dict[str, Any], int]:
        """Every page of one list from revision `since` ("" for a consistent read),
        its items handed to `take` as they arrive: the last page's head (the list's
        metadata) and how many pages there were."""
        # Paging only where it spares the server: a list from a revision of ours with a
        # limit would be a read from etcd (the cache cannot continue), without one the
        # cache answers. "0" keeps the limit: the cache ignores it, etcd pages.
        unpaged = unpaged or since not in ("", "0")
        token: str | None = None
        pages = 0
        while True:
            query = dict(selectors)
            if not unpaged:
                query["limit"] = str(self.page_size)
            if token:
                query["continue"] = token  # no resourceVersion beside it: refused
            elif since:
                query["resourceVersion"] = since
            pages += 1
            head = await _PageRead(self, query, take, pages).read()
            token = _continue_token(head)
            if token is None:
                return head, pages
            if pages >= self.max_pages:
                raise _BadList(f"the list did not end after {pages} pages")

    async def whole(self, query: dict[str, str]) -> dict[str, Any]:
        """One small list's answer, read whole within request_timeout (a body trickling
        forever must not hold the loop): for a probe, not for a list of everything."""
        timeout = self.request_timeout
        timer = asyncio.timeout(timeout)
        async with time_limit(timer, f"no whole answer within {timeout:g}s"):
            # The client's own limit a little later, so that ours is the one that fires.
            resp = await self.api.get(self.resource.path, query, timeout + 5)
            try:
                await check_status(resp)
                try:
                    data = await read_body(resp, self.max_bytes)
                except BodyTooLarge:
                    raise _BadList(f"a list response over {self.max_bytes} bytes") from None
            finally:
                resp.close()
        body = orjson.loads(data)
        if not isinstance(body, dict):
            raise _HttpError(200, "list response is not an object")
        return body


class _PageRead:
    """One page: the request and its body, taken in by a task of its own (`_receive`),
    while `read` hands the items that have arrived to `take` in batches."""

    def __init__(self, pager: ListPager, query: dict[str, str], take: ItemTaker,
                 page: int) -> None:
        self.pager, self.query, self.take, self.page = pager, query, take, page
        self.items = ItemStream(pager.max_bytes)
        self.arrived = asyncio.Event()
        self.drained = asyncio.Event()  # the body's reading may go on (HIGH_WATER)
        self.drained.set()
        self.high_water = min(HIGH_WATER, pager.max_bytes // 2)
        self.timer = asyncio.timeout(pager.request_timeout)
        self.head_checked = False

    async def read(self) -> dict[str, Any]:
        """Pass on the page's items as they arrive; its head once all has arrived."""
        loop = asyncio.get_running_loop()
        limit = self.pager.request_timeout
        reader = asyncio.create_task(self._receive(), name=f"list {self.pager.resource}")
        spent = 0.0  # on items, while the body was arriving
        try:
            while not reader.done():
                await self.arrived.wait()
                self.arrived.clear()
                while spent < limit and not reader.done():
                    began = loop.time()
                    taken = self._take(LIST_BATCH)
                    took = loop.time() - began
                    spent += took
                    when = self.timer.when()
                    if when is not None:  # our time on the items does not count
                        self.timer.reschedule(when + took)
                    if taken < LIST_BATCH:
                        break
                    if self.items.held <= self.high_water // 2:
                        self.drained.set()
                    await asyncio.sleep(0)  # the reader takes in what has arrived
                # All there was to take (or no more time for items): reading goes on.
                self.drained.set()
            await reader  # its error, if it failed
        finally:
            if not reader.done():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        self.items.close()  # parses whatever was not cut (outside the timer, as ever)
        self._take()
        assert self.items.head is not None
        return self.items.head

    async def _receive(self) -> None:
        pager = self.pager
        try:
            async with time_limit(self.timer,
                                  f"no whole answer within {pager.request_timeout:g}s"):
                # The client's own limit: later than ours can be with our time added.
                resp = await pager.api.get(pager.resource.path, self.query,
                                           2 * pager.request_timeout + 5)
                try:
                    await check_status(resp)
                    while chunk := await resp.readany():
                        try:
                            self.items.feed(chunk)
                        except TooLarge:
                            raise _BadList(f"over {pager.max_bytes} bytes of a list "
                                           "response not cut into items") from None
                        self.arrived.set()
                        if self.items.held > self.high_water:
                            self.drained.clear()
                            await self.drained.wait()
                finally:
                    resp.close()
        finally:
            self.arrived.set()

    def _take(self, most: int | None = None) -> int:
        if not self.head_checked and self.items.head is not None:
            _check_head(self.items.head)
            self.head_checked = True
        return self.take(itertools.islice(self.items.take(), most), self.page)


def _check_head(head: dict[str, Any]) -> None:
    items, meta = head.get("items"), head.get("metadata")
    if not isinstance(items, list | None) or not isinstance(meta, dict | None):
        raise _BadList("a list whose items or metadata have the wrong type")


def _continue_token(head: dict[str, Any]) -> str | None:
    """The token for a list's next page; None after the last."""
    # Read from the head after the items: had they not been cut cleanly, the head is the
    # whole body's now (listsplit.ItemStream).
    meta = head.get("metadata")
    if not isinstance(meta, dict | None):
        raise _BadList("a list whose metadata has the wrong type")
    token = (meta or {}).get("continue") or None
    if token is not None and not isinstance(token, str):
        raise _BadList(f"a continue token that is no string: {shown(token)}")
    return token
