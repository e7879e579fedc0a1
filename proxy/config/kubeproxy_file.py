"""kube-proxy's own configuration file (`KubeProxyConfiguration`, kubeproxy.config.k8s.io/
v1alpha1, as `kube-proxy --write-config-to` and kubeadm write it) read as sliceproxy's
settings, so `--config` can point at the file kubeadm mounts from the kube-system/
kube-proxy ConfigMap (or at that ConfigMap itself, as `kubectl get -o yaml` prints it).

v1alpha1 is the only version kube-proxy has released (v1.20 to v1.35; a v1alpha2 was
proposed and never merged): another apiVersion is refused. Every field of it (staging/
src/k8s.io/kube-proxy/config/v1alpha1/types.go) is one of these kinds, and none is
dropped without a word (docs/flags.md has the table):

- honoured: it means what it means to kube-proxy: mode, clusterCIDR, hostnameOverride,
  clientConnection.kubeconfig, bindAddress (as upstream's defaulting reads it: the
  servers' addresses when healthzBindAddress/metricsBindAddress are empty, an IPv6
  bindAddress making them [::]:10256 and [::1]:10249), healthzBindAddress and
  metricsBindAddress (a bare IP takes the port), nodePortAddresses, the mode's section's
  syncPeriod, minSyncPeriod and masqueradeAll (the IPVS mode reads the iptables
  section), ipvs.scheduler, ipvs.strictARP (the `--init-only` step's ARP sysctls),
  logging.verbosity and logging.format, conntrack.* (null
  is kube-proxy's default; the `--init-only` step writes them); and the values that
  ask for what sliceproxy does: detectLocalMode ClusterCIDR, masqueradeBit 14;
- not implemented, harmless to which packets go where: named with its value in one
  warning at start (`ignored`), unless it is upstream's zero or asks for what sliceproxy
  does anyway: featureGates, enableProfiling, showHiddenMetricsForVersion, oomScoreAdj,
  configSyncPeriod, clientConnection's rate limits and content types, logging's other
  fields, bindAddressHardFail (sliceproxy always stops when it cannot listen: true is
  what it does), a specific bindAddress's other meaning (kube-proxy's primary node IP,
  for its loadBalancerSourceRanges check; refused where it would move NodePorts, below),
  in IPVS mode the IPVS timeouts (the kernel's stay), in iptables mode
  iptables.localhostNodePorts (never served, on purpose: docs/upstream-differences.md
  K4);
- not implemented, and it would change where packets go: refused, naming the field:
  detectLocalMode other than ClusterCIDR (sliceproxy tells pod traffic by clusterCIDR
  alone, so masquerading and the short-circuits to the cluster set would differ); the
  mode's masqueradeBit other than 14 (sliceproxy marks with 0x4000, so packets another
  component marks with that bit would be masqueraded); a bindAddress other than 0.0.0.0
  or :: where NodePorts open on the primary IPs (nodePortAddresses `primary`, or unset in
  nftables mode), which kube-proxy takes from bindAddress and sliceproxy from the Node;
- another platform's or mode's, which kube-proxy ignores here too, silently: winkernel,
  windowsRunAsService, the userspace proxy's portRange and udpIdleTimeout, the fields of
  a mode not in use (ipvs.* outside IPVS mode, the other section's masqueradeBit,
  localhostNodePorts outside iptables mode), detectLocal.* (read only by the
  detectLocalMode values refused above), and ipvs.excludeCIDRs (it keeps kube-proxy's
  clean-up off other virtual servers; sliceproxy deletes only those it made);
- unknown to every release (a misspelling, a field of a later release, the `linux` or
  `windows` sections of kube-proxy's internal configuration): skipped and named in the
  same warning (`unknown`), as kube-proxy's own lenient decoding skips it with a log
  line, so the first kube-proxy release that adds a field does not stop the agents.

A value sliceproxy cannot honour safely (above, or a proxy mode it lacks) or a malformed
one stops the agent, naming the field (options.ConfigError, raised by the caller with the
file's name).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from proxy.dataplane import modes

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
CONFIGMAP_KEY = "config.conf"  # where kubeadm's kube-proxy ConfigMap holds the file

MASQUERADE_BIT = 14  # the bit sliceproxy always uses (0x4000), upstream's default


class KubeProxyConfigError(ValueError):
    """A field that stops the agent: the message starts with the field's path."""


