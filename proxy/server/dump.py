"""The /debug/dump document: what the agent knows and did, for a person or a script.

Pure: built from the model, the rules the data plane reports, and the sync history.
`services` entries are exactly the `python -m proxy explain` shape (proxy/model/view.py,
a stable contract) plus `applied_rules`, so one jq filter works on both outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proxy.model.tracker import ClusterModel
from proxy.model.types import ServicePortKey
from proxy.model.view import node_view, service_port_view


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
) -> dict[str, Any]:
    services = []
    for key in selected_keys(model, service):
        entry = service_port_view(model.state.ports[key])
        entry["applied_rules"] = list(applied.get(key, ())) if applied is not None else None
        services.append(entry)
    skipped = [s.as_dict() for s in model.skipped()
               if service is None or f"{s.namespace}/{s.name}" == service]
    out: dict[str, Any] = {
        "config": dict(config),
        "node": node_view(model.node_view, model.node),
        "health": dict(health),
        "watch": dict(watch),
        "services": services,
        "skipped": skipped,
        "syncs": list(syncs),
    }
    if service is not None:
        out["filter"] = {"service": service}
    if applied_note:
        out["applied_rules_note"] = applied_note
    return out
