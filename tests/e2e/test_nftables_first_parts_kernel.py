"""A node's first start in nftables mode is committed in parts (transaction.first_lines,
NftRunner.send): the kernel reads back what a one-transaction start writes, later syncs
(full and partial) find the state they expect, a refused part is named by the
script's own line, and nft's fallback text, applied over the parts already taken,
ends where the parts would have. And any script, in parts or not, whose sequence
numbers would pass 2**32 - 1 is encoded again whole from 1."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.nftables import apply as nft_apply
from proxy.dataplane.nftables import runner as nft_runner
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.expressions import Unencodable
from proxy.dataplane.nftables.runner import NftError, NftRunner
from proxy.dataplane.nftables.transaction import Script, first_lines
from proxy.model.types import Family
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.conftest import POD_CIDRS, Cluster, NodePlane
from tests.e2e.test_nftables_kernel import ADDRESSES, listing, nft, wipe
from tests.unit.builders import ep, eps_slice, service

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]


def objects(moved: int = 0) -> list[dict[str, Any]]:
    """40 services of 1-40 endpoints (some past the slot maps' threshold), every third
    with ClientIP affinity, two sharing a pod; `moved` shifts svc-0's addresses."""
    out: list[dict[str, Any]] = []
    for i in range(40):
        name = f"svc-{i}"
        extra: dict[str, Any] = {"sessionAffinity": "ClientIP"} if i % 3 == 0 else {}
        out.append(service(name=name, ips=(f"198.18.128.{i + 1}",), **extra))
        base = 1 + (moved if i == 0 else 0)
        addresses = [f"198.18.{10 + i}.{base + k}" for k in range(1 + i)]
        if i == 1:
            addresses.append("198.18.12.1")  # svc-2's first pod too
        out.append(eps_slice(f"{name}-1", [ep(a) for a in addresses], service_name=name))
    return out


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """First scripts cut small (~300 lines a part); the batches the committer took,
    by their first line."""
    taken: list[int] = []
    put = nft_runner._Committer.put

    def counted(self: Any, batch: wire.Batch) -> None:
        taken.append(batch.runs[0][1])
        put(self, batch)

    monkeypatch.setattr(nft_runner._Committer, "put", counted)
    monkeypatch.setattr(nft_apply, "first_lines", functools.partial(first_lines,
                                                                    stage_lines=300))
    yield taken


def test_a_first_start_in_parts_reads_back_as_a_start_in_one_transaction(
        parts: list[int]) -> None:
    cluster = Cluster()
    state = cluster.become(*objects())
    with Lab([]) as lab:
        mine, theirs = lab.node_ns, lab.client_ns
        for ns in (mine, theirs):
            wipe(ns)
        # Theirs holds our (empty) main tables already: the one-transaction start.
        nft(theirs, "add", "table", "ip", "sliceproxy")
        nft(theirs, "add", "table", "ip6", "sliceproxy")
        plane = NodePlane(mine, mode="nftables", addresses=lambda: ADDRESSES)
        other = NodePlane(theirs, mode="nftables", addresses=lambda: ADDRESSES)
        plane.sync(state, full=True)
        assert len(parts) > 4 and parts.count(1) == 2  # IPv4, then IPv6, each in parts
        parts.clear()
        other.sync(state, full=True)
        assert parts == []
        assert listing(mine) == listing(theirs)
        dnat = str(listing(mine))
        assert '"addr": "198.18.49.40"' in dnat  # svc-39's last endpoint
        # A full sync over it changes nothing; a change lands as on the other node.
        plane.sync(state, full=True)
        assert listing(mine) == listing(theirs)
        changed = cluster.become(*objects(moved=7))
        for p in (plane, other):
            report = p.sync(changed)
            assert not report.full
        assert listing(mine) == listing(theirs)
        assert '"addr": "198.18.10.8"' in str(listing(mine))
        for p in (plane, other):
            p.cleanup()


def test_the_fallback_text_over_the_parts_taken_ends_as_all_the_parts(
        parts: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder stops at the third part (as at a line outside its dialect): the
    data plane hands the whole script's text to nft, which applies it over the two
    parts the kernel already took."""
    cluster = Cluster()
    state = cluster.become(*objects())
    encode = wire.encode
    calls: list[int] = []

    def failing(script: Any, family: Family, tables: Any, first_seq: int,
                first_line: int = 1) -> wire.Batch:
        calls.append(first_line)
        if len(calls) == 3:
            raise Unencodable("a line the test says is not encodable")
        return encode(script, family, tables, first_seq, first_line)

    with Lab([]) as lab:
        mine, theirs = lab.node_ns, lab.client_ns
        for ns in (mine, theirs):
            wipe(ns)
        v4 = DataplaneOptions("node-a", cluster_cidrs=POD_CIDRS, families=(Family.V4,))
        other = NodePlane(theirs, options=v4, mode="nftables", addresses=lambda: ADDRESSES,
                          clear_conntrack=False)
        other.sync(state, full=True)
        parts.clear()
        monkeypatch.setattr(wire, "encode", failing)
        plane = NodePlane(mine, options=v4, mode="nftables", addresses=lambda: ADDRESSES,
                          clear_conntrack=False)
        report = plane.sync(state, full=True)
        assert len(parts) == 2
        assert report.details["IPv4"]["applier"] == "nft"
        assert listing(mine) == listing(theirs)
        for p in (plane, other):
            p.cleanup()


def send(ns: str, script: Script, table: str, seq: int | None = None) -> None:
    """`script` sent by a runner of its own in namespace `ns` (its socket's sequence
    numbers from `seq` on, if given)."""
    with entered(ns):
        runner = NftRunner()
        try:
            if seq is not None:
                runner._netlink()._seq = seq
            runner.send(script, Family.V4, {table})
        finally:
            runner.close()


def test_a_refused_part_names_its_line_and_stops_the_parts_after_it() -> None:
    def make() -> Iterator[wire.Statement]:
        yield "add table ip spxparts"
        yield "add chain ip spxparts a"
        yield wire.COMMIT
        yield "add chain ip spxparts b"
        yield "add rule ip spxparts b jump nowhere"
        yield wire.COMMIT
        yield "add chain ip spxparts c"

    with Lab([]) as lab:
        ns = lab.node_ns
        wipe(ns)
        with pytest.raises(NftError) as refused:
            send(ns, Script(make, "ip", parts=True), "spxparts")
        assert refused.value.line == 4
        assert refused.value.offending == "add rule ip spxparts b jump nowhere"
        held = nft(ns, "list", "table", "ip", "spxparts")
        assert "chain a" in held
        assert "chain b" not in held and "chain c" not in held
        wipe(ns)


@pytest.mark.parametrize("error, raised", [(OSError(5, "Input/output error"), NftError),
                                           (RuntimeError("a bug"), RuntimeError)],
                         ids=["socket", "bug"])
def test_a_part_the_socket_fails_to_send_is_an_error_not_a_hang(
        monkeypatch: pytest.MonkeyPatch, error: BaseException, raised: type) -> None:
    """More parts than the committer's queue holds, the second failing in the socket
    (or in our code): the caller, handing over the parts after it, gets the error."""
    def make() -> Iterator[wire.Statement]:
        yield "add table ip spxparts"
        for i in range(8):
            yield wire.COMMIT
            yield f"add chain ip spxparts c{i}"

    real = nft_runner.NetlinkSocket.first_refusal
    calls: list[int] = []

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(nft_runner.NetlinkSocket, "first_refusal", failing)
    outcome: list[BaseException | None] = []
    with Lab([]) as lab:
        ns = lab.node_ns
        wipe(ns)

        def sending() -> None:
            try:
                send(ns, Script(make, "ip", parts=True), "spxparts")
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        sender = threading.Thread(target=sending, daemon=True)
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "send() still waiting on a dead committer"
        assert isinstance(outcome[0], raised)
        assert str(error) in str(outcome[0])
        assert len(calls) == 2  # nothing sent after the failure
        held = nft(ns, "list", "table", "ip", "spxparts")
        assert "chain c0" not in held
        wipe(ns)


@pytest.mark.parametrize("parts", [False, True], ids=["one-transaction", "parts"])
def test_a_script_is_encoded_again_whole_when_the_sequence_numbers_wrap(parts: bool) -> None:
    """A batch's numbers would pass 2**32 - 1: it is encoded again from 1, from the
    script's statements made again (a script made as it is read is read twice)."""
    def make() -> Iterator[wire.Statement]:
        yield "add table ip spxwrap"
        yield wire.COMMIT
        for i in range(3):
            yield f"add chain ip spxwrap c{i}"

    with Lab([]) as lab:
        ns = lab.node_ns
        wipe(ns)
        send(ns, Script(make, "ip", parts=parts), "spxwrap", seq=0xFFFFFFFF - 4)
        held = nft(ns, "list", "table", "ip", "spxwrap")
        assert all(f"chain c{i}" in held for i in range(3))
        wipe(ns)