def _zero(value: Any) -> bool:
    """Upstream's "not set": null, false, 0, "", "0s", an empty list or map."""
    return value in (None, False, 0, "", "0s", "0") or value in ([], {})


def _duration(value: Any) -> str | None:
    return None if _zero(value) else str(value)


# Fields sliceproxy does not implement -> the values that need no warning (besides
# upstream's zero): those that ask for what sliceproxy does anyway.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "bindAddressHardFail": (True,),
    "enableProfiling": (),
    "oomScoreAdj": (),
    "configSyncPeriod": (),
    "showHiddenMetricsForVersion": (),
    "featureGates": (),
    "clientConnection.acceptContentTypes": (),
    "clientConnection.contentType": (),
    "clientConnection.qps": (),
    "clientConnection.burst": (),
    "iptables.localhostNodePorts": (),
    "ipvs.tcpTimeout": (),
    "ipvs.tcpFinTimeout": (),
    "ipvs.udpTimeout": (),
    "logging.flushFrequency": (),
    "logging.vmodule": (),
    "logging.options": (),
}
# The modes in which kube-proxy reads these of NOT_IMPLEMENTED; in the others they are
# another mode's, which kube-proxy ignores too (and so does sliceproxy, silently).
READ_IN_MODES: dict[str, tuple[str, ...]] = {
    "iptables.localhostNodePorts": ("iptables",),
    "ipvs.tcpTimeout": ("ipvs",), "ipvs.tcpFinTimeout": ("ipvs",),
    "ipvs.udpTimeout": ("ipvs",),
}
# Another platform's or mode's: ignored by kube-proxy itself on Linux in these modes;
# detectLocal.* is read only with a detectLocalMode sliceproxy refuses; excludeCIDRs
# guards virtual servers sliceproxy never touches.
OTHER_PLATFORM = ("winkernel", "windowsRunAsService", "portRange", "udpIdleTimeout",
                  "detectLocal.bridgeInterface", "detectLocal.interfaceNamePrefix",
                  "ipvs.excludeCIDRs")
# Checked, and refused unless they ask for what sliceproxy does (translate()).
GUARDED = ("detectLocalMode", "iptables.masqueradeBit", "nftables.masqueradeBit")
DETECT_LOCAL_MODES = ("", "ClusterCIDR")  # "" is upstream's default, ClusterCIDR

# The fields this module reads, by section.
HONOURED = {"apiVersion", "kind", "mode", "clusterCIDR", "hostnameOverride",
            "bindAddress", "healthzBindAddress", "metricsBindAddress", "nodePortAddresses",
            "clientConnection.kubeconfig",
            "iptables.masqueradeAll", "iptables.syncPeriod", "iptables.minSyncPeriod",
            "ipvs.scheduler", "ipvs.strictARP", "ipvs.syncPeriod", "ipvs.minSyncPeriod",
            "nftables.masqueradeAll", "nftables.syncPeriod", "nftables.minSyncPeriod",
            "logging.verbosity", "logging.format"}
# The conntrack fields -> sliceproxy's settings of the same meaning (its --init-only
# step writes them). Taken as given unless null: null means kube-proxy's default, while
# 0 means "leave the kernel's value" (upstream's defaulting fills only nil pointers).
CONNTRACK = {"conntrack.maxPerCore": "conntrack_max_per_core",
             "conntrack.min": "conntrack_min",
             "conntrack.tcpEstablishedTimeout": "conntrack_tcp_timeout_established",
             "conntrack.tcpCloseWaitTimeout": "conntrack_tcp_timeout_close_wait",
             "conntrack.tcpBeLiberal": "conntrack_tcp_be_liberal",
             "conntrack.udpTimeout": "conntrack_udp_timeout",
             "conntrack.udpStreamTimeout": "conntrack_udp_timeout_stream"}
HONOURED |= set(CONNTRACK)
# Every field of v1alpha1 in some release (v1.20 to v1.35); the rest are unknown.
KNOWN = HONOURED | set(NOT_IMPLEMENTED) | set(OTHER_PLATFORM) | set(GUARDED)
# The servers' ports (upstream's pkg/cluster/ports), and their addresses when neither
# the file nor bindAddress says: upstream's getDefaultAddresses, by bindAddress family.
HEALTHZ_PORT, METRICS_PORT = 10256, 10249
DEFAULT_ADDRESSES = {4: ("0.0.0.0", "127.0.0.1"), 6: ("[::]", "[::1]")}
SECTIONS = ("clientConnection", "iptables", "ipvs", "nftables", "conntrack", "detectLocal",
            "logging")


