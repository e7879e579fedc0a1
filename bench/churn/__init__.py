"""Random endpoint churn over many services, isolated changes and a burst of new
services: the lag from an EndpointSlice write to the kernel, the agent's CPU and RSS,
with the old sync pacing beside the new (issue 29).

    sudo .venv/bin/python -m bench.churn                                # 10,000 x 3
    sudo .venv/bin/python -m bench.churn --services 1000 --phases isolated
    sudo .venv/bin/python -m bench.churn --services 300 --rates 10 100 --duration 3
    sudo .venv/bin/python -m bench.churn --ipv6 --services 100000 --endpoints 10 \
        --pacing new --phases isolated burst                            # IPv6 cluster
    sudo .venv/bin/python -m bench.churn --services 1000 --pacing new --phases isolated \
        --restart                                       # changes while a restart completes

The simulator (`python -m proxy.sim`) serves N services of one TCP port with one
EndpointSlice of `--endpoints` ready endpoints each; the real agent runs in nftables
mode (`-v 2`, so it logs every sync), both in a lab node namespace made for the run and
removed after it (also on failure or SIGTERM). Once per `--pacing`, with a fresh
simulator and agent: "old" passes `--min-sync-period 1s` (the fixed-rate runner,
upstream's default), "new" passes no pacing flag at all, so it measures the agent's
default, whatever it is when the bench runs. Both get the same changes (one seed).

The cluster is IPv4 (pods in 198.19.0.0/16 and 198.18.4-127.x, at most 48,640
endpoints counting the burst's, so half the pool stays free for the writes to cycle),
or with `--ipv6` single-stack IPv6 as `bench.agent_start --ipv6` makes it: ClusterIPs
from fd00:198:18::/104, pods from fd00:19::/64 (the agent's --cluster-cidr), a fresh
address for every write, never reused, so any size fits.

With `--restart`, the agent is stopped once synced (its tables left, as in a rollout)
and another started over them; the phases begin at that one's first sync, while it
still makes the kept ports' state a part at a time (nftables/restart_steps.py), and the
report says when that was done.

Phases, each after `gap` quiet seconds (the first, after a restart, at once), over
one kept-alive connection to the API:

- isolated: `--isolated` changes, each one written once the previous one is in the
  kernel and `--spacing` seconds have passed (a user's single change);
- random: at each of `--rates` writes a second for `--duration` seconds, a random
  endpoint of a random service replaced by a fresh address (a pod rescheduled), one
  slice PUT per change (a late write goes at once: the rate actually sent is reported);
- burst: `--burst` services created at once, each service then its slice, as fast as the
  connection goes: when each service's endpoints were all in, and when all were.

Every write brings addresses no pending write shares; nf_tables announces each rule and
set element a transaction adds, carrying the address (a DNAT, a map element), to any
listener in the namespace: the lag of a change is from its write sent to the
announcement carrying its new address(es), 4 or 16 bytes, read here
(bench/churn/kernel.py). No polling and no reading the ruleset back, so 1,000 writes a
second over 10,000 services cost the bench little; a listener does make the kernel
write the announcements in the agent's committing thread, as in bench/rolling_update/.
No traffic flows (the rolling update measures that).

Reported per phase: changes (never seen in the kernel within 60 s), lag p50 / p99 /
max, the agent's CPU (its own and its children's, /proc, sampled every 100 ms) as % of
one core over the phase (first write to its last change in the kernel) and its highest
over any 1 s window (the CPU budget), the peak RSS sampled in the phase, its syncs
from its log. Timings are reported, never asserted. Needs root.
"""

from __future__ import annotations

from bench.churn.cli import main
from bench.churn.measure import run
from bench.churn.report import markdown
from bench.churn.workload import Settings

__all__ = ["Settings", "main", "markdown", "run"]
