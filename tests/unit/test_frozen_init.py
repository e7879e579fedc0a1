"""fast_init (proxy/model/frozen.py): a frozen dataclass built through its slots'
descriptors is the object its generated __init__ would build, and stays frozen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from proxy.model.frozen import fast_init


def _made() -> list[object]:
    return []


@dataclass(frozen=True, slots=True)
class Plain:
    name: str
    port: int = 80
    tags: tuple[str, ...] = ()
    made: list[object] = field(default_factory=_made, compare=False)


Fast = fast_init(dataclasses.make_dataclass(
    "Fast", [("name", str), ("port", int, field(default=80)),
             ("tags", tuple, field(default=())),
             ("made", list, field(default_factory=_made, compare=False))],
    frozen=True, slots=True))


def _fields(obj: object) -> dict[str, object]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "kwargs"), [
    (("a",), {}),
    (("a", 81), {}),
    (("a",), {"tags": ("x",)}),
    ((), {"name": "b", "port": 1, "tags": ("y", "z"), "made": [1]}),
])
def test_the_same_fields_defaults_and_keywords_as_the_generated_init(
        args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    assert _fields(Fast(*args, **kwargs)) == _fields(Plain(*args, **kwargs))  # type: ignore[arg-type]


def test_a_default_factory_makes_a_new_value_each_time() -> None:
    one, two = Fast("a"), Fast("a")
    assert one.made == [] and one.made is not two.made
    assert one == two and hash(one) == hash(two)


def test_what_it_builds_stays_frozen_and_checks_its_arguments() -> None:
    obj = Fast("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.name = "b"
    with pytest.raises(TypeError):
        Fast()
    with pytest.raises(TypeError):
        Fast("a", 1, (), [], "too many")
    assert dataclasses.replace(obj, port=9).port == 9


def test_classes_it_would_build_differently_are_refused() -> None:
    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class KwOnly:
        a: int = field(kw_only=True)

    @dataclass(frozen=True, slots=True)
    class NotInit:
        a: int = field(init=False, default=0)

    for cls in (NoSlots, NotFrozen, PostInit, KwOnly, NotInit):
        with pytest.raises(TypeError):
            fast_init(cls)
