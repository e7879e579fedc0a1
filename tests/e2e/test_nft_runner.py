"""NftRunner against the real kernel, in network namespaces the tests make and remove:
both appliers (libnftables in-process, `nft -f -`), atomicity, the errors nft reports,
the thread and namespace binding, and recognising our own commits as the kernel names
them. Nothing is written into the host's namespace; the fixture checks it."""

from __future__ import annotations

import os
import queue
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import pytest

from proxy.dataplane.common import processes
from proxy.dataplane.common.netlink_constants import (
    NETLINK_ADD_MEMBERSHIP,
    NETLINK_NETFILTER,
    NFNLGRP_NFTABLES,
    SOL_NETLINK,
)
from proxy.dataplane.common.nft_events import Transaction, TransactionReader
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.runner import NftError, NftRunner, unavailable
from proxy.model.types import Family
from proxy.netns_lab.netns import entered

T = TypeVar("T")
TABLE = "spxrun"
IN_PROCESS, CHILD = 1 << 30, 0  # subprocess_above: never / always the child
PATHS = pytest.mark.parametrize("above", [IN_PROCESS, CHILD], ids=["libnftables", "nft-f"])


def _nft(*args: str, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["nft", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


class InNamespace:
    """One thread, inside network namespace `ns` for its whole life, running the
    callables it is given in order (a runner is bound to one thread)."""

    def __init__(self, ns: str) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, args=(ns,), daemon=True)
        self._thread.start()

    def _serve(self, ns: str) -> None:
        with entered(ns):
            while (job := self._jobs.get()) is not None:
                fn, future = job
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def call(self, fn: Callable[[], T]) -> T:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future.result(timeout=120)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=120)


def _make_ns(made: list[str]) -> str:
    name = f"spxr-{os.getpid()}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    made.append(name)
    return name


@pytest.fixture
def namespaces() -> Iterator[Callable[[], str]]:
    """Makes fresh namespaces on demand; removes them all, and checks the host's
    namespace never got our table, whatever happened."""
    made: list[str] = []
    try:
        yield lambda: _make_ns(made)
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], check=False, timeout=30)
        host = _nft("list", "tables")
        assert host.returncode == 0, host.stderr
        assert TABLE not in host.stdout


@pytest.fixture
def ns(namespaces: Callable[[], str]) -> str:
    return namespaces()


@pytest.fixture
def worker(ns: str) -> Iterator[InNamespace]:
    thread = InNamespace(ns)
    try:
        yield thread
    finally:
        thread.close()


