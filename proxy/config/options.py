"""The agent's configuration: flags (kube-proxy's names where the meaning is the same),
an optional YAML `--config` file with the same keys or kube-proxy's own
KubeProxyConfiguration (kubeproxy_file.py), and validation that names the flag.

Precedence: defaults < config file < command-line flags.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from proxy.config.kubeproxy_file import (
    KubeProxyConfigError,
    from_configmap,
    is_kube_proxy_config,
    translate,
)
from proxy.dataplane import modes
from proxy.kube.ingest import EndpointsSource
from proxy.model import nodeport_addresses
from proxy.model.types import Balancing, IPNetwork


class ConfigError(Exception):
    """A bad flag or config value; the message names the flag and the value."""


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                 "h": 3600.0}


def parse_duration(text: str) -> float:
    """Go's time.ParseDuration, as kube-proxy's flags take it: `1s`, `250ms`, `1h30m`, `0`.

    Returns seconds. Negative durations are refused: no sliceproxy setting means one.
    """
    raw = text.strip()
    if raw == "0":
        return 0.0
    if not raw or raw.startswith("-"):
        raise ValueError(f"invalid duration {text!r}")
    body = raw[1:] if raw.startswith("+") else raw
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(body):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(body) or pos == 0:
        raise ValueError(
            f"invalid duration {text!r} (use a number with a unit: ns, us, ms, s, m, h; "
            "e.g. 1s, 250ms, 1h30m)")
    return total


def format_duration(seconds: float) -> str:
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    if seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


CPU_BUDGET_MIN = 0.01


def parse_cpu_budget(value: Any) -> float | None:
    """`--sync-cpu-budget`: a share of one core as `20%` or `0.2`; `off` (YAML reads a
    bare `off` as false) means no budget. Between 1% and 100%: below 1% a full sync
    of a large cluster would hold changes back for minutes; above 100% the budget could
    never bind, as a sync runs on one thread at a time (say `off`)."""
    if value is False or str(value).strip().lower() == "off":
        return None
    if isinstance(value, bool):
        raise ValueError("must be a share of one core (20% or 0.2), or off")
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        share = float(text[:-1] if percent else text) / (100 if percent else 1)
    except ValueError:
        raise ValueError("must be a share of one core (20% or 0.2), or off") from None
    if not CPU_BUDGET_MIN <= share <= 1.0:  # also refuses nan
        hint = f" (did you mean {text}%?)" if not percent and 1 < share <= 100 else ""
        raise ValueError(f"must be between 1% and 100% of one core, or off{hint}")
    return share


def format_cpu_budget(share: float | None) -> str:
    return "off" if share is None else f"{round(share * 100, 2):g}%"


HEALTHZ_PORT, METRICS_PORT = 10256, 10249  # kube-proxy's (pkg/cluster/ports)


def parse_bind_address(text: str, flag: str, default_port: int) -> tuple[str, int]:
    """`IP:PORT`, `[IPv6]:PORT`, or a bare IP, which gets `default_port` as kube-proxy
    gives it (its AppendPortIfNeeded); port 0 disables the server."""
    raw = text.strip()
    try:
        return str(ipaddress.ip_address(raw)), default_port
    except ValueError:
        pass
    host, sep, port = raw.rpartition(":")
    if raw.startswith("[") and "]" in raw:
        host, _, rest = raw[1:].partition("]")
        port = rest.lstrip(":")
        sep = ":" if rest else ""
    if not sep:
        raise ConfigError(f"{flag}: {text!r} is not IP:PORT or IP (e.g. 0.0.0.0:10256, "
                          "[::]:10256)")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {text!r} is not IP:PORT ({exc})") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{flag}: port {number} is out of range 0-65535")
    return host, number


# --debug-dump: who /debug/dump answers (docs/security.md).
DEBUG_DUMP = ("false", "local", "true")


def parse_debug_dump(value: Any) -> str:
    """`local` (loopback clients), or a Go bool: true (every client that reaches the
    metrics server), false (off)."""
    if str(value).strip().lower() == "local":
        return "local"
    try:
        return "true" if _bool(value) else "false"
    except ValueError:
        raise ValueError("must be false, local or true") from None


@dataclass(frozen=True, slots=True)
class Config:
    kubeconfig: str | None = None
    master: str | None = None
    hostname_override: str | None = None
    proxy_mode: str = modes.DEFAULT
    endpoints_source: EndpointsSource = EndpointsSource.ENDPOINT_SLICES
    min_sync_period: float | None = None  # None: paced by cost alone (schedule.py)
    sync_cpu_budget: float | None = 0.2  # share of one core; None: off
    sync_period: float = 3600.0
    cluster_cidr: tuple[IPNetwork, ...] = ()
    masquerade_all: bool = False
    nodeport_addresses: tuple[IPNetwork, ...] = ()
    # `primary` in --nodeport-addresses: the node's primary addresses (its Node object's)
    # accept NodePorts too; the default of a mode that says so (modes.py: nftables) when
    # no CIDR is given (from_values).
    nodeport_primary: bool = False
    healthz_bind_address: tuple[str, int] = ("0.0.0.0", HEALTHZ_PORT)  # both families
    metrics_bind_address: tuple[str, int] = ("127.0.0.1", METRICS_PORT)
    debug_dump: str = "local"  # who /debug/dump answers: DEBUG_DUMP (docs/security.md)
    healthz_threshold: float = 0.0  # 0: derived from the sync periods (see agent)
    # How often the agent looks for another service proxy writing its rules on this node
    # (agent/foreign_proxy.py); 0: never.
    foreign_proxy_check_interval: float = 10.0
    service_proxy_name: str = ""
    ipvs_scheduler: str = "rr"
    # How services without the sliceproxy.io/balancing annotation balance (model/balancing.py).
    default_balancing: str = Balancing.RANDOM.value
    # End TCP flows to an endpoint that left, for services without the
    # sliceproxy.io/fail-fast annotation (dataplane/common/fail_fast.py).
    fail_fast: bool = False
    # Count each endpoint's new connections (and show them in /metrics), for services
    # without the sliceproxy.io/traffic-per-endpoint annotation (dataplane/common/traffic.py).
    traffic_per_endpoint: bool = False
    iptables_applier: str = "restore"
    cleanup: bool = False
    verbosity: int = 0
    logging_format: str = "text"
    uvloop: bool = True
    # kube-proxy's node settings (its defaults; 0 leaves one alone), written by
    # --init-only and checked by the agent at start (agent/node_setup.py).
    conntrack_max_per_core: int = 32 * 1024
    conntrack_min: int = 128 * 1024
    conntrack_tcp_timeout_established: float = 24 * 3600.0
    conntrack_tcp_timeout_close_wait: float = 3600.0
    conntrack_tcp_be_liberal: bool = False
    conntrack_udp_timeout: float = 0.0
    conntrack_udp_timeout_stream: float = 0.0
    ipvs_strict_arp: bool = False
    init_only: bool = False
    restore_node_settings: bool = False
    # Fields of a KubeProxyConfiguration file sliceproxy does not implement, and those
    # kube-proxy does not have either, as `path=value` (kubeproxy_file.py): named in one
    # warning at start.
    ignored_settings: tuple[str, ...] = ()
    unknown_settings: tuple[str, ...] = ()

    @property
    def node_name(self) -> str:
        return (self.hostname_override or socket.gethostname()).strip().lower()

    def as_dict(self) -> dict[str, Any]:
        """The configuration as an operator reads it (the debug dump shows this)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, EndpointsSource):
                value = value.value
            elif f.name == "sync_cpu_budget":
                value = format_cpu_budget(value)
            elif f.name in ("min_sync_period", "sync_period", "healthz_threshold",
                            "foreign_proxy_check_interval", *CONNTRACK_TIMEOUTS):
                value = None if value is None else format_duration(value)
            elif f.name.endswith("bind_address"):
                value = f"{value[0]}:{value[1]}"
            elif f.name == "nodeport_addresses":
                value = nodeport_addresses.spelled(value, self.nodeport_primary)
            elif f.name == "nodeport_primary":
                continue  # shown in nodeport-addresses, as the flag spells it
            elif isinstance(value, tuple):
                value = [str(v) for v in value]
            out[f.name.replace("_", "-")] = value
        out["node-name"] = self.node_name
        return out


