"""Fixtures the unit tests share."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture
def collector_restored() -> Iterator[None]:
    """Python's collector on for the test, then as it was, nothing left frozen: for
    tests of what holds it off (dataplane/common/collector.py, agent/startup_gc.py)."""
    was = gc.isenabled()
    gc.enable()
    yield
    gc.unfreeze()
    if was:
        gc.enable()
    else:
        gc.disable()
