"""What N agents' watch layers cost one API server ("many nodes, one API server").

    sudo .venv/bin/python -m bench.reflector_fleet --server real --agents 100 500 1000 \
        --first-list cache consistent --json out.json
    sudo .venv/bin/python -m bench.reflector_fleet --server sim --agents 100
    sudo .venv/bin/python -m bench.reflector_fleet            # --size small: CI-sized

Each agent is what one node runs of sliceproxy's watch layer: `proxy/kube/cluster_watch.py`'s
ClusterWatch (Services; EndpointSlices without headless ones; its own Node by field
selector), with its own client (`KubeApi`: its own aiohttp session, TLS handshakes and
connections) and a handler that only counts events. The agents run in worker processes
(`--workers`, an asyncio loop each); against the real server they run in a network
namespace of their own, linked to the control plane's over a veth (the control plane of
labs/realcp: kube-apiserver and etcd v1.20.2); against the simulator (`python -m
proxy.sim`, its own process) on the host's loopback.

The cluster is preloaded: `--services` Services (no selector: no controller touches
them) with one EndpointSlice each of `--endpoints` ready endpoints (written by this
bench under a manager of its own, so the real EndpointSlice controller leaves them
alone), and one Node per agent. For each (first-list mode, N):

1. the API server is restarted (a fresh watch cache and a fresh baseline; etcd keeps
   its data), the workers are started and make their clients;
2. *start*: every agent is started at the same moment; until every agent's three
   reflectors have listed (time to all synced);
3. *churn*: `--changes` EndpointSlice writes (one endpoint's readiness flipped) at
   `--rate` per second; until every agent has received every change.

Measured per phase, from /proc: the API server's and etcd's CPU seconds and RSS (sampled
every 0.2 s: the peak; VmHWM too), the workers' CPU; from the clients: the bytes of
response bodies each agent read (lists and watch streams, after TLS and chunked
decoding; a wrapper around the `Api` object), events received. A measurement, never a
pass/fail on time; `run()` is the core; tests/realcp/test_bench_main_realcp.py (through
`python -m bench --size small`) and tests/integration/test_fleet_bench_sim.py run it tiny.
"""

from __future__ import annotations

from bench.reflector_fleet.cli import main, run_cli, settings_for
from bench.reflector_fleet.measure import run
from bench.reflector_fleet.report import markdown
from bench.reflector_fleet.servers import delete_objects, preload, real_target
from bench.reflector_fleet.workload import Settings

__all__ = ["Settings", "delete_objects", "main", "markdown", "preload", "real_target", "run",
           "run_cli", "settings_for"]