CONNTRACK_TIMEOUTS = ("conntrack_tcp_timeout_established", "conntrack_tcp_timeout_close_wait",
                      "conntrack_udp_timeout", "conntrack_udp_timeout_stream")
IPTABLES_APPLIERS = ("restore", "iptc")
LOGGING_FORMATS = ("text", "json")
IPVS_SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh")
BALANCINGS = tuple(b.value for b in Balancing)
# The settings that take one of a few words (the proxy modes: modes.py's, when asked).
_CHOICES = {"iptables_applier": IPTABLES_APPLIERS, "logging_format": LOGGING_FORMATS,
            "ipvs_scheduler": IPVS_SCHEDULERS, "default_balancing": BALANCINGS}


def choices(dest: str) -> tuple[str, ...]:
    return tuple(sorted(modes.names())) if dest == "proxy_mode" else _CHOICES[dest]


def _modes_help() -> str:
    return ", ".join(f"{m} (default)" if m == modes.DEFAULT else m
                     for m in choices("proxy_mode"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proxy",
        description="sliceproxy: a Kubernetes service proxy (iptables, nftables or IPVS).",
        epilog="Other commands: python -m proxy explain --help; python -m proxy dump --help",
    )
    _cluster_flags(p.add_argument_group("cluster and mode"))
    _sync_flags(p.add_argument_group("syncs"))
    _server_flags(p.add_argument_group("addresses and servers"))
    _node_setting_flags(p.add_argument_group("node settings"))
    _command_flags(p.add_argument_group("one-shot commands and logging"))
    return p


def _cluster_flags(g: argparse._ArgumentGroup) -> None:
    """Where the cluster is, who this node is, which mode and sources."""
    add = g.add_argument
    add("--config", metavar="FILE", help="YAML file with any of these flags as keys "
        "(e.g. min-sync-period: 250ms), or kube-proxy's KubeProxyConfiguration "
        "(kubeproxy.config.k8s.io/v1alpha1, or kubeadm's kube-proxy ConfigMap holding "
        "it); flags given on the command line win")
    add("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    add("--master", help="API server address, overriding the kubeconfig's")
    add("--hostname-override", help="this node's name (default: the host name)")
    add("--proxy-mode", help=_modes_help())
    add("--endpoints-source", help="endpointslices (default) or endpoints (legacy)")
    add("--default-balancing", metavar="ALGORITHM",
        help="sliceproxy only: how a service without the sliceproxy.io/balancing "
             "annotation picks an endpoint: random (default, kube-proxy's), maglev "
             "(consistent hashing of the source address and port) or source-hash")


def _sync_flags(g: argparse._ArgumentGroup) -> None:
    """When syncs run, and what is masqueraded."""
    add = g.add_argument
    add("--min-sync-period", metavar="DURATION",
        help="kube-proxy's pacing: at most 2 syncs at once, then one per DURATION; the "
             "first change after a quiet period syncs at once (default unset: a change "
             "syncs as soon as the previous sync ends, within --sync-cpu-budget)")
    add("--sync-cpu-budget", metavar="SHARE",
        help="sliceproxy only: the CPU syncs may use, as a share of one core (20%% or "
             "0.2, 1%%-100%%; off: no limit); when spent, changes wait and are batched "
             "(default 20%%)")
    add("--sync-period", metavar="DURATION", help="full resync period (default 1h)")
    add("--cluster-cidr", metavar="CIDR[,CIDR]",
        help="pod network; traffic to service IPs from outside it is masqueraded")
    add("--masquerade-all", action="store_true", default=None,
        help="masquerade all traffic sent to service IPs")
    add("--fail-fast", action="store_true", default=None,
        help="sliceproxy only: when an endpoint leaves a service (not while it is "
             "terminating and still serving), reset its clients' TCP connections at "
             "once, for services without the sliceproxy.io/fail-fast annotation "
             "(default off)")
    add("--traffic-per-endpoint", action="store_true", default=None,
        help="sliceproxy only: count each endpoint's new connections in the kernel and "
             "export them in /metrics (one series per endpoint), for services without "
             "the sliceproxy.io/traffic-per-endpoint annotation (default off: per "
             "service port)")


def _server_flags(g: argparse._ArgumentGroup) -> None:
    """Which addresses take NodePorts; the health, metrics and dump servers."""
    add = g.add_argument
    add("--nodeport-addresses", metavar="CIDR|primary[,...]",
        help="node addresses that accept NodePort traffic: CIDRs, and/or primary (the "
             "node's primary IPs in its Node object) (default: all local addresses; "
             "primary in nftables mode)")
    add("--healthz-bind-address", metavar="IP:PORT",
        help="health check server (default 0.0.0.0:10256; 0.0.0.0 or :: is every address "
             "of both families, as kube-proxy's; a bare IP takes port 10256; port 0 "
             "disables)")
    add("--metrics-bind-address", metavar="IP:PORT",
        help="metrics and debug dump server (default 127.0.0.1:10249; a bare IP takes "
             "port 10249; port 0 disables)")
    add("--debug-dump", metavar="WHO", nargs="?", const="true",
        help="sliceproxy only: who /debug/dump (every service, endpoint and rule) answers "
             "on the metrics server: local (default: clients on a loopback address), "
             "true (every client), false (off; /metrics stays)")
    add("--service-proxy-name", help="also proxy services labelled "
        "service.kubernetes.io/service-proxy-name with this value")
    add("--healthz-threshold", metavar="DURATION",
        help="sliceproxy only: /healthz fails once a change has waited this long to be "
             "applied (default 60s, or 3x --min-sync-period if set and longer; kube-proxy uses "
             "2x its --sync-period)")
    add("--foreign-proxy-check-interval", metavar="DURATION",
        help="sliceproxy only: how often to look for another service proxy (kube-proxy) "
             "writing its rules on this node, reported in the log, /metrics and /healthz "
             "(default 10s; 0 turns the check off)")


def _node_setting_flags(g: argparse._ArgumentGroup) -> None:
    """IPVS and conntrack: the node's kernel settings."""
    add = g.add_argument
    add("--ipvs-scheduler", help="IPVS scheduler (default rr)")
    add("--ipvs-strict-arp", action="store_true", default=None,
        help="IPVS mode: set arp_ignore=1 and arp_announce=2 (with --init-only)")
    add("--conntrack-max-per-core", metavar="N",
        help="conntrack table entries per CPU (default 32768; 0 leaves the table size "
             "alone and ignores --conntrack-min); written by --init-only")
    add("--conntrack-min", metavar="N",
        help="conntrack table entries at least, whatever the CPUs (default 131072)")
    add("--conntrack-tcp-timeout-established", metavar="DURATION",
        help="idle timeout of established TCP flows (default 24h; 0 leaves it alone)")
    add("--conntrack-tcp-timeout-close-wait", metavar="DURATION",
        help="timeout of TCP flows in CLOSE_WAIT (default 1h; 0 leaves it alone)")
    add("--conntrack-tcp-be-liberal", action="store_true", default=None,
        help="mark only out-of-window RST segments invalid (nf_conntrack_tcp_be_liberal)")
    add("--conntrack-udp-timeout", metavar="DURATION",
        help="idle timeout of UDP flows not yet replied to (default 0: leave it alone)")
    add("--conntrack-udp-timeout-stream", metavar="DURATION",
        help="idle timeout of UDP flows that saw replies (default 0: leave it alone)")


def _command_flags(g: argparse._ArgumentGroup) -> None:
    """Commands that run once and exit; logging; the event loop."""
    add = g.add_argument
    add("--init-only", action="store_true", default=None,
        help="set kube-proxy's node settings (conntrack table and timeouts; the IPVS "
             "sysctls in IPVS mode) where they differ, and exit; needs a writable "
             "/proc/sys and /sys (docs/deploy.md)")
    add("--restore-node-settings", action="store_true", default=None,
        help="give the node back each setting --init-only changed, where it still holds "
             "what was written, and exit (uninstall; needs a writable /proc/sys and /sys "
             "and the node's /run/sliceproxy; docs/uninstall.md)")
    add("--iptables-applier", help="how iptables mode writes rules: restore (default: "
        "iptables-restore, fastest, both back ends) or iptc (python-iptables; legacy "
        "IPv4 tables only)")
    add("--cleanup", action="store_true", default=None,
        help="remove every rule sliceproxy owns and exit")
    add("-v", "--v", dest="v", metavar="N", help="log verbosity (0-9, as kube-proxy's -v)")
    add("--logging-format", metavar="FORMAT",
        help="text (default: key=value lines) or json (one object per line, Kubernetes' "
             "keys); docs/logging.md")
    add("--no-uvloop", action="store_true", default=None,
        help="use the standard asyncio event loop instead of uvloop")


def _cidrs(raw: Any, flag: str) -> tuple[IPNetwork, ...]:
    items = raw if isinstance(raw, list) else str(raw).split(",")
    out: list[IPNetwork] = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigError(f"{flag}: {item!r} is not a CIDR (e.g. 198.18.0.0/16)") from None
    return tuple(out)


def _load_file(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of flag names to values")
    try:
        upstream = from_configmap(data) or (data if is_kube_proxy_config(data) else None)
        if upstream is not None:
            values, ignored, origin = translate(upstream)
    except KubeProxyConfigError as exc:
        raise ConfigError(f"--config: {path}: {exc}") from None
    if upstream is not None:
        try:  # the file's own values, so that an error names the file's field
            from_values(values)
        except ConfigError as exc:
            message = str(exc)  # the flags it names, as the file's fields
            for dest, field in sorted(origin.items(), key=lambda kv: -len(_flag(kv[0]))):
                message = re.sub(rf"(?<![\w-]){re.escape(_flag(dest))}(?![\w-])", field,
                                 message)
            raise ConfigError(f"--config: {path}: {message}") from None
        values["ignored_settings"] = ignored
        return values
    known = {a.dest for a in build_parser()._actions} - {"help", "config"}
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        dest = {"no_uvloop": "no_uvloop", "verbosity": "v"}.get(dest, dest)
        if dest not in known:
            raise ConfigError(f"--config: unknown key {key!r} in {path}")
        out[dest] = value
    return out


def parse_args(argv: list[str]) -> Config:
    ns = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(ns).items() if v is not None and k != "config"}
    values = _load_file(ns.config) if ns.config else {}
    values.update(given)
    return from_values(values)


def _flag(dest: str) -> str:
    return "-v" if dest == "v" else "--" + dest.replace("_", "-")


def from_values(values: dict[str, Any]) -> Config:
    kw: dict[str, Any] = {}
    for dest, value in values.items():
        flag = _flag(dest)
        try:
            match dest:
                case "kubeconfig" | "master" | "hostname_override" | "service_proxy_name":
                    kw[dest] = str(value) if value is not None else None
                case ("proxy_mode" | "iptables_applier" | "logging_format" | "ipvs_scheduler"
                      | "default_balancing"):
                    if value not in choices(dest):
                        raise ValueError(f"must be one of {', '.join(choices(dest))}")
                    kw[dest] = value
                case "endpoints_source":
                    kw[dest] = EndpointsSource(value)
                case ("min_sync_period" | "sync_period" | "healthz_threshold"
                      | "foreign_proxy_check_interval"):
                    kw[dest] = parse_duration(str(value))
                case "sync_cpu_budget":
                    kw[dest] = parse_cpu_budget(value)
                case "cluster_cidr":
                    kw[dest] = _cidrs(value, flag)
                case "nodeport_addresses":
                    items = value if isinstance(value, list) else str(value).split(",")
                    try:
                        kw[dest], kw["nodeport_primary"] = nodeport_addresses.parse(items)
                    except ValueError as exc:
                        raise ConfigError(f"{flag}: {exc}") from None
                case "masquerade_all" | "cleanup" | "fail_fast" | "traffic_per_endpoint":
                    kw[dest] = _bool(value)
                case "debug_dump":
                    kw[dest] = parse_debug_dump(value)
                case "no_uvloop":
                    kw["uvloop"] = not _bool(value)
                case "healthz_bind_address" | "metrics_bind_address":
                    kw[dest] = parse_bind_address(
                        str(value), flag,
                        HEALTHZ_PORT if dest == "healthz_bind_address" else METRICS_PORT)
                case "ignored_settings" | "unknown_settings":
                    kw[dest] = tuple(value)
                case "conntrack_max_per_core" | "conntrack_min":
                    kw[dest] = _count(value)
                case ("conntrack_tcp_timeout_established" | "conntrack_tcp_timeout_close_wait"
                      | "conntrack_udp_timeout" | "conntrack_udp_timeout_stream"):
                    kw[dest] = parse_duration(str(value))
                case ("conntrack_tcp_be_liberal" | "ipvs_strict_arp" | "init_only"
                      | "restore_node_settings"):
                    kw[dest] = _bool(value)
                case "v":
                    level = int(value)
                    if not 0 <= level <= 9:
                        raise ValueError("must be 0-9")
                    kw["verbosity"] = level
                case _:
                    raise ValueError("unknown setting")
        except ConfigError:
            raise
        except ValueError as exc:
            detail = str(exc)
            if "is not a valid EndpointsSource" in detail:
                detail = "must be endpointslices or endpoints"
            raise ConfigError(f"{flag}: invalid value {value!r}: {detail}") from None
    cfg = Config(**kw)
    if modes.get(cfg.proxy_mode).nodeports_on_primary_ips and not (
            cfg.nodeport_addresses or cfg.nodeport_primary):
        # Upstream's nftables default (KEP-3866; its platformApplyDefaults): NodePorts on
        # the node's primary addresses only, not on every local address.
        cfg = replace(cfg, nodeport_primary=True)
    if cfg.sync_period <= 0:
        raise ConfigError(f"--sync-period: must be greater than 0 (e.g. 1h), "
                          f"got {format_duration(cfg.sync_period)}")
    if cfg.min_sync_period is not None and cfg.min_sync_period > cfg.sync_period:
        raise ConfigError(
            f"--min-sync-period ({format_duration(cfg.min_sync_period)}) must not exceed "
            f"--sync-period ({format_duration(cfg.sync_period)})")
    if not cfg.node_name:
        raise ConfigError("--hostname-override: empty node name")
    return cfg


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError("must be true or false")


def _count(value: Any) -> int:
    """A whole number from 0 to 2^31 - 1 (kube-proxy's int32 flags)."""
    if isinstance(value, bool):
        raise ValueError("must be a whole number")
    number = int(str(value).strip())
    if not 0 <= number < 2**31:
        raise ValueError("must be from 0 to 2147483647")
    return number
