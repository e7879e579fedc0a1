"""The periodic resync a table at a time (nftables/resync_steps.py) in the kernel: each
part is a transaction nf_tables takes, what was changed behind the agent's back is
repaired, a change between the parts lands, and the tables end as a full sync from
scratch writes them (read back by nft). The property itself, with more shapes and
changes, runs on the fake kernel (tests/unit/test_nftables_resync_steps.py)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.dataplane.nftables import render
from proxy.dataplane.nftables.render import TABLE
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.conftest import Cluster, NodePlane
from tests.e2e.test_nftables_first_parts_kernel import objects
from tests.e2e.test_nftables_kernel import ADDRESSES, listing, nft, wipe
from tests.unit.builders import ep, eps_slice, service

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

SHARDS = 4


def counted() -> list[dict[str, Any]]:
    """A service whose endpoints' connections are counted (named counters, which a
    resync's part declares again: the kernel keeps their counts)."""
    return [service("counted", ips=("198.18.129.1",),
                    annotations={"sliceproxy.io/traffic-per-endpoint": "true"}),
            eps_slice("counted-1", [ep(f"198.18.60.{k}") for k in range(1, 4)],
                      service_name="counted")]


def test_a_resync_in_parts_repairs_lets_a_change_between_and_ends_as_a_full_sync() -> None:
    cluster = Cluster()
    state = cluster.become(*objects(), *counted())
    with Lab([]) as lab:
        mine, theirs = lab.node_ns, lab.client_ns
        for ns in (mine, theirs):
            wipe(ns)
        plane = NodePlane(mine, mode="nftables", addresses=lambda: ADDRESSES, shards=SHARDS)
        other = NodePlane(theirs, mode="nftables", addresses=lambda: ADDRESSES,
                          shards=SHARDS)
        plane.sync(state, full=True)
        plane.settle()
        # Behind the agent's back: a cluster IP's element deleted from the main table,
        # an affinity port's service chain flushed, a chain of someone else's added.
        nft(mine, "delete", "element", "ip", TABLE, render.CLUSTER_IPS, "{ 198.18.128.2 }")
        shard = render.shard_table(1)
        victim = next(line.split()[1] for line in nft(mine, "list", "chains", "ip").splitlines()
                      if line.strip().startswith("chain svc-"))
        tables = [line.split()[2] for line in nft(mine, "list", "tables", "ip").splitlines()]
        owner = next(t for t in tables
                     if victim in nft(mine, "list", "table", "ip", t).split())
        nft(mine, "flush", "chain", "ip", owner, victim)
        nft(mine, "add", "chain", "ip", shard, "theirs")
        other.sync(state, full=True)
        other.settle()
        assert listing(mine) != listing(theirs)
        changed = cluster.become(*objects(moved=7), *counted())
        with entered(mine):
            assert plane.dp.begin_resync(False)  # the periodic one
            plane.dp.housekeeping()  # one table of each family
        assert not plane.sync(changed).full  # a change between the parts
        assert '"addr": "198.18.10.8"' in str(listing(mine))
        with entered(mine):
            while plane.dp.housekeeping_pending():
                plane.dp.housekeeping()
        other.sync(changed, full=True)
        other.settle()
        assert listing(mine) == listing(theirs)
        for p in (plane, other):
            p.cleanup()
