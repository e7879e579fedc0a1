"""A person's view of an explain result or a /debug/dump (pure): per service port, its
addresses and policy, then a table of its endpoints with what was chosen and why,
conflicts, and how many rules the node holds for it. JSON (`-o json`) stays the
contract for scripts; this text may change between versions.

    demo/web:http  IPv4 TCP 80  cluster IP 198.18.128.10  node port 30080
      policy  internal Cluster, external Local   topology  none (no topology requested)
      traffic  1204 new connections
      ENDPOINT          STATE        NODE    ZONE    CHOSEN   CONNS  REASON
      198.18.1.11:8080  ready        node-a  zone-a  cluster  602    cluster: ready

CONNS (a dump's `traffic`, where the port is counted per endpoint) is what the kernel
sent each endpoint, beside CHOSEN, what the rules allow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

COLUMNS = ("ENDPOINT", "STATE", "NODE", "ZONE", "CHOSEN", "REASON")


def table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=False))
            + "  " + r[-1] for r in rows]


def _state(ep: Mapping[str, Any]) -> str:
    if ep.get("terminating"):
        return "terminating" + (", serving" if ep.get("serving") else "")
    if ep.get("ready"):
        return "ready"
    return "serving" if ep.get("serving") else "not ready"


def _addresses(sp: Mapping[str, Any]) -> str:
    parts = []
    for key, label in (("cluster_ips", "cluster IP"), ("external_ips", "external IP"),
                       ("load_balancer_ips", "LB IP")):
        ips = sp.get(key) or []
        if ips:
            parts.append(f"{label}{'s' if len(ips) > 1 else ''} {', '.join(ips)}")
    if sp.get("node_port"):
        parts.append(f"node port {sp['node_port']}")
    return "  ".join(parts) or "no address"


def service_port(sp: Mapping[str, Any]) -> list[str]:
    name = f"{sp['service']}:{sp['port']}" if sp.get("port") else sp["service"]
    head = (f"{name}  {sp.get('family', '')} {sp.get('protocol', '')} "
            f"{sp.get('port_number', '')}  {_addresses(sp)}")
    policies = sp.get("policies") or {}
    topo = sp.get("topology") or {}
    line = (f"  policy  internal {policies.get('internal', '?')}, external "
            f"{policies.get('external', '?')}")
    if sp.get("session_affinity_seconds"):
        line += f", ClientIP affinity {sp['session_affinity_seconds']}s"
    if sp.get("balancing") not in (None, "random"):
        line += f", {sp['balancing']} balancing"
    line += f"   topology  {topo.get('mode', '?')} ({topo.get('reason', '')})"
    out = [head, line]
    traffic = sp.get("traffic")
    counted = traffic.get("endpoints") if isinstance(traffic, Mapping) else None
    if isinstance(traffic, Mapping):
        out.append(f"  traffic  {_traffic(traffic)}")
    endpoints = sp.get("endpoints") or []
    if endpoints:
        rows = [COLUMNS if counted is None else (*COLUMNS[:-1], "CONNS", COLUMNS[-1])]
        for ep in endpoints:
            chosen = ",".join(ep.get("selected_for") or []) or "-"
            row = [ep["endpoint"] + (" (conflict)" if ep.get("conflict") else ""),
                   _state(ep), ep.get("node") or "-", ep.get("zone") or "-", chosen]
            if counted is not None:
                row.append(str((counted.get(ep["endpoint"]) or {}).get("connections", 0)))
            rows.append((*row, ep.get("reason") or ""))
        out += table(rows)
    else:
        out.append("  no endpoints")
    for conflict in sp.get("conflicts") or []:
        out.append(f"  conflict  {_flat(conflict)}")
    rules = sp.get("applied_rules")
    if rules is not None:
        out.append(f"  rules  {len(rules)} in the kernel for this port"
                   " (-o json lists them)")
    return out


def _traffic(traffic: Mapping[str, Any]) -> str:
    text = f"{traffic.get('connections', 0)} new connections"
    if traffic.get("packets") is not None:
        text += f", {traffic['packets']} packets, {traffic.get('bytes', 0)} bytes"
    if traffic.get("endpoints") is None:
        text += " (counted per port: sliceproxy.io/traffic-per-endpoint for each endpoint's)"
    return text


def _flat(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {_flat(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_flat(v) for v in value)
    return str(value)


def render(doc: Mapping[str, Any]) -> str:
    """The text for an explain result or a /debug/dump."""
    out: list[str] = []
    node = doc.get("node") or {}
    zone = f" (zone {node['zone']})" if node.get("zone") else ""
    out.append(f"node {node.get('name', '?')}{zone}")
    if node.get("primary_ips"):
        out.append("  primary IPs  " + ", ".join(node["primary_ips"]))
    nodeports = node.get("nodeports")
    if isinstance(nodeports, Mapping):
        out.append("  NodePorts  " + "; ".join(
            f"{family} {_flat(nodeports[family])}" for family in ("IPv4", "IPv6")
            if family in nodeports) + f"  (--nodeport-addresses "
            f"{','.join(nodeports.get('nodeport_addresses') or []) or 'unset'})")
    health = doc.get("health")
    if isinstance(health, Mapping) and health:
        out.append("health  " + ", ".join(f"{k} {v}" for k, v in health.items()
                                          if not isinstance(v, (Mapping, list))))
    services = doc.get("services") or []
    if not services:
        out += ["", "no service ports" + (f" for {doc['filter']['service']}"
                                          if doc.get("filter") else "")]
    for sp in services:
        out.append("")
        out += service_port(sp)
    skipped = doc.get("skipped") or []
    if skipped:
        out += ["", f"skipped  {len(skipped)}"]
        rows = [("KIND", "OBJECT", "REASON", "DETAIL")]
        rows += [(s.get("kind", ""), f"{s.get('namespace', '')}/{s.get('name', '')}"
                  + (f" {s['part']}" if s.get("part") else ""), s.get("reason", ""),
                  s.get("detail", "")) for s in skipped]
        out += table(rows)
    note = doc.get("applied_rules_note")
    if note:
        out += ["", f"note  {note}"]
    return "\n".join(out) + "\n"
