"""A list response's items, parsed one at a time instead of as one document, and as the
body arrives.

A first list now comes from the API server's watch cache, whole (reflector.py): at
10,000 services x 10 endpoints on kube-apiserver v1.20 the EndpointSlice list is tens
of megabytes of JSON (each slice carries managedFields, targetRefs, annotations), and
parsing it as one document put the whole tree of Python objects in memory at once: the
agent's peak went from 244 MiB (pages of 500) to 413 MiB. Each item is decoded and
dropped before the next is parsed, so the tree of one item is all there is at a time.
And each item is parsed as soon as its end has arrived (`ItemStream.feed`): decoding the
list overlaps the server's writing of it, where it used to wait for the whole body.

How the items are found without a JSON parser in Python: the API server writes lists
compactly (Go's encoder, no whitespace), with `metadata` (ListMeta) before `items`, and
every item of a typed list begins `{"metadata":{"name":"` (ObjectMeta's first field;
list items carry no kind). That sequence cannot occur inside a JSON string (its quotes
would be escaped), and where it occurs inside an item's structure the piece cut before
it has unclosed braces, which orjson refuses. So: cut before every `,` + that sequence,
parse each piece; the first piece that does not parse means a cut was wrong, and
everything from there on is parsed from the whole body (once it has all arrived); the
pieces before it were whole items. So is everything after the pieces when the body does
not end `]}` (`ItemStream.close`). A body whose start is not shaped this way is parsed
whole.

The bytes of items already given are dropped from the front of the buffer (past
`TRIM_AT`), so what is held is what has not been cut yet, not the whole body: at
100,000 services x 10 endpoints the EndpointSlice list is over 256 MiB (more with
kube-apiserver's managedFields), which a stream limited to its whole body refused at
every attempt. A wrong cut after a drop parses the rest of the items alone (the body
must then end `]}`), not the whole body.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import orjson

ITEMS = b',"items":['
ITEM_START = b'{"metadata":{"name":"'
SEPARATOR = b"," + ITEM_START
# Bytes of given items dropped from the buffer's front once they pass this: one copy of
# the (short) uncut tail per 4 MiB parsed.
TRIM_AT = 4 * 2**20


class NotAnObject(ValueError):
    """The body is JSON, but not an object."""


class TooLarge(ValueError):
    """The body's bytes not yet cut into items passed the stream's byte limit."""


class ItemStream:
    """The items of one list body, parsed as its bytes are fed in.

    `feed` the bytes as they arrive and `take` the items whose end has arrived after
    each; `close` at the end of the body, then `take` the rest. `head` is the list
    without its items (kind, apiVersion, metadata) as soon as it is known (None before;
    a body parsed whole has it at `close`); a wrong cut before any drop replaces it with
    the whole body's. `limit` bounds the bytes held (`held`): those not yet given as
    items."""

    def __init__(self, limit: int | None = None, trim_at: int = TRIM_AT) -> None:
        self._buf = bytearray()
        self._limit = limit
        self._trim_at = trim_at
        self.head: dict[str, Any] | None = None
        self.pieces = 0  # items parsed alone (0: the body was parsed whole)
        # head: looking for it; items: cutting; wait: a cut was wrong, the rest comes
        # from the whole body at close; done: every item given or in _rest
        self._mode = "head"
        self._start = 0  # items: where the next item begins
        self._scan = 0  # where the next search for a marker begins
        self._dropped = 0  # bytes of given items dropped from the buffer's front
        self._closed = False
        self._rest: list[Any] | None = None  # items still to give, from the whole body

    def feed(self, data: bytes | bytearray) -> None:
        if self._closed:
            raise ValueError("fed after close")
        over = self._limit is not None and len(self._buf) + len(data) > self._limit
        if self._mode == "items" and (self._start >= self._trim_at or over):
            del self._buf[:self._start]
            self._dropped += self._start
            self._scan -= self._start
            self._start = 0
        if self._limit is not None and len(self._buf) + len(data) > self._limit:
            raise TooLarge(f"over {self._limit} bytes of the body not cut into items")
        self._buf += data
        if self._mode == "head":
            self._find_head()

    def close(self) -> None:
        """The body is complete. Whatever is not cut into pieces is parsed whole here
        (its errors raised here)."""
        self._closed = True
        if self._mode == "head":
            self._find_head()
        if not (self._mode == "items" and _last(self._buf) is not None):
            self._rest = self._whole_rest()

    def take(self) -> Iterator[Any]:
        """The items whose end has arrived, each parsed as it is asked for."""
        if self._rest is not None:
            rest, self._rest = self._rest, None
            yield from rest
            return
        buf = self._buf
        while self._mode == "items":
            nxt = buf.find(SEPARATOR, self._scan)
            if nxt >= 0:
                end = nxt
            elif self._closed:
                end = _last(buf) or 0
            else:
                # Wait for more: a separator may straddle this chunk and the next.
                self._scan = max(self._start, len(buf) - len(SEPARATOR) + 1)
                return
            try:
                item = orjson.loads(buf[self._start:end])
            except orjson.JSONDecodeError:
                self._mode = "wait"
                if self._closed:
                    yield from self._whole_rest()
                return
            self.pieces += 1
            self._start = self._scan = end + 1
            if nxt < 0:
                self._mode = "done"
            yield item

    @property
    def held(self) -> int:
        """Bytes of the body not yet given as items."""
        return len(self._buf) - (self._start if self._mode == "items" else 0)

    def _whole_rest(self) -> list[Any]:
        """Every item after the `pieces` given, from the body parsed whole (nothing was
        cut, or a cut was wrong: see the module's docstring)."""
        if self._dropped:  # the items' rest alone, the list's `]}` after it
            end = _last(self._buf)
            rest = self._buf[self._start:end] if end is not None else self._buf[self._start:]
            self._mode = "done"
            return cast(list[Any], orjson.loads(b"[" + rest + b"]"))
        whole = orjson.loads(self._buf)
        if not isinstance(whole, dict):
            raise NotAnObject("list response is not an object")
        items = _items_of(whole)
        self.head = whole  # the head cut from the body, if any, was not the list's own
        self._mode = "done"
        return items[self.pieces:]

    def _find_head(self) -> None:
        """Past the head, items mode if the body is laid out as the module's docstring
        says (or the body's end, for the whole)."""
        buf = self._buf
        at = buf.find(ITEMS, self._scan)
        if at < 0:
            self._scan = max(0, len(buf) - len(ITEMS) + 1)
            return
        first = at + len(ITEMS)
        if len(buf) < first + len(ITEM_START) and not self._closed:
            self._scan = at  # not yet known whether an item starts there
            return
        self._mode = "done"  # parsed whole at close, unless:
        if buf.startswith(ITEM_START, first):
            try:
                head = orjson.loads(bytes(buf[:at]) + b"}")
            except orjson.JSONDecodeError:
                return
            if isinstance(head, dict):
                self.head = head
                self._mode = "items"
                self._start = self._scan = first


class Items:
    """The items of a list body that has all arrived (an `ItemStream` fed it whole)."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._stream = ItemStream()
        self._stream.feed(data)
        self._stream.close()
        assert self._stream.head is not None  # close() parsed whatever was not cut

    @property
    def head(self) -> dict[str, Any]:
        assert self._stream.head is not None
        return self._stream.head

    @property
    def pieces(self) -> int:
        return self._stream.pieces

    def __iter__(self) -> Iterator[Any]:
        return self._stream.take()


def _items_of(body: dict[str, Any]) -> list[Any]:
    items = body.pop("items", None)
    if items is None:
        return []
    if not isinstance(items, list):
        body["items"] = items  # the caller reports the wrong type
        return []
    return items


def _last(data: bytearray) -> int | None:
    """Where the items' closing `]` is, if the body ends `]}` (whitespace after it
    allowed); else None."""
    end = len(data)
    while end and data[end - 1] in b" \t\r\n":
        end -= 1
    return end - 2 if data[end - 2:end] == b"]}" else None
