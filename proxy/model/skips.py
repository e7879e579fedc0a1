"""Machine-readable records of input that was skipped, and why.

Bad input never crashes the agent and never reaches the kernel: the decoder drops the
object (or just the bad endpoint/port) and says so with one of these. The same records
show up in `explain`'s "skipped" list, the debug dump and the skipped-objects metric.
"""

from __future__ import annotations

from dataclasses import dataclass

# Reason codes: stable strings, part of the explain/debug-dump contract (docs/explain.md lists
# them). Add freely; never rename or remove one.
MALFORMED = "malformed"  # not an object, or a field of the wrong type
MISSING_FIELD = "missing-field"
INVALID_NAME = "invalid-name"  # a name the API would refuse (length, characters)
INVALID_IP = "invalid-ip"  # not an address; zone-scoped; IPv4-mapped IPv6; wrong family
SPECIAL_IP = "special-ip"  # unspecified, loopback, link-local, multicast or broadcast
# An IPv4 address with leading zeros ("198.018.000.001"): used, read as decimal (as
# kube-proxy and the API server read it) and written in canonical form; recorded so the
# object gets fixed before the API server stops accepting that spelling.
NON_CANONICAL_IP = "non-canonical-ip"
INVALID_CIDR = "invalid-cidr"
INVALID_PORT = "invalid-port"
DUPLICATE_PORT = "duplicate-port"  # a second port with the same name or number
INVALID_VALUE = "invalid-value"
UNKNOWN_PROTOCOL = "unknown-protocol"
UNKNOWN_ADDRESS_TYPE = "unknown-address-type"
UNSUPPORTED_ADDRESS_TYPE = "unsupported-address-type"  # FQDN slices
MISSING_SERVICE_NAME = "missing-service-name-label"
TOO_LARGE = "too-large"  # beyond a size limit the API server enforces
UNKNOWN_KIND = "unknown-kind"
# A destination another service also claims (IP, port and protocol in any role, or a
# NodePort): the service whose namespace/name sorts first keeps it. Validation and the
# allocators make this impossible through a real API server.
CONFLICT = "conflict"
# Well-formed objects that are not ours to proxy.
HEADLESS = "headless"
EXTERNAL_NAME = "external-name"
OTHER_PROXY = "other-proxy"
NO_CLUSTER_IP = "no-cluster-ip"

# How much of an offending value a record quotes: records are kept, dumped and logged,
# so a megabyte of hostile text must not ride along with them.
QUOTE_CHARS = 80
NAME_CHARS = 253  # the longest name the API allows (a DNS subdomain)


def shown(value: object, limit: int = QUOTE_CHARS) -> str:
    """`repr(value)`, cut to about `limit` characters (containers by type and size)."""
    if isinstance(value, dict | list | tuple):
        return f"<{type(value).__name__} of {len(value)}>"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def clip(text: str, limit: int = NAME_CHARS) -> str:
    """A name for a record: as given when it fits, else cut (marked, with its length)."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


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
