"""Someone else changes our rules between syncs: a process deletes one of our chains, a
host firewall flushes the nat table or reloads the whole ruleset; in the nftables mode,
a process flushes one of our chains or deletes one of our tables. The agent notices (on
nf_tables from the kernel's announcements, on legacy from its table canary) and rewrites
its rules long before the next periodic full sync (an hour away)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from tests.e2e.agent_support import endpoint, endpoint_slice, wait_for
from tests.faults.conftest import BOTH_PORTS, WEB, FaultNode, nft_objects, settle

pytestmark = pytest.mark.root

# A change returns our rules as read right after it when it can (nftables mode: the
# agent repairs within a few hundred milliseconds, before a separate read could see it).
Change = Callable[[FaultNode], list[str] | None]
DNAT = re.compile(r"-j DNAT|\bdnat to\b")  # an endpoint's rule, iptables or nftables


def _iptables(node: FaultNode, *args: str) -> None:
    node.lab.exec(node.lab.node_ns, [f"iptables-{node.backend}", *args], check=True)


def _nft(node: FaultNode, *args: str, script: str | None = None) -> list[str]:
    """`nft args` (reading `script` on stdin), then our objects read in the same breath."""
    res = node.lab.exec(node.lab.node_ns, ["sh", "-c", 'nft "$@" && nft list ruleset',
                                           "sh", *args], check=True, input=script)
    return nft_objects(res.stdout)


def web_endpoints(rules: list[str]) -> int:
    """The endpoints web's rules pick from: its DNAT rules (iptables, or nftables with a
    chain of its own), or its elements of a pick map (nftables: a picked port)."""
    return sum(("demo/web:http" in r and DNAT.search(r) is not None)
               or (r.startswith("element ") and " eps-tcp-" in r and f" {WEB} . 80 . " in r)
               for r in rules)


def web_chain(node: FaultNode) -> tuple[str, str]:
    """nftables mode: the (table, chain) web's cluster IP:80 dispatches to (its shard's
    pick chain for its endpoint count: web is a picked port)."""
    element = next(r for r in node.rules() if r.startswith("element ip ")
                   and f" {WEB} . tcp . 80 : goto " in r)
    return element.split()[2], element.split()[-1]


def delete_endpoint_chain(node: FaultNode) -> list[str] | None:
    """What a careless script does: empty web's service chain (so nothing refers to its
    endpoint chains any more) and delete one endpoint chain. The nftables mode has no
    endpoint chains here (only with ClientIP affinity): web's service chain itself goes,
    with the dispatch map's element that leads to it."""
    if node.nftables:
        # One transaction, as above; a chain in use cannot go, so the elements that go
        # to it go first (web's pick chain: every port of its shard with as many
        # endpoints).
        table, chain = web_chain(node)
        users = [r.split(" : ")[0].split(maxsplit=4)[4] for r in node.rules()
                 if r.startswith(f"element ip {table} service-ips ")
                 and r.endswith(f": goto {chain}")]
        return _nft(node, "-f", "-", script="".join(
            f"delete element ip {table} service-ips {{ {u} }}\n" for u in users)
            + f"flush chain ip {table} {chain}\ndelete chain ip {table} {chain}\n")
    rules = "\n".join(node.rules())
    svc = re.search(r'-A (SPX-SVC-\S+) .*--comment "?demo/web:http', rules)
    assert svc, rules
    sep = re.search(rf"-A {re.escape(svc.group(1))} .*-j (SPX-SEP-\S+)", rules)
    assert sep, rules
    # One transaction: the agent repairs a flushed chain faster than a second command
    # could delete the endpoint chain.
    if node.backend == "nft":
        node.lab.exec(node.lab.node_ns, ["nft", "-f", "-"], check=True,
                      input=f"flush chain ip nat {svc.group(1)}\n"
                            f"flush chain ip nat {sep.group(1)}\n"
                            f"delete chain ip nat {sep.group(1)}\n")
    else:
        node.lab.exec(node.lab.node_ns, ["iptables-legacy-restore", "--noflush"], check=True,
                      input=f"*nat\n-F {svc.group(1)}\n-F {sep.group(1)}\n"
                            f"-X {sep.group(1)}\nCOMMIT\n")
    return None


def flush_nat(node: FaultNode) -> None:
    _iptables(node, "-t", "nat", "-F")


