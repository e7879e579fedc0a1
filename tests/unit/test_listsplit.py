"""listsplit.Items: a list's items parsed one at a time give exactly what parsing the
whole body gives, whatever the items hold (the cut sequence inside strings, nested
objects shaped like items), and bodies not laid out as the API server writes them are
parsed whole."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube.listsplit import (
    ITEM_START,
    TRIM_AT,
    Items,
    ItemStream,
    NotAnObject,
    TooLarge,
)

TRICKY = ',{"metadata":{"name":"'
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5),
                      st.sampled_from(["", "x", TRICKY, '"},{"metadata":{"name":"a"}}', "]}"]),
                      st.text(max_size=5))
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["metadata", "name", "items", "a", TRICKY]), inner,
                        max_size=3),
        # nested objects shaped like items: where a cut would be wrong
        st.builds(lambda name, rest: {"metadata": {"name": name, **rest}},
                  st.text(max_size=3), st.dictionaries(st.just("x"), inner, max_size=1))),
    max_leaves=12)
item = st.builds(lambda name, rest, body: {"metadata": {"name": name, **rest}, **body},
                 st.text(max_size=6),
                 st.dictionaries(st.sampled_from(["namespace", "labels"]), json_value,
                                 max_size=2),
                 st.dictionaries(st.sampled_from(["spec", "endpoints", "ports"]), json_value,
                                 max_size=3))


def _list(items: list[Any], **extra: Any) -> dict[str, Any]:
    return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": "42", **extra}, "items": items}


@settings(max_examples=300, deadline=None)
@given(st.lists(item, max_size=6), st.booleans())
def test_items_one_by_one_equal_the_whole_parse(items: list[Any], newline: bool) -> None:
    data = orjson.dumps(_list(items)) + (b"\n" if newline else b"")
    listing = Items(data)
    assert list(listing) == items
    assert listing.head == {k: v for k, v in _list(items).items() if k != "items"}


def test_real_shaped_items_are_parsed_one_at_a_time() -> None:
    items = [{"metadata": {"name": f"s-{i}", "managedFields": [{"manager": "m"}]},
              "endpoints": [{"addresses": ["198.19.0.1"], "targetRef": {"name": "p"}}]}
             for i in range(3)]
    listing = Items(orjson.dumps(_list(items, **{"continue": "tok"})))
    assert list(listing) == items and listing.pieces == 3
    assert listing.head["metadata"] == {"resourceVersion": "42", "continue": "tok"}


def test_a_wrong_cut_falls_back_to_the_whole_body_after_the_good_items() -> None:
    # The second item holds, in its structure (not in a string), the cut sequence.
    items = [{"metadata": {"name": "a"}},
             {"metadata": {"name": "b"}, "spec": [1, {"metadata": {"name": "inner"}}]},
             {"metadata": {"name": "c"}}]
    data = orjson.dumps(_list(items))
    assert data.count(b"," + ITEM_START) == 3  # one of them is not an item boundary
    listing = Items(data)
    assert list(listing) == items and listing.pieces == 1


def test_a_head_cut_in_the_wrong_place_is_replaced_by_the_whole_bodys() -> None:
    # A nested "items" before the list's own, itself shaped like a list of items.
    body = {"x": {"a": 1, "items": [{"metadata": {"name": "a"}}]},
            "metadata": {"resourceVersion": "5"}, "items": []}
    listing = Items(orjson.dumps(body))
    assert list(listing) == []
    assert listing.head == {"x": body["x"], "metadata": {"resourceVersion": "5"}}


@pytest.mark.parametrize("body", [
    {"kind": "List", "metadata": {}},                       # no items
    {"items": [{"metadata": {"name": "a"}}], "metadata": {}},  # items not last
    {"kind": "List", "metadata": {}, "items": 5},           # items not a list
    {"kind": "List", "items": [{"name": "a"}]},             # items not shaped as objects
], ids=["no-items", "items-first", "items-not-a-list", "other-shape"])
def test_other_layouts_are_parsed_whole(body: dict[str, Any]) -> None:
    listing = Items(orjson.dumps(body))
    got = list(listing)
    assert listing.pieces == 0
    want = body.get("items")
    if isinstance(want, list):
        assert got == want and "items" not in listing.head
    else:
        assert got == [] and listing.head == body  # the caller sees the wrong type


def test_a_body_that_is_no_object_is_refused() -> None:
    with pytest.raises(NotAnObject):
        Items(b"[1, 2]")
    with pytest.raises(orjson.JSONDecodeError):
        Items(b'{"kind":"List","items":[{"metadata":{"name":"a"}}]')


def _streamed(data: bytes, sizes: list[int], trim_at: int = TRIM_AT,
              ) -> tuple[list[Any], ItemStream]:
    """Fed in chunks of these sizes (then the rest), taking items after each."""
    stream, got, at = ItemStream(trim_at=trim_at), [], 0
    for size in sizes:
        stream.feed(data[at:at + size])
        at += size
        got += stream.take()
    stream.feed(data[at:])
    got += stream.take()
    stream.close()
    got += stream.take()
    return got, stream


@settings(max_examples=300, deadline=None)
@given(st.lists(item, max_size=6), st.lists(st.integers(0, 40), max_size=30),
       st.sampled_from([b"", b"\n", b"x", b"]", b"}"]), st.sampled_from([TRIM_AT, 0, 30]))
def test_items_fed_in_any_chunks_equal_the_whole_parse(
        items: list[Any], sizes: list[int], tail: bytes, trim_at: int) -> None:
    """Whether or not the bytes of given items are dropped as they go (`trim_at` 0:
    at every feed), wrong cuts after a drop included."""
    data = orjson.dumps(_list(items)) + tail
    try:
        whole = orjson.loads(data)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            _streamed(data, sizes, trim_at)
        return
    got, stream = _streamed(data, sizes, trim_at)
    assert got == whole["items"]
    assert stream.head == {k: v for k, v in whole.items() if k != "items"}


def test_an_item_is_given_as_soon_as_the_next_ones_start_has_arrived() -> None:
    items = [{"metadata": {"name": f"s-{i}"}, "spec": {"a": [i]}} for i in range(3)]
    data = orjson.dumps(_list(items))
    second = data.index(b',{"metadata":{"name":"s-1"')
    stream = ItemStream()
    stream.feed(data[:second])
    assert list(stream.take()) == []  # its end not seen yet
    assert stream.head == {k: v for k, v in _list([]).items() if k != "items"}
    stream.feed(data[second:second + len(ITEM_START)])
    assert list(stream.take()) == []  # the separator is not whole yet
    stream.feed(data[second + len(ITEM_START):second + len(ITEM_START) + 1])
    assert list(stream.take()) == items[:1]
    stream.feed(data[second + len(ITEM_START) + 1:])
    assert list(stream.take()) == items[1:2]  # the last one's end is the body's
    stream.close()
    assert list(stream.take()) == items[2:] and stream.pieces == 3


def test_a_body_larger_than_the_limit_passes_when_its_items_are_taken_as_it_comes() -> None:
    items = [{"metadata": {"name": f"s-{i}"}, "spec": {"a": "x" * 50}} for i in range(200)]
    data = orjson.dumps(_list(items))
    stream, got, most = ItemStream(limit=2000, trim_at=500), [], 0
    for at in range(0, len(data), 300):
        stream.feed(data[at:at + 300])
        most = max(most, stream.held)
        got += stream.take()
    stream.close()
    got += stream.take()
    assert len(data) > 9 * 2000 and got == items and stream.pieces == 200
    assert most <= 300 + 2 * 100  # a chunk, and before it an item not cut yet (its end
    # is known once the next one starts) and a part of the next


def test_a_wrong_cut_after_a_drop_parses_the_rest_alone() -> None:
    items = [{"metadata": {"name": "a"}},
             {"metadata": {"name": "b"}, "spec": [1, {"metadata": {"name": "inner"}}]},
             {"metadata": {"name": "c"}}]
    data = orjson.dumps(_list(items))
    got, stream = _streamed(data, [len(data) // 3, 1], trim_at=0)
    assert got == items and stream.pieces == 1


def test_a_stream_over_its_limit_is_refused() -> None:
    stream = ItemStream(limit=10)
    stream.feed(b"x" * 10)
    with pytest.raises(TooLarge):
        stream.feed(b"y")