@pytest.fixture
def children(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The commands the runner started as children."""
    started: list[list[str]] = []
    real = processes.run_recorded

    def recording(cmd: list[str], text: str,
                  timeout: float = processes.RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
        started.append(cmd)
        return real(cmd, text, timeout)

    monkeypatch.setattr(processes, "run_recorded", recording)
    return started


SERVICE = (f"add table ip {TABLE}\n"
           f"add chain ip {TABLE} svc-ab\n"
           f"add rule ip {TABLE} svc-ab numgen random mod 2 0 meta l4proto tcp "
           "dnat to 198.19.0.1:8080\n"
           f"add rule ip {TABLE} svc-ab meta l4proto tcp dnat to 198.19.0.2:8080\n")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces")
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
class TestKernel:
    @PATHS
    def test_transaction_applied_and_visible(self, above: int, ns: str, worker: InNamespace,
                                             children: list[list[str]]) -> None:
        runner = NftRunner(subprocess_above=above)  # made in the host: nothing opened yet
        try:
            worker.call(lambda: runner.run(SERVICE))
            listing = _nft("list", "table", "ip", TABLE, ns=ns)
            assert listing.returncode == 0, listing.stderr
            assert "dnat to 198.19.0.1:8080" in listing.stdout
            assert "dnat to 198.19.0.2:8080" in listing.stdout
            assert children == ([] if above == IN_PROCESS else [["nft", "-f", "-"]])
            # A change, then read back through list_json (always in-process).
            worker.call(lambda: runner.run(f"flush chain ip {TABLE} svc-ab\n"
                                           f"add rule ip {TABLE} svc-ab meta l4proto tcp "
                                           "dnat to 198.19.0.3:8080\n"))
            table = worker.call(lambda: runner.list_json(f"list table ip {TABLE}"))
            rules = [item["rule"] for item in table["nftables"] if "rule" in item]
            assert len(rules) == 1 and "198.19.0.3" in str(rules[0]["expr"])
        finally:
            worker.call(runner.close)

    @PATHS
    def test_a_failing_last_line_leaves_nothing(self, above: int, ns: str,
                                                worker: InNamespace) -> None:
        runner = NftRunner(subprocess_above=above)
        text = SERVICE + f"add rule ip {TABLE} no-such-chain counter\n"
        try:
            with pytest.raises(NftError) as caught:
                worker.call(lambda: runner.run(text))
            assert caught.value.line == 5
            assert "No such file or directory" in str(caught.value)
            tables = _nft("list", "tables", ns=ns)
            assert tables.returncode == 0 and TABLE not in tables.stdout
        finally:
            worker.call(runner.close)

    def test_errors_name_line_and_text_on_both_paths(self, ns: str,
                                                     worker: InNamespace) -> None:
        setup = (f"add table ip {TABLE}\nadd chain ip {TABLE} a\nadd chain ip {TABLE} b\n"
                 f"add rule ip {TABLE} a jump b\n")
        cases = {  # script -> (line, offending, what nft says)
            "syntax": (f"add chain ip {TABLE} c\nadd chain ip {TABLE} d\n"
                       f"add rule ip {TABLE} c jump\nadd chain ip {TABLE} e\n",
                       3, f"add rule ip {TABLE} c jump", "syntax error"),
            "busy": (f"add chain ip {TABLE} c\ndelete chain ip {TABLE} b\n"
                     f"add chain ip {TABLE} e\n",
                     2, f"delete chain ip {TABLE} b", "Device or resource busy"),
            "missing": (f"add chain ip {TABLE} c\nadd chain ip {TABLE} d\n"
                        f"add rule ip {TABLE} nochain counter\nadd chain ip {TABLE} e\n",
                        3, f"add rule ip {TABLE} nochain counter",
                        "No such file or directory"),
        }
        here, child = NftRunner(subprocess_above=IN_PROCESS), NftRunner(subprocess_above=CHILD)
        try:
            worker.call(lambda: here.run(setup))
            for name, (text, line, offending, says) in cases.items():
                messages = []
                for runner in (here, child):
                    with pytest.raises(NftError) as caught:
                        worker.call(lambda r=runner, t=text: r.run(t))
                    err = caught.value
                    assert (err.line, err.offending) == (line, offending), (name, str(err))
                    assert says in str(err), (name, str(err))
                    messages.append(str(err))
                assert messages[0] == messages[1], name  # same words either way
            chains = worker.call(lambda: here.list_json(f"list table ip {TABLE}"))
            assert sorted(c["chain"]["name"] for c in chains["nftables"] if "chain" in c) \
                == ["a", "b"]
        finally:
            worker.call(here.close)
            worker.call(child.close)

    def test_list_json_of_a_missing_table_raises(self, worker: InNamespace) -> None:
        runner = NftRunner()
        try:
            with pytest.raises(NftError, match=f"^list table ip {TABLE}: No such file or"):
                worker.call(lambda: runner.list_json(f"list table ip {TABLE}"))
            assert "nftables" in worker.call(lambda: runner.list_json("list tables ip"))
        finally:
            worker.call(runner.close)

    def test_probe_says_which_keys_a_set_holds(self, ns: str, worker: InNamespace) -> None:
        """Asked one by one, a key the set lacks is no error; nor is a set that is not
        there (the kernel answers ENOENT for both): it holds none."""
        _nft("add", "table", "ip", TABLE, ns=ns)
        _nft("add", "set", "ip", TABLE, "pairs", "{ type ipv4_addr . ipv4_addr; }",
             ns=ns)
        _nft("add", "element", "ip", TABLE, "pairs",
             "{ 198.18.1.1 . 198.18.1.1, 198.18.1.3 . 198.18.1.3 }", ns=ns)
        runner = NftRunner()
        keys = [(f"198.18.1.{i}", f"198.18.1.{i}") for i in (1, 2, 3, 4)]
        try:
            held = worker.call(lambda: runner.probe(Family.V4, TABLE, "pairs", keys))
            assert held.partial and not held.decoded
            assert held.raw == set(wire.element_keys(Family.V4, [keys[0], keys[2]]))
            assert not worker.call(lambda: runner.probe(Family.V4, TABLE, "missing", keys)).raw
        finally:
            worker.call(runner.close)

    def test_probe_reads_a_pick_maps_values(self, ns: str, worker: InNamespace) -> None:
        """A map's keys asked one by one come back with their values, as a dump reads
        them; a key the map lacks is not there."""
        _nft("add", "table", "ip", TABLE, ns=ns)
        _nft("add", "map", "ip", TABLE, "eps", "{ typeof ip daddr . tcp dport . numgen "
             "random mod 1 : ip daddr . tcp dport; }", ns=ns)
        _nft("add", "element", "ip", TABLE, "eps", "{ 198.18.2.1 . 80 . 0 : 198.18.1.7 . "
             "8080, 198.18.2.1 . 80 . 1 : 198.18.1.8 . 8081 }", ns=ns)
        runner = NftRunner()
        types = ("ipv4_addr", "inet_service", "integer")
        keys = [("198.18.2.1", 80, 1), ("198.18.2.1", 80, 2), ("198.18.2.2", 80, 0)]
        try:
            held = worker.call(lambda: runner.probe(Family.V4, TABLE, "eps", keys, types, True))
            dumped = worker.call(lambda: runner.elements(Family.V4, TABLE, "eps", types, True))
        finally:
            worker.call(runner.close)
        assert held.partial and not held.raw
        assert held.decoded == {("198.18.2.1", 80, 1): ("198.18.1.8", 8081)}
        assert held.decoded.items() <= dumped.decoded.items()

    def test_refuses_another_thread_and_namespace(self, namespaces: Callable[[], str],
                                                  ns: str, worker: InNamespace) -> None:
        runner = NftRunner()
        other = namespaces()
        try:
            worker.call(lambda: runner.run(SERVICE))
            # The test's own thread is in the host's namespace: refused before any access.
            with pytest.raises(RuntimeError, match="thread"):
                runner.run(f"add chain ip {TABLE} host-chain\n")
            with pytest.raises(RuntimeError, match="thread"):
                runner.list_json("list tables")

            def moved() -> None:
                with entered(other):
                    runner.run(f"add chain ip {TABLE} elsewhere\n")

            with pytest.raises(RuntimeError, match="namespace"):
                worker.call(moved)
            assert "elsewhere" not in _nft("list", "ruleset", ns=ns).stdout
            assert _nft("list", "ruleset", ns=other).stdout.strip() == ""
        finally:
            worker.call(runner.close)

    def test_started_here_knows_our_commits(self, ns: str, worker: InNamespace) -> None:
        """As the kernel names committers: this thread's id in-process, the child's pid."""
        def listen() -> socket.socket:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            sock.bind((0, 0))
            sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
            return sock

        sock = worker.call(listen)
        here, child = NftRunner(subprocess_above=IN_PROCESS), NftRunner(subprocess_above=CHILD)
        try:
            assert here.started_here(os.getpid())
            worker.call(lambda: here.run(f"add table ip {TABLE}\n"))
            worker.call(lambda: child.run(f"add chain ip {TABLE} by-child\n"))
            foreign = _nft("add", "chain", "ip", TABLE, "by-someone-else", ns=ns)
            assert foreign.returncode == 0, foreign.stderr
            sock.settimeout(30)  # a bound on a broken test, not a synchronisation
            reader, seen = TransactionReader(), list[Transaction]()
            while len(seen) < 3:
                seen += reader.feed(sock.recv(1 << 16))
            ours_here, ours_child, theirs = seen
            assert ours_here.pid == worker.call(threading.get_native_id) != os.getpid()
            assert here.started_here(ours_here.pid)
            assert ours_child.process == "nft" and child.started_here(ours_child.pid)
            assert theirs.pid is not None and not child.started_here(theirs.pid)
        finally:
            sock.close()
            worker.call(here.close)
            worker.call(child.close)
        assert not processes.started_here(ours_here.pid)  # forgotten with its context
