"""`python -m proxy explain`: what sliceproxy would do with these objects, and why.

Reads Services, EndpointSlices (or Endpoints), and Nodes from files or stdin, exactly as
`kubectl get svc,endpointslices,nodes -A -o yaml` prints them, runs them through the same
decode -> model -> selection path as the agent, and prints the node, every service port
in the debug dump's shape, and everything that was skipped with its reason: a table on a
terminal (termview.py), JSON otherwise or with `-o json` (the stable contract).

`python -m proxy dump [ADDRESS]` asks a running agent instead: its /debug/dump, shown
the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from proxy.kube.ingest import EndpointsSource, apply_object
from proxy.kube.manifests import ManifestError, load_paths, parse_documents
from proxy.model import nodeport_addresses
from proxy.model.tracker import ClusterModel
from proxy.model.types import Balancing, IPNetwork, Node
from proxy.model.view import node_view, service_port_view


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proxy explain",
        description="Explain which endpoints each service port gets on a node, and why.",
    )
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="YAML/JSON manifests or directories ('-' or none: stdin)")
    p.add_argument("-f", "--filename", action="append", default=[], metavar="FILE",
                   help="same as FILE; may be repeated")
    p.add_argument("--node", help="this node's name (default: the only Node in the input)")
    p.add_argument("--node-labels", default="", metavar="K=V,...",
                   help="labels for the node, e.g. topology.kubernetes.io/zone=a "
                        "(added to, and overriding, those of a Node object in the input)")
    p.add_argument("--endpoints-source", choices=[s.value for s in EndpointsSource],
                   default=EndpointsSource.ENDPOINT_SLICES.value,
                   help="read EndpointSlices (default) or legacy Endpoints")
    p.add_argument("--service-proxy-name", default="",
                   help="treat services labelled with this service-proxy-name as ours")
    p.add_argument("--default-balancing", choices=[b.value for b in Balancing],
                   default=Balancing.RANDOM.value,
                   help="the agent's --default-balancing: for services without the "
                        "sliceproxy.io/balancing annotation (default random)")
    p.add_argument("--service", metavar="NAMESPACE/NAME",
                   help="only show this service")
    p.add_argument("--nodeport-addresses", metavar="CIDR|primary[,...]",
                   help="the agent's --nodeport-addresses: show where NodePorts listen "
                        "(the node's primary IPs come from its Node object)")
    add_output(p)
    return p


def add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("table", "json"),
                   help="table (default on a terminal) or json (default otherwise: the "
                        "stable shape scripts read)")


def write(doc: dict[str, Any], output: str | None) -> None:
    """`doc` as JSON, or as the table a person reads (the default on a terminal)."""
    if (output or ("table" if sys.stdout.isatty() else "json")) == "table":
        from proxy.cmd.termview import render

        sys.stdout.write(render(doc))
        return
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _labels(raw: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--node-labels: {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def _nodeports(raw: str | None) -> tuple[tuple[IPNetwork, ...], bool] | None:
    if raw is None:
        return None
    try:
        return nodeport_addresses.parse(raw.split(","))
    except ValueError as exc:
        raise ValueError(f"--nodeport-addresses: {exc}") from None


def _read(paths: list[str], stdin: str | None = None) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    files = [p for p in paths if p != "-"]
    if not paths or "-" in paths:
        text = sys.stdin.read() if stdin is None else stdin
        objects.extend(parse_documents(text, "<stdin>"))
    objects.extend(load_paths(files))
    return objects


def explain(
    objects: list[dict[str, Any]],
    *,
    node_name: str,
    node_labels: dict[str, str],
    source: EndpointsSource,
    proxy_name: str = "",
    service: str | None = None,
    nodeports: tuple[tuple[IPNetwork, ...], bool] | None = None,
    balancing: Balancing = Balancing.RANDOM,
) -> dict[str, Any]:
    """`nodeports`: --nodeport-addresses (CIDRs, `primary`), to show where NodePorts
    listen; `balancing`: --default-balancing."""
    model = ClusterModel(node_name, proxy_name, balancing)
    node_seen = False
    for obj in objects:
        apply_object(model, obj, source)
        if obj.get("kind") == "Node" and (obj.get("metadata") or {}).get("name") == node_name:
            node_seen = True
    if node_labels or not node_seen:
        base = dict(model.node.labels) if model.node is not None else {}
        base.update(node_labels)
        model.set_node(replace(model.node or Node(node_name),
                               labels=tuple(sorted(base.items()))))
    state = model.resolve(full=True)
    ports = sorted(state, key=lambda r: (r.key.service, r.key.port, r.key.family))
    return {
        "node": node_view(model.node_view, model.node, nodeports),
        "services": [service_port_view(r) for r in ports
                     if service is None or r.key.service == service],
        "skipped": [s.as_dict() for s in model.skipped()
                    if service is None or f"{s.namespace}/{s.name}" == service
                    or s.kind == "Node"],
    }


def main(argv: list[str], stdin: str | None = None, prog: str | None = None) -> int:
    """`stdin`: the input to read instead of the process's stdin (the kubectl plugin
    passes what `kubectl get` printed)."""
    parser = build_parser()
    if prog:
        parser.prog = prog
    args = parser.parse_args(argv)
    try:
        labels = _labels(args.node_labels)
        nodeports = _nodeports(args.nodeport_addresses)
        objects = _read(list(args.files) + list(args.filename), stdin)
    except (ManifestError, ValueError) as exc:
        print(f"explain: {exc}", file=sys.stderr)
        return 2
    node = args.node
    if not node:
        names = [str((o.get("metadata") or {}).get("name")) for o in objects
                 if o.get("kind") == "Node"]
        if len(names) != 1:
            found = f"found {len(names)} Node objects" if names else "found no Node object"
            print(f"explain: --node is required ({found} in the input)", file=sys.stderr)
            return 2
        node = names[0]
    result = explain(objects, node_name=node, node_labels=labels,
                     source=EndpointsSource(args.endpoints_source),
                     proxy_name=args.service_proxy_name, service=args.service,
                     nodeports=nodeports, balancing=Balancing(args.default_balancing))
    write(result, args.output)
    return 0
