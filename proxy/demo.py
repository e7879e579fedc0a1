"""`./run demo`: what sliceproxy decides for the example cluster in `examples/`.

Today the demo shows the model's decisions (the same JSON as `python -m proxy explain`,
summarised for a person). The agent proxying real traffic in a network namespace joins
it when the sync loop lands (see the README's status section).
"""

from __future__ import annotations

import sys
from pathlib import Path

from proxy.explain import explain
from proxy.kube.ingest import EndpointsSource
from proxy.manifests import load_paths

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def main() -> int:
    objects = load_paths([EXAMPLES])
    result = explain(objects, node_name="node-a", node_labels={},
                     source=EndpointsSource.ENDPOINT_SLICES)
    node = result["node"]
    print(f"node {node['name']} (zone {node['zone']}): "
          f"{len(result['services'])} service ports from {len(objects)} objects in examples/\n")
    for svc in result["services"]:
        port = f":{svc['port']}" if svc["port"] else ""
        vips = ", ".join(svc["cluster_ips"])
        print(f"{svc['service']}{port} {svc['protocol']} -> {vips}:{svc['port_number']}")
        if svc["policies"]["uses_cluster_set"]:
            print(f"    cluster set: {', '.join(svc['cluster_endpoints']) or '(none: REJECT)'}")
        if svc["policies"]["uses_local_set"]:
            print(f"    local set:   {', '.join(svc['local_endpoints']) or '(none: DROP)'}")
        topo = svc["topology"]
        if topo["requested"] != "none":
            print(f"    topology:    {topo['mode']} ({topo['reason']})")
        for c in svc["conflicts"]:
            print(f"    conflict:    {c['endpoint']} differs on {', '.join(c['fields'])} "
                  f"in {', '.join(c['slices'])}; kept the copy from {c['chosen']}")
        for e in svc["endpoints"]:
            mark = "*" if e["selected_for"] else " "
            print(f"      {mark} {e['endpoint']:<18} {e['reason']}")
        print()
    print("Full detail: .venv/bin/python -m proxy explain examples/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
