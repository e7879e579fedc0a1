"""A list response's items, parsed one at a time instead of as one document.

A first list now comes from the API server's watch cache, whole (reflector.py): at
10,000 services x 10 endpoints on kube-apiserver v1.20.2 the EndpointSlice list is tens
of megabytes of JSON (each slice carries managedFields, targetRefs, annotations), and
parsing it as one document put the whole tree of Python objects in memory at once: the
agent's peak went from 244 MiB (pages of 500) to 413 MiB. Each item is decoded and
dropped before the next is parsed, so the tree of one item is all there is at a time.

How the items are found without a JSON parser in Python: the API server writes lists
compactly (Go's encoder, no whitespace), with `metadata` (ListMeta) before `items`, and
every item of a typed list begins `{"metadata":{"name":"` (ObjectMeta's first field;
list items carry no kind). That sequence cannot occur inside a JSON string (its quotes
would be escaped), and where it occurs inside an item's structure the piece cut before
it has unclosed braces, which orjson refuses. So: cut before every `,` + that sequence,
parse each piece; the first piece that does not parse means a cut was wrong, and
everything from there on is parsed from the whole body (`Items.rest`); the pieces
before it were whole items. Anything not shaped this way is parsed whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

ITEMS = b',"items":['
ITEM_START = b'{"metadata":{"name":"'


class NotAnObject(ValueError):
    """The body is JSON, but not an object."""


class Items:
    """The items of one list body, parsed as they are asked for; `head` is the list
    without its items (kind, apiVersion, metadata)."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._data = memoryview(data)
        self.head: dict[str, Any]
        self.pieces: int = 0  # items parsed alone (0: the body was parsed whole)
        cut = _cut(data)
        if cut is None:
            whole = orjson.loads(data)
            if not isinstance(whole, dict):
                raise NotAnObject("list response is not an object")
            self._whole: list[Any] | None = _items_of(whole)
            self.head = whole
            self._bounds: list[tuple[int, int]] = []
        else:
            self.head, self._bounds = cut
            self._whole = None

    def __iter__(self) -> Iterator[Any]:
        if self._whole is not None:
            yield from self._whole
            return
        for i, (start, end) in enumerate(self._bounds):
            try:
                item = orjson.loads(self._data[start:end])
            except orjson.JSONDecodeError:
                yield from self._rest(i)
                return
            self.pieces += 1
            yield item

    def _rest(self, done: int) -> list[Any]:
        """Every item after the first `done`, from the body parsed whole (a cut was
        wrong: see the module's docstring)."""
        whole = orjson.loads(self._data)
        if not isinstance(whole, dict):
            raise NotAnObject("list response is not an object")
        items = _items_of(whole)
        self.head = whole  # the head cut from the body was not the list's own
        return items[done:]


def _items_of(body: dict[str, Any]) -> list[Any]:
    items = body.pop("items", None)
    if items is None:
        return []
    if not isinstance(items, list):
        body["items"] = items  # the caller reports the wrong type
        return []
    return items


def _cut(data: bytes | bytearray) -> tuple[dict[str, Any], list[tuple[int, int]]] | None:
    """(the list without its items, each item's byte range), or None if the body is
    not laid out as the module's docstring says."""
    at = data.find(ITEMS)
    if at < 0:
        return None
    end = len(data)
    while end and data[end - 1] in b" \t\r\n":
        end -= 1
    if data[end - 2:end] != b"]}":
        return None
    try:
        head = orjson.loads(bytes(data[:at]) + b"}")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(head, dict):
        return None
    first, last = at + len(ITEMS), end - 2
    if first == last:
        return head, []
    if not data.startswith(ITEM_START, first):
        return None
    bounds: list[tuple[int, int]] = []
    start = first
    separator = b"," + ITEM_START
    while True:
        nxt = data.find(separator, start, last)
        if nxt < 0:
            bounds.append((start, last))
            return head, bounds
        bounds.append((start, nxt))
        start = nxt + 1
