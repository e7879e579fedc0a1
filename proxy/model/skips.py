"""Machine-readable records of input that was skipped, and why.

Bad input never crashes the agent and never reaches the kernel: the decoder drops the
object (or just the bad endpoint/port) and says so with one of these. The same records
show up in `explain`'s "skipped" list, the debug dump and the skipped-objects metric.
"""

from __future__ import annotations

from dataclasses import dataclass

# Reason codes: stable strings, part of the explain/debug-dump contract.
MALFORMED = "malformed"  # not an object, or a field of the wrong type
MISSING_FIELD = "missing-field"
INVALID_IP = "invalid-ip"
INVALID_CIDR = "invalid-cidr"
INVALID_PORT = "invalid-port"
INVALID_VALUE = "invalid-value"
UNKNOWN_PROTOCOL = "unknown-protocol"
UNKNOWN_ADDRESS_TYPE = "unknown-address-type"
UNSUPPORTED_ADDRESS_TYPE = "unsupported-address-type"  # FQDN slices
MISSING_SERVICE_NAME = "missing-service-name-label"
UNKNOWN_KIND = "unknown-kind"
# Well-formed objects that are not ours to proxy.
HEADLESS = "headless"
EXTERNAL_NAME = "external-name"
OTHER_PROXY = "other-proxy"
NO_CLUSTER_IP = "no-cluster-ip"


@dataclass(frozen=True, slots=True)
class Skip:
    kind: str
    namespace: str
    name: str
    reason: str
    detail: str
    part: str = ""  # e.g. "endpoints[2]"; "" when the whole object was skipped

    def as_dict(self) -> dict[str, str]:
        out = {
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
            "reason": self.reason,
            "detail": self.detail,
        }
        if self.part:
            out["part"] = self.part
        return out

    def __str__(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        part = f" {self.part}" if self.part else ""
        return f"{self.kind} {where}{part}: {self.reason}: {self.detail}"
