"""The /debug/dump document: what the agent knows and did, for a person or a script.

Pure: built from the model, the rules the data plane reports, and the sync history.
`services` entries are exactly the `python -m proxy explain` shape (proxy/model/view.py,
a stable contract) plus `applied_rules`, so one jq filter works on both outputs.

Skipped input is bounded whatever a hostile API server sends: `skipped` lists the kept
records (at most ten per object, see the model) up to `SKIPPED_SHOWN`, in explain's
order; `skipped_summary` counts everything skipped, by reason and kind, and lists the
most recent records first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proxy.dataplane.base import PortTraffic
from proxy.model.tracker import ClusterModel
from proxy.model.types import IPNetwork, ServicePortKey
from proxy.model.view import node_view, service_port_view
from proxy.server.traffic import traffic_view

SKIPPED_SHOWN = 500  # records in `skipped`
SKIPPED_RECENT = 20  # records in `skipped_summary.recent`


def port_order(key: ServicePortKey) -> tuple[str, str, str, int]:
    return (key.namespace, key.name, key.port, int(key.family))


def selected_keys(model: ClusterModel, service: str | None) -> list[ServicePortKey]:
    keys = (k for k in model.state.ports if service is None or k.service == service)
    return sorted(keys, key=port_order)


def build_dump(
    *,
    config: Mapping[str, Any],
    model: ClusterModel,
    applied: Mapping[ServicePortKey, Sequence[str]] | None,
    applied_note: str | None,
    syncs: Iterable[Mapping[str, Any]],
    health: Mapping[str, Any],
    watch: Mapping[str, Any],
    service: str | None = None,
    pacing: Mapping[str, Any] | None = None,
    nodeports: tuple[tuple[IPNetwork, ...], bool] | None = None,
    traffic: Mapping[ServicePortKey, PortTraffic] | None = None,
) -> dict[str, Any]:
    """`nodeports`: --nodeport-addresses (CIDRs, `primary`), for the node's `nodeports`;
    `traffic`: the kernel's counts by port (server/traffic.py), null where not read."""
    services = []
    for key in selected_keys(model, service):
        entry = service_port_view(model.state.ports[key])
        entry["applied_rules"] = list(applied.get(key, ())) if applied is not None else None
        entry["traffic"] = traffic_view((traffic or {}).get(key))
        services.append(entry)
    records = [s for s in model.skipped()
               if service is None or f"{s.namespace}/{s.name}" == service]
    out: dict[str, Any] = {
        "config": dict(config),
        "node": node_view(model.node_view, model.node, nodeports),
        "health": dict(health),
        "watch": dict(watch),
        "services": services,
        "skipped": [s.as_dict() for s in records[:SKIPPED_SHOWN]],
        "skipped_summary": skipped_summary(model, len(records)),
        "syncs": list(syncs),
    }
    if pacing is not None:  # when syncs run, and what holds them back (agent/schedule.py)
        out["pacing"] = dict(pacing)
    if service is not None:
        out["filter"] = {"service": service}
    if applied_note:
        out["applied_rules_note"] = applied_note
    return out


def skipped_summary(model: ClusterModel, listed: int) -> dict[str, Any]:
    """Counts of everything skipped now, and the newest records; `listed` is how many
    records `skipped` would hold unbounded (it shows at most SKIPPED_SHOWN)."""
    counts = model.skip_counts()
    by_reason: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, reason), n in sorted(counts.items()):
        by_reason[reason] = by_reason.get(reason, 0) + n
        by_kind.setdefault(kind, {})[reason] = n
    return {
        "total": sum(counts.values()),
        "objects": model.skip_objects(),
        "by_reason": by_reason,
        "by_kind": by_kind,
        "records_shown": min(listed, SKIPPED_SHOWN),
        "records_omitted": max(0, listed - SKIPPED_SHOWN),
        "recent": [s.as_dict() for s in model.recent_skips(SKIPPED_RECENT)],
    }
