"""`layer` and `Layered` (model/layered.py), under DesiredState's snapshots: whatever the
updates, each mapping reads as a plain dict updated the same way would, and every
earlier mapping still reads as it did (they share a base that is never written)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.model.layered import Layered, layer

# Batches of (key, value or None) over few keys, and a small fold limit: overlays fold
# into new bases often, and keys come and go across folds.
KEYS = 12
batches = st.lists(st.dictionaries(st.integers(0, KEYS), st.none() | st.integers(0, 3),
                                   max_size=6), max_size=25)


def _differs(old: int | None, new: int) -> bool:
    return old != new


@settings(max_examples=300, deadline=None)
@given(batches, st.integers(0, 5))
def test_each_layered_mapping_reads_as_the_plain_dict_and_earlier_ones_stay(
        updates: list[dict[int, int | None]], limit: int) -> None:
    base: dict[int, int] = {}
    over: dict[int, object] = {}
    size = 0
    plain: dict[int, int] = {}
    kept: list[tuple[Layered[int, int], dict[int, int]]] = []
    for batch in updates:
        before = dict(plain)
        base, over, size, changed = layer(base, over, size, batch, _differs, limit)
        for key, value in batch.items():
            if value is None:
                plain.pop(key, None)
            else:
                plain[key] = value
        assert changed == {k for k in before.keys() | plain.keys()
                           if before.get(k) != plain.get(k)}
        assert len(over) <= limit
        mapping = Layered(base, over, size)
        kept.append((mapping, dict(plain)))
        for m, wanted in kept:
            assert len(m) == len(wanted)
            assert dict(m.items()) == wanted and sorted(m) == sorted(wanted)
            assert sorted(m.values()) == sorted(wanted.values())
            assert list(m.values()) == [value for _key, value in m.items()]  # one order
            for key in range(-1, KEYS + 2):
                assert (key in m) == (key in wanted)
                assert m.get(key) == wanted.get(key)


def test_an_unchanged_value_is_kept_and_no_change() -> None:
    held = {1: "a"}
    base, over, size, changed = layer(held, {}, 1, {1: "a"}, lambda old, new: old != new)
    assert (base, over, size, changed) == (held, {}, 1, set())