def is_kube_proxy_config(doc: Mapping[str, Any]) -> bool:
    return doc.get("kind") == KIND or str(doc.get("apiVersion", "")).startswith(
        "kubeproxy.config.k8s.io/")


def from_configmap(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The KubeProxyConfiguration inside kubeadm's kube-proxy ConfigMap, or None when
    `doc` is no such ConfigMap."""
    if doc.get("kind") != "ConfigMap" or doc.get("apiVersion") != "v1":
        return None
    text = (doc.get("data") or {}).get(CONFIGMAP_KEY)
    if not isinstance(text, str):
        raise KubeProxyConfigError(f"data.{CONFIGMAP_KEY}: this ConfigMap has no kube-proxy "
                                   "configuration (kubeadm keeps it under that key)")
    try:
        inner = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KubeProxyConfigError(f"data.{CONFIGMAP_KEY}: not valid YAML: {exc}") from None
    if not isinstance(inner, dict):
        raise KubeProxyConfigError(f"data.{CONFIGMAP_KEY}: not a KubeProxyConfiguration")
    return inner


def _flatten(doc: Mapping[str, Any]) -> dict[str, Any]:
    """`{"ipvs": {"scheduler": "rr"}}` -> `{"ipvs.scheduler": "rr"}` for the sections;
    other values (featureGates, winkernel) stay whole."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise KubeProxyConfigError(f"{key}: must be a mapping, got {value!r}")
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[str(key)] = value
    return out


def translate(doc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """(settings by sliceproxy's flag names, as config.from_values takes them, with
    `unknown_settings`, the fields no release has, as `path=value`; the fields not
    implemented, as `path=value`, for the one warning at start; the field each setting
    came from, so that an error names it)."""
    if doc.get("apiVersion") != API_VERSION:
        raise KubeProxyConfigError(f"apiVersion: {doc.get('apiVersion')!r} is not "
                                   f"supported (use {API_VERSION}, the only version "
                                   "kube-proxy has)")
    if doc.get("kind") != KIND:
        raise KubeProxyConfigError(f"kind: {doc.get('kind')!r} is not {KIND}")
    fields = _flatten(doc)
    mode = _mode(fields)
    _refuse_what_would_move_packets(fields, mode)
    out: dict[str, Any] = {"proxy_mode": mode}
    origin = {"proxy_mode": "mode"}
    unknown = [f"{path}={_show(fields[path])}" for path in sorted(fields)
               if path not in KNOWN]
    if unknown:  # skipped, as kube-proxy's lenient decoding skips them
        out["unknown_settings"] = unknown

    def take(path: str, dest: str, convert: Callable[[Any], Any] = str) -> None:
        value = fields.get(path)
        if not _zero(value):
            try:
                out[dest] = convert(value)
            except ValueError:
                raise KubeProxyConfigError(f"{path}: invalid value {value!r}") from None
            origin[dest] = path

    take("clusterCIDR", "cluster_cidr")
    take("hostnameOverride", "hostname_override")
    bind = _bind_address(fields.get("bindAddress"))
    healthz, metrics = DEFAULT_ADDRESSES[4 if bind is None or bind.version == 4
                                         or bind.ipv4_mapped is not None else 6]
    for path, dest, host, port in (
            ("healthzBindAddress", "healthz_bind_address", healthz, HEALTHZ_PORT),
            ("metricsBindAddress", "metrics_bind_address", metrics, METRICS_PORT)):
        given = fields.get(path)
        if _zero(given):  # upstream's default, by bindAddress's family
            out[dest], origin[dest] = f"{host}:{port}", "bindAddress"
        else:
            out[dest], origin[dest] = str(given), path
    take("clientConnection.kubeconfig", "kubeconfig")
    take("ipvs.scheduler", "ipvs_scheduler")
    if mode == "ipvs":  # the --init-only step's ARP sysctls; another mode's field else
        take("ipvs.strictARP", "ipvs_strict_arp", _strict_bool)
    take("logging.verbosity", "v", int)
    take("logging.format", "logging_format")
    for path, dest in CONNTRACK.items():
        if fields.get(path) is not None:  # null: kube-proxy's default
            out[dest], origin[dest] = fields[path], path
    addresses = fields.get("nodePortAddresses")
    if not _zero(addresses):
        if not isinstance(addresses, list):
            raise KubeProxyConfigError(f"nodePortAddresses: must be a list, got {addresses!r}")
        out["nodeport_addresses"] = [str(a) for a in addresses]
        origin["nodeport_addresses"] = "nodePortAddresses"
    _take_mode_sections(fields, modes.get(mode), out, origin)
    ignored = [f"{path}={_show(fields[path])}" for path in sorted(fields)
               if path in NOT_IMPLEMENTED and not _zero(fields[path])
               and fields[path] not in NOT_IMPLEMENTED[path]
               and mode in READ_IN_MODES.get(path, (mode,))]
    if bind is not None and not bind.is_unspecified:
        _refuse_primary_bind_address(fields, modes.get(mode))
        ignored.append(f"bindAddress={_show(fields['bindAddress'])} "
                       "(as the node's primary IP)")
    return out, ignored, origin


def _mode(fields: Mapping[str, Any]) -> str:
    mode = fields.get("mode") or modes.DEFAULT  # "": upstream's default on Linux
    if mode not in modes.names():
        raise KubeProxyConfigError(f"mode: {mode!r} is not a mode sliceproxy has "
                                   f"({', '.join(sorted(modes.names()))}; empty means "
                                   f"{modes.DEFAULT})")
    return str(mode)


def _take_mode_sections(fields: Mapping[str, Any], mode: modes.Mode, out: dict[str, Any],
                        origin: dict[str, str]) -> None:
    """The mode's own periods and masquerading, as kube-proxy reads them (the IPVS mode
    masquerades by the iptables section; v1alpha1 has no top-level periods)."""
    for name, dest in (("syncPeriod", "sync_period"), ("minSyncPeriod", "min_sync_period")):
        path = f"{mode.config_section}.{name}"
        value = _duration(fields.get(path))
        if value is not None:
            out[dest], origin[dest] = value, path
    masq = f"{mode.masquerade_section}.masqueradeAll"
    if not _zero(fields.get(masq)):
        out["masquerade_all"], origin["masquerade_all"] = fields[masq], masq


def _refuse_primary_bind_address(fields: Mapping[str, Any], mode: modes.Mode) -> None:
    """A specific bindAddress is also kube-proxy's primary node IP. Where NodePorts open
    by it (`primary`, or the mode's default: nftables) it would move them: refused;
    else only kube-proxy's loadBalancerSourceRanges check reads it
    (docs/upstream-differences.md K6)."""
    addresses = fields.get("nodePortAddresses") or []
    if "primary" in addresses or (mode.nodeports_on_primary_ips and not addresses):
        raise KubeProxyConfigError(
            f"bindAddress: {fields['bindAddress']!r} is kube-proxy's primary node IP, "
            "where nodePortAddresses 'primary' opens NodePorts; sliceproxy takes the "
            "primary IPs from the Node object: set bindAddress to 0.0.0.0 (or ::), or "
            "list nodePortAddresses as CIDRs")


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _bind_address(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """bindAddress, validated as upstream does (an IP address), None if unset."""
    if _zero(value):
        return None
    try:
        return ipaddress.ip_address(str(value).strip())
    except ValueError:
        raise KubeProxyConfigError(f"bindAddress: {value!r} is not an IP address "
                                   "(e.g. 0.0.0.0, or :: for IPv6)") from None


def _refuse_what_would_move_packets(fields: Mapping[str, Any], mode: str) -> None:
    """The fields whose value would change where packets go, if sliceproxy did not do
    what they ask (the module's docstring says why for each)."""
    local = fields.get("detectLocalMode") or ""
    if local not in DETECT_LOCAL_MODES:
        raise KubeProxyConfigError(
            f"detectLocalMode: {local!r} is not supported: sliceproxy tells pod traffic "
            "by clusterCIDR alone (detectLocalMode ClusterCIDR), so what it masquerades "
            "would differ; set detectLocalMode: ClusterCIDR and clusterCIDR to the pod "
            "network")
    bit = f"{modes.get(mode).masquerade_section}.masqueradeBit"
    if fields.get(bit) not in (None, MASQUERADE_BIT):
        raise KubeProxyConfigError(
            f"{bit}: {fields[bit]!r} is not supported: sliceproxy always marks the packets "
            f"it masquerades with bit {MASQUERADE_BIT} (0x4000), so packets something else "
            f"on the node marks with that bit would be masqueraded too; once nothing else "
            f"uses it, set {MASQUERADE_BIT} or remove the field")


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)
