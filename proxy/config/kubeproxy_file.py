"""kube-proxy's own configuration file (`KubeProxyConfiguration`, kubeproxy.config.k8s.io/
v1alpha1, as `kube-proxy --write-config-to` and kubeadm write it) read as sliceproxy's
settings, so `--config` can point at the file kubeadm mounts from the kube-system/
kube-proxy ConfigMap (or at that ConfigMap itself, as `kubectl get -o yaml` prints it).

Every field of the file is one of three kinds, and none is dropped without a word:

- honoured: it means what it means to kube-proxy (mode, clusterCIDR, bind addresses,
  the mode's sync periods, masqueradeAll, nodePortAddresses, the IPVS scheduler,
  hostnameOverride, clientConnection.kubeconfig, logging.verbosity and format);
- not implemented: sliceproxy does not do it (conntrack sysctls, the OOM score, client
  rate limits, feature gates, ...). Where the value is upstream's zero or asks for what
  sliceproxy does anyway (masqueradeBit 14, bindAddress 0.0.0.0) nothing is said;
  otherwise the field is named, with its value, in one warning at start (`ignored`);
- another platform's or mode's (winkernel, the userspace proxy's portRange and
  udpIdleTimeout): kube-proxy on Linux in these modes ignores them too.

A value sliceproxy cannot honour safely (a proxy mode it lacks, `nodePortAddresses:
[primary]`), a malformed one, or a field kube-proxy does not have stops the agent,
naming the field (options.ConfigError, raised by the caller with the file's name).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import yaml

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
CONFIGMAP_KEY = "config.conf"  # where kubeadm's kube-proxy ConfigMap holds the file

# Upstream's modes and ours: "" is upstream's default on Linux (iptables).
MODES = {"": "iptables", "iptables": "iptables", "ipvs": "ipvs", "nftables": "nftables"}
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
    "bindAddress": ("0.0.0.0", "::"),
    "bindAddressHardFail": (),
    "enableProfiling": (),
    "oomScoreAdj": (),
    "configSyncPeriod": (),
    "showHiddenMetricsForVersion": (),
    "featureGates": (),
    "detectLocalMode": ("ClusterCIDR",),
    "detectLocal.bridgeInterface": (),
    "detectLocal.interfaceNamePrefix": (),
    "clientConnection.acceptContentTypes": (),
    "clientConnection.contentType": (),
    "clientConnection.qps": (),
    "clientConnection.burst": (),
    "conntrack.maxPerCore": (),
    "conntrack.min": (),
    "conntrack.tcpEstablishedTimeout": (),
    "conntrack.tcpCloseWaitTimeout": (),
    "conntrack.tcpBeLiberal": (),
    "conntrack.udpTimeout": (),
    "conntrack.udpStreamTimeout": (),
    "iptables.masqueradeBit": (MASQUERADE_BIT,),
    "iptables.localhostNodePorts": (),
    "nftables.masqueradeBit": (MASQUERADE_BIT,),
    "ipvs.excludeCIDRs": (),
    "ipvs.strictARP": (),
    "ipvs.tcpTimeout": (),
    "ipvs.tcpFinTimeout": (),
    "ipvs.udpTimeout": (),
    "logging.flushFrequency": (),
    "logging.vmodule": (),
    "logging.options": (),
}
# Another platform's or mode's: ignored by kube-proxy itself on Linux in these modes.
OTHER_PLATFORM = ("winkernel", "portRange", "udpIdleTimeout")

# The fields this module reads (the others of NOT_IMPLEMENTED and OTHER_PLATFORM are
# only checked), by section.
HONOURED = {"apiVersion", "kind", "mode", "clusterCIDR", "hostnameOverride",
            "healthzBindAddress", "metricsBindAddress", "nodePortAddresses",
            "syncPeriod", "minSyncPeriod", "clientConnection.kubeconfig",
            "iptables.masqueradeAll", "iptables.syncPeriod", "iptables.minSyncPeriod",
            "ipvs.scheduler", "ipvs.syncPeriod", "ipvs.minSyncPeriod",
            "nftables.masqueradeAll", "nftables.syncPeriod", "nftables.minSyncPeriod",
            "logging.verbosity", "logging.format"}
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
    """(settings by sliceproxy's flag names, as config.from_values takes them; the
    fields not implemented, as `path=value`, for the one warning at start; the field
    each setting came from, so that an error names it)."""
    if doc.get("apiVersion") != API_VERSION:
        raise KubeProxyConfigError(f"apiVersion: {doc.get('apiVersion')!r} is not "
                                   f"supported (use {API_VERSION})")
    if doc.get("kind") != KIND:
        raise KubeProxyConfigError(f"kind: {doc.get('kind')!r} is not {KIND}")
    fields = _flatten(doc)
    unknown = sorted(k for k in fields if k not in HONOURED and k not in NOT_IMPLEMENTED
                     and k not in OTHER_PLATFORM)
    if unknown:
        raise KubeProxyConfigError(f"{unknown[0]}: not a field of {KIND} "
                                   f"({API_VERSION})" + (f"; also {', '.join(unknown[1:])}"
                                                         if unknown[1:] else ""))
    mode_value = fields.get("mode") or ""
    if mode_value not in MODES:
        raise KubeProxyConfigError(f"mode: {mode_value!r} is not a mode sliceproxy has "
                                   "(iptables, ipvs, nftables; empty means iptables)")
    mode = MODES[mode_value]
    out: dict[str, Any] = {"proxy_mode": mode}
    origin = {"proxy_mode": "mode"}

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
    take("healthzBindAddress", "healthz_bind_address")
    take("metricsBindAddress", "metrics_bind_address")
    take("clientConnection.kubeconfig", "kubeconfig")
    take("ipvs.scheduler", "ipvs_scheduler")
    take("logging.verbosity", "v", int)
    take("logging.format", "logging_format")
    addresses = fields.get("nodePortAddresses")
    if not _zero(addresses):
        if not isinstance(addresses, list):
            raise KubeProxyConfigError(f"nodePortAddresses: must be a list, got {addresses!r}")
        if "primary" in addresses:
            raise KubeProxyConfigError(
                "nodePortAddresses: 'primary' is not supported by sliceproxy (it would "
                "open NodePorts on every address instead); list the CIDRs")
        out["nodeport_addresses"] = [str(a) for a in addresses]
        origin["nodeport_addresses"] = "nodePortAddresses"
    # The mode's own periods and masquerading, as kube-proxy reads them (the IPVS mode
    # masquerades by the iptables section); the top-level periods of newer versions win.
    section = {"iptables": "iptables", "ipvs": "ipvs", "nftables": "nftables"}[mode]
    for name, dest in (("syncPeriod", "sync_period"), ("minSyncPeriod", "min_sync_period")):
        for path in (name, f"{section}.{name}"):
            value = _duration(fields.get(path))
            if value is not None:
                out[dest], origin[dest] = value, path
                break
    masq = f"{'nftables' if mode == 'nftables' else 'iptables'}.masqueradeAll"
    if not _zero(fields.get(masq)):
        out["masquerade_all"], origin["masquerade_all"] = fields[masq], masq
    ignored = [f"{path}={_show(fields[path])}" for path in sorted(fields)
               if path in NOT_IMPLEMENTED and not _zero(fields[path])
               and fields[path] not in NOT_IMPLEMENTED[path]]
    return out, ignored, origin


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)
