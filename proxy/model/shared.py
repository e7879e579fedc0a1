"""Equal values the model makes again and again (an endpoint's state, its reason), kept
as one object each: a million endpoints at 100,000 services x 10 have a few distinct
ones per node.

A table of bounded size, emptied when full: nodes come and go for months, and what it
once shared stays shared, as each holder keeps its object."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

_T = TypeVar("_T", bound=Hashable)


class SharedValues(Generic[_T]):
    """`table(value)`: `value`, or the equal one made before."""

    __slots__ = ("_values", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # values held at most
        self._values: dict[_T, _T] = {}

    def __call__(self, value: _T) -> _T:
        got = self._values.get(value)
        if got is None:
            if len(self._values) >= self.limit:
                self._values.clear()
            got = self._values[value] = value
        return got

    def __len__(self) -> int:
        return len(self._values)
