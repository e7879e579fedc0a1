"""A rolling update of a whole service with traffic flowing: failed connections, the lag
between the API and the kernel, the agent's CPU and memory.

    sudo .venv/bin/python -m bench.rolling_update                        # 1,000, both modes
    sudo .venv/bin/python -m bench.rolling_update --endpoints 10000 --mode nftables
    sudo .venv/bin/python -m bench.rolling_update --endpoints 50000 --rate 100 1000 \
        --mode nftables --traffic-rate 100
    flock /tmp/spx-heavy.lock .venv/bin/python -m bench.rolling_update --endpoints 10000

The set-up, every part of it in network namespaces of a lab (`proxy.netns_lab`) made for the
run and removed after it (also on SIGTERM):

- node: the simulator (`python -m proxy.sim`, its own process, as bench/agent_start.py
  starts it) and the real agent (`python -m proxy --proxy-mode MODE`, agent_start's
  flags, `-v 2` so that it logs every sync);
- pods: one namespace behind a veth from the node (198.18.2.0/24; the node routes
  198.19.0.0/16 and 198.18.4.0-198.18.254.255 there: 50,000 old and 50,000 new pods),
  every pod's address a local /32 route there (as good as an address to a socket, and
  1,000 times cheaper to add at 100,000 than addresses on one device), and ONE
  listener on 0.0.0.0:8080 (`proxy.netns_lab.echo` answering with the address reached), so
  every endpoint really accepts connections, and stops doing so once its route goes;
- client: short TCP connections to the ClusterIP (`proxy.netns_lab.probe.ask_once`: connect,
  one line, the answer) at `--traffic-rate` a second, from a little before the roll to
  a little after it; each one's outcome (the pod that answered, or refused, reset,
  timeout) is kept with its time.

One ClusterIP service (`bench/huge`, TCP 80 -> 8080, bench/huge_service.py's objects)
with N ready endpoints in slices of 100, as the EndpointSlice controller writes them.
The roll, as a Deployment's (maxSurge) does it, through the simulator's HTTP API, in
ticks of 100 ms, `--rate` endpoints replaced a second (several rates: one roll each):
each tick, `rate/10` new pods get fresh addresses (added in the pods namespace first)
and appear not ready; `--ready-delay` later they are ready; one tick after that, as many
old pods go terminating (ready=false, serving=true, terminating=true); `--grace` later
they are deleted (their endpoints leave the slices) and `--teardown` after that delete
their addresses are removed (as a kubelet tears a sandbox down): by then the proxy must
long have stopped sending them new connections. The slices are kept as the controller
keeps them: changed endpoints are updated in place, gone ones removed, new ones placed
first in slices written this tick anyway, then in the fullest slice that takes them all,
else in new slices; an emptied slice is deleted. Each slice a tick changes is written
once (PUT, POST or DELETE), over one kept-alive connection.

The lag of a write: from the moment it was sent to the kernel holding its effect (the
endpoints it made ready among the service's DNAT targets, those it made terminating no
longer). The kernel is read (the service's chain: `nft list chain`, or `iptables -t nat
-S`) each time nf_tables announces a transaction on the agent's tables (heard on netlink
in the node's namespace, as bench/realcp_latency/ does), and a change is dated by the
announcement that preceded the read that first showed it; on legacy iptables (no
announcements) the chain is polled every 100 ms and dated by the read. In nftables mode
a service of 128 endpoints or more balances through a slot map: that map is read once,
then followed from nf_tables' announcements of its elements added and deleted, the
endpoints recorded at the end of each transaction and dated when it is heard (listing
the map takes ~90 ms at 10,000 endpoints and 2.7 s at 50,000). Writes that change
nothing the kernel holds (a pod appearing not ready, a terminating pod deleted) have no
lag. Reported: p50/p99/max over every write of the roll and over its last 10%
("end"), and the convergence: from the last write that changes what the kernel should
hold to the kernel holding exactly the new endpoints. The agent's CPU (its own and its
children's, iptables-restore) from /proc over the roll, its peak RSS (VmHWM), its syncs
from its log. The kernel's reads take longer with the service (at 50,000 endpoints the
slot map is listed whole): `kernel_reads` in the JSON says how long, the resolution of
the lag.

Issue 29's pacing, side by side (`--pacing old new`, the default): each roll runs once
with `--min-sync-period 1s` (old: the fixed-rate runner, set explicitly) and once with no
pacing flag (new: the agent's default, whatever it is when the bench runs), one right
after the other, each with a fresh lab, simulator and agent. Timings are reported,
never asserted. Needs root.
"""

from __future__ import annotations

from bench.rolling_update.cli import main
from bench.rolling_update.measure import run
from bench.rolling_update.report import markdown
from bench.rolling_update.workload import READY, TERMINATING, Roll, Settings

__all__ = ["READY", "Roll", "Settings", "TERMINATING", "main", "markdown", "run"]
