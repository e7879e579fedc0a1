"""Programming latency on a real API server: sliceproxy (iptables and nftables modes) vs
upstream kube-proxy v1.20.2.

    sudo .venv/bin/python -m bench.realcp_latency --services 1000 --changes 20 --json out.json

Starts the real-control-plane tier's kube-apiserver and kube-controller-manager v1.20.2
(built from Debian's source, labs/realcp/build.py), creates N Services each selecting
its own Pods (made ready by patching their status; no kubelet; the Pods' IPs need not
answer, nothing sends traffic), lets the real EndpointSlice and Endpoints controllers
write their objects, then starts sliceproxy in iptables mode, sliceproxy in nftables
mode and kube-proxy v1.20.2 in iptables mode, all reading EndpointSlices
(discovery.k8s.io/v1beta1), each in a lab node namespace of its own, all as node
"node-a", one after the other so that their initial syncs do not compete.

Then, K times: one Pod's readiness is flipped (not ready, then ready again, on distinct
services) by a PATCH of its status, and for each proxy the time from the moment that
PATCH was sent (over a kept-alive connection: no handshake in the timing) to the moment
the service chain's jump to that Pod's endpoint chain (whose rule DNATs to the Pod)
disappears (or appears) in that proxy's nat table. Each proxy's node namespace is
polled every `--poll-interval` with `iptables-nft -t nat -S <service chain>` (~2 ms per
poll at 1,000 services on an idle machine, more while a big restore holds the table;
`iptables-legacy-save` if that proxy's rules are in the legacy tables). The true moment
lies between the start of the last poll that did not see the change and the end of the
first that did (in nftables mode: `nft list chain` of the service port's chain, whose
rules DNAT to the Pods themselves, ~6 ms at 10,000 services): the latency reported is
the later bound, the gap is its resolution. Where the rules are in nf_tables, the
change is also dated by nf_tables' own announcement of the transaction that made it
(heard on netlink in the node's namespace; the first commit between the last poll not
showing the change and the first showing it): "commit announced", free of the polls'
resolution. A watch on the namespace's EndpointSlices,
from this process, splits that time into the controller's part (the write -> the
updated slice reaches a watcher) and the proxy's. The proxies run with their defaults
(kube-proxy: min sync period 1 s, burst 2); `--pacing old new` runs each sliceproxy side
twice, "NAME/old" with `--min-sync-period 1s` (the fixed-rate runner) and "NAME/new" with
no pacing flag (the agent's default pacing, issue 29);
changes are spaced `--spacing` seconds apart so that each is the first after a quiet
period. Also reported: each proxy's own histograms over the changes
(kubeproxy_network_programming_duration_seconds and
kubeproxy_sync_proxy_rules_duration_seconds; the two proxies define the first
differently, see bench/RESULTS.md), the sync durations each logged, the time and CPU
of each one's initial sync of everything, and RSS.

A measurement, never a pass/fail on time. `run()` is the core; tests/realcp/
test_latency_bench.py calls it at a tiny size on the tier's session control plane.
"""

from __future__ import annotations

from bench.realcp_latency.cli import main
from bench.realcp_latency.report import markdown
from bench.realcp_latency.run import run
from bench.realcp_latency.settings import PROXIES, Settings

__all__ = ["PROXIES", "Settings", "main", "markdown", "run"]
