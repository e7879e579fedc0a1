"""Fixtures for the simulator's conformance tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proxy.sim import SimServer
from tests.sim.client import Api


@pytest.fixture
def sim() -> Iterator[SimServer]:
    server = SimServer(bookmark_interval=0.2)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def api(sim: SimServer) -> Api:
    return Api(sim.url)
