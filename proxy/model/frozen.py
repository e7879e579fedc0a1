"""Frozen dataclasses made at the cost of plain ones (pure).

A frozen dataclass's own `__init__` sets each field through `object.__setattr__` (its
class forbids assignment): 1.2 us for an object of six fields, where setting the slots
through their descriptors takes 0.7. The model makes such objects for every endpoint
of a cold start (a million at 100,000 services x 10), and sets the slots of its
endpoints and selected endpoints itself (types.Endpoint, snapshot.SelectedEndpoint).
`fast_init` gives a class the second `__init__`, with the same parameters, defaults
and result.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar, cast

_C = TypeVar("_C", bound=type)


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """What sets slot `name` of a `cls` object, past a frozen class's `__setattr__`: for
    an `__init__` of its own (types.Endpoint's), as `fast_init` writes one."""
    return cast(Callable[[Any, Any], None], cls.__dict__[name].__set__)


def fast_init(cls: _C) -> _C:
    """Decorate a frozen dataclass with slots (applied after `@dataclass`): its
    `__init__` becomes one that sets the slots through their descriptors. Refused (at
    import) for a field `__init__` does not take, a keyword-only one, or a
    `__post_init__`: what the generated one would then do differently."""
    frozen = is_dataclass(cls) and cls.__dict__["__dataclass_params__"].frozen
    if not frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init is for frozen dataclasses with slots")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: a __post_init__ is not called by fast_init")
    ns: dict[str, Any] = {"_MISSING": MISSING}
    params, body = [], []
    for f in fields(cls):
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init takes positional fields")
        ns[f"_set_{f.name}"] = slot_setter(cls, f.name)
        if f.default is not MISSING:
            ns[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            ns[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            body.append(f"    if {f.name} is _MISSING: {f.name} = _factory_{f.name}()")
        else:
            params.append(f.name)
        body.append(f"    _set_{f.name}(self, {f.name})")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body or ["    pass"]), ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    before = inspect.signature(cls.__dict__["__init__"])
    if [p.name for p in inspect.signature(init).parameters.values()] != list(before.parameters):
        raise TypeError(f"{cls.__name__}: fast_init would change __init__'s parameters")
    setattr(cls, "__init__", init)  # noqa: B010 (mypy refuses assigning a method)
    return cls
