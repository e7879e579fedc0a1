"""The benchmarks, one scenario a module or a package; each runs alone with
`python -m bench.<name> --help`, and `python -m bench` runs the scale scenarios together
into bench/RESULTS.md. Nothing is asserted on time.

Scale scenarios (`python -m bench --only NAME`):
  realcp_latency/   cold-start: the real API server, sliceproxy beside kube-proxy
  agent_start.py    agent-start: the agent alone on the simulator
  huge_service.py   huge-service: one service, many endpoints
  reflector_fleet/  fleet: many agents' watch layers on one API server
  rolling_update/   rolling-update: every endpoint replaced, with traffic

The data planes and the model:
  model_bench.py    decoding and resolving N services, one endpoint change
  rule_sync.py      each rule-based applier's sync (iptables back ends, nftables mode)
  nftables/         appliers: ways to program nf_tables; conn_cost: the shards' price
  ipvs/             pyroute2 against our netlink client and IpvsDataPlane, in the
                    kernel lab (its guest side runs inside the QEMU guest)

common.py: what they share (/proc figures, the simulator, the synthetic cluster of N
services, timing, a lab node, printing results).
"""
