"""The IPVS table sampler (proxy/dataplane/ipvs/sample.py): which virtual servers each
look asks for, and when it reports; the kernel side runs in the kernel lab
(tests/kernel/scenarios/scenario_table.py, scenario_faults.py)."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any, cast

from proxy.dataplane.ipvs.kernel import IpvsTable
from proxy.dataplane.ipvs.render import VsKey
from proxy.dataplane.ipvs.sample import TableSampler
from proxy.model.types import Protocol
from tests.fakekernel.ipvs import FakeIpvs

KEYS = [VsKey(Protocol.TCP, ip_address(f"198.18.0.{i}"), 80) for i in range(1, 21)]


def sampler(notes: list[str]) -> TableSampler:
    s = TableSampler(notes.append, per_tick=8)
    s.publish(KEYS)
    return s


def test_looks_go_round_every_key() -> None:
    notes: list[str] = []
    s, table = sampler(notes), FakeIpvs.holding(KEYS)
    for _ in range(3):  # 20 keys, 8 a look: round once in three looks
        s.look(cast(Any, table))
    assert {k for asked in table.asked for k in asked} == set(KEYS)
    assert all(len(asked) == 8 for asked in table.asked) and notes == []


def test_a_flush_is_reported_at_the_next_look() -> None:
    notes: list[str] = []
    s = sampler(notes)
    assert len(s.look(cast(Any, FakeIpvs()))) == 8
    assert notes == ["8 of 8 virtual servers sampled are missing from the IPVS table, "
                     "first TCP 198.18.0.1:80"]
    assert s.take_found() == KEYS[:8]  # for check_drift to ask again, once
    assert s.take_found() == []


def test_one_deleted_is_found_within_a_round() -> None:
    notes: list[str] = []
    s, table = sampler(notes), FakeIpvs.holding(KEYS[:-1])
    for _ in range(3):
        s.look(cast(Any, table))
    assert len(notes) == 1 and "1 of 8" in notes[0]


def test_nothing_published_nothing_asked() -> None:
    notes: list[str] = []
    s = TableSampler(notes.append)
    table = FakeIpvs()
    assert s.look(cast(IpvsTable, table)) == [] and notes == []
    s.publish(KEYS[:2])
    s.publish(())  # a clean-up: no longer ours
    assert s.look(cast(IpvsTable, table)) == [] and notes == []