def flush_chain(node: FaultNode) -> list[str]:
    """nftables mode: `nft flush chain` on web's service chain (its DNAT rules gone)."""
    return _nft(node, "flush", "chain", "ip", *web_chain(node))


def delete_shard_table(node: FaultNode) -> list[str]:
    """nftables mode: `nft delete table` on the shard holding every service here."""
    return _nft(node, "delete", "table", "ip", "sliceproxy-0")


def reload_firewall(node: FaultNode) -> list[str] | None:
    """A host firewall replacing the whole ruleset: `nft flush ruleset` on nf_tables (and
    in the nftables mode); on legacy, a restore without --noflush of empty nat and
    filter tables."""
    if node.nftables:
        return _nft(node, "flush", "ruleset")
    if node.backend == "nft":
        node.lab.exec(node.lab.node_ns, ["nft", "flush", "ruleset"], check=True)
    else:
        node.lab.exec(node.lab.node_ns, ["iptables-legacy-restore"], check=True,
                      input="*nat\nCOMMIT\n*filter\nCOMMIT\n")
    return None


CHANGES: dict[str, Change] = {
    "a chain of ours deleted": delete_endpoint_chain,
    "nat table flushed": flush_nat,  # iptables' nat table: nothing of the nftables mode's
    "a chain of ours flushed": flush_chain,
    "a table of ours deleted": delete_shard_table,
    "firewall reload (whole ruleset)": reload_firewall,
}
IPTABLES_CHANGES = ("a chain of ours deleted", "nat table flushed",
                    "firewall reload (whole ruleset)")
NFTABLES_CHANGES = ("a chain of ours flushed", "a chain of ours deleted",
                    "a table of ours deleted", "firewall reload (whole ruleset)")
CASES = [*((m, c) for m in ("iptables/nft", "iptables/legacy") for c in IPTABLES_CHANGES),
         *(("nftables", c) for c in NFTABLES_CHANGES)]


@pytest.mark.parametrize(("mode", "change"), CASES, indirect=["mode"])
def test_foreign_change_is_repaired(fault_node: FaultNode, change: str) -> None:
    node = fault_node
    agent = node.agent
    before = sorted(node.rules())
    assert before
    with node.traffic() as traffic:
        settle(0.5)
        began = time.monotonic()
        changed = CHANGES[change](node)
        assert sorted(node.rules() if changed is None else changed) != before, \
            "the foreign change changed nothing"
        wait_for(lambda: sorted(node.rules()) == before, 20.0,
                 f"our rules back after: {change}")
        repaired = time.monotonic()
        settle(1.0)
    report = traffic.report(since=began)
    after = traffic.report(since=repaired + 0.2)
    metrics = agent.metrics()
    log = agent.log_text()
    node.record(f"foreign change: {change}", report, repaired - began,
                restarts=node.restarts(),
                notes="cuts the data path until repaired")
    assert agent.alive() and node.restarts() == 0
    assert "another process changed our rules" in log, agent.log_tail()
    assert metrics["sliceproxy_rules_drift_repairs_total"] >= 1
    # No periodic resync did this: the only full syncs are the first and the repairs.
    assert metrics.get('sliceproxy_syncs_total{kind="full",result="ok"}', 0) \
        <= 1 + metrics["sliceproxy_rules_drift_repairs_total"]
    assert after.failed == 0, after.failures()


def test_our_own_syncs_are_not_drift(fault_node: FaultNode) -> None:
    """Changes the agent makes itself never count as someone else's."""
    node = fault_node
    sim, lab = node.sim, node.lab
    b = lab.backends
    for i in range(5):
        names = ("web-1", "web-2") if i % 2 else ("web-1",)
        sim.apply(endpoint_slice("web-1", "web", [endpoint(b[n].ipv4, node=b[n].node)
                                                  for n in names], BOTH_PORTS))
        want = 1 + i % 2
        wait_for(lambda want=want: web_endpoints(node.rules()) == want,
                 15.0, f"web with {want} endpoints")
    settle(1.0)  # room for any (wrong) drift report to arrive and be acted on
    metrics = node.agent.metrics()
    assert metrics["sliceproxy_rules_drift_repairs_total"] == 0
    # On nf_tables the listener attributes our restores (and in the nftables mode our
    # transactions, through nft or netlink) to us: not even a check.
    if node.nftables or node.backend == "nft":
        assert metrics["sliceproxy_rules_drift_checks_total"] == 0
