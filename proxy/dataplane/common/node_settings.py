"""The node settings kube-proxy writes at start, worked out from the configuration (pure).

kube-proxy sets them even when its configuration leaves them unset, and a node keeps them
only until its next boot; after a switch to sliceproxy they must still be set, or a busy
node falls back to the kernel's defaults (a small conntrack table: "nf_conntrack: table
full, dropping packet"). Upstream's rules (kubernetes `pkg/proxy/conntrack/sysctls.go`,
`cmd/kube-proxy/app/conntrack.go` in v1.20, the IPVS proxier's NewProxier):

- `nf_conntrack_max` = conntrack.maxPerCore x CPUs (the node's online CPUs), capped at
  1,048,576, and at least conntrack.min; maxPerCore 0 leaves the table alone. Only ever
  raised, and the conntrack module's `hashsize` raised to a quarter of it. Both are
  global: the kernel lets only the initial network namespace write them.
- the TCP established and close-wait timeouts (and, when configured, liberal TCP and the
  UDP timeouts): exactly the configured value, 0 leaving the kernel's; per namespace.
- IPVS mode: `net.ipv4.vs.conntrack`, `expire_nodest_conn`, `expire_quiescent_template`
  and `ip_forward` 1, `conn_reuse_mode` 0 on kernels 4.1 to 5.8 (later ones fixed the
  bug it works round), and with strict ARP `arp_ignore` 1 and `arp_announce` 2.

What writes them (and what only reads them) is node_files.py; `wanted` here decides
which, to what value, and by which rule, so that it can be tested on numbers alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROC_SYS = "proc/sys/"
HASHSIZE = "sys/module/nf_conntrack/parameters/hashsize"
CONNTRACK_MODULE, IPVS_MODULE = "nf_conntrack", "ip_vs"

# kube-proxy's defaults (pkg/proxy/apis/config/v1alpha1/defaults.go): what a
# KubeProxyConfiguration's null fields, and unset flags, mean.
MAX_PER_CORE, MIN = 32 * 1024, 128 * 1024
TCP_ESTABLISHED, TCP_CLOSE_WAIT = 24 * 3600.0, 3600.0
# Since kube-proxy 1.36: no table larger than this from per-core scaling alone.
SCALED_CAP = 1_048_576

# The IPVS mode's sysctls, with what each is for: conntrack entries for IPVS connections
# (iptables masquerading needs them), dropping connections whose real server is gone
# instead of black-holing them, expiring affinity templates of weight-0 real servers,
# forwarding.
EXPIRE_NODEST_CONN = "net/ipv4/vs/expire_nodest_conn"  # ipvs/moves.py lowers it briefly
IPVS_SYSCTLS = {
    "net/ipv4/vs/conntrack": 1,
    EXPIRE_NODEST_CONN: 1,
    "net/ipv4/vs/expire_quiescent_template": 1,
    "net/ipv4/ip_forward": 1,
}
CONN_REUSE_MODE = "net/ipv4/vs/conn_reuse_mode"
CONN_REUSE_KERNELS = ((4, 1), (5, 9))  # [from, to): kubernetes issue 93297
STRICT_ARP = {"net/ipv4/conf/all/arp_ignore": 1, "net/ipv4/conf/all/arp_announce": 2}


@dataclass(frozen=True, slots=True)
class NodeSettingsOptions:
    """What the settings depend on: kube-proxy's `conntrack.*` (seconds for durations; 0
    leaves a setting alone), the mode and IPVS strict ARP."""

    max_per_core: int = MAX_PER_CORE
    minimum: int = MIN
    tcp_established: float = TCP_ESTABLISHED
    tcp_close_wait: float = TCP_CLOSE_WAIT
    tcp_be_liberal: bool = False
    udp_timeout: float = 0.0
    udp_stream_timeout: float = 0.0
    ipvs: bool = False
    strict_arp: bool = False


@dataclass(frozen=True, slots=True)
class Setting:
    """One file's wanted value. `path` is relative to the root of the node's file systems
    (`proc/sys/...` or `sys/module/...`)."""

    path: str
    value: int
    at_least: bool  # only ever raised: a larger value is kept
    node_wide: bool  # global: writable only from the initial network namespace
    module: str  # the kernel module that makes the file exist
    why: str  # what asks for it, for the log

    @property
    def name(self) -> str:
        return shown_name(self.path)

    @property
    def wanted(self) -> str:
        return f">= {self.value}" if self.at_least else str(self.value)

    def kept_by(self, current: int) -> bool:
        """Whether `current` already is what this setting asks for."""
        return current >= self.value if self.at_least else current == self.value


def shown_name(path: str) -> str:
    """As an operator writes it: `net.netfilter.nf_conntrack_max`, or the sysfs path."""
    if path.startswith(PROC_SYS):
        return path.removeprefix(PROC_SYS).replace("/", ".")
    return "/" + path


def conntrack_max(max_per_core: int, minimum: int, cpus: int) -> int:
    """kube-proxy's nf_conntrack_max, 0 for "leave it": maxPerCore x CPUs, capped at
    SCALED_CAP, and at least `minimum`. (Upstream returns the cap even when `minimum` is
    larger; an explicit minimum wins here: docs/upstream-differences.md.)"""
    if max_per_core <= 0:
        return 0
    return max(min(max_per_core * cpus, SCALED_CAP), minimum)


def kernel_version(release: str) -> tuple[int, int]:
    """`6.1.0-56-amd64` -> (6, 1); (0, 0) when unreadable."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _timeout(name: str, seconds: float, what: str) -> Setting | None:
    if seconds <= 0:
        return None
    # Go's Duration / time.Second: whole seconds, rounded down.
    return Setting(f"{PROC_SYS}net/netfilter/{name}", int(seconds), at_least=False,
                   node_wide=False, module=CONNTRACK_MODULE, why=what)


def wanted(opts: NodeSettingsOptions, cpus: int, kernel_release: str) -> tuple[Setting, ...]:
    """Every setting kube-proxy would write with these options on a node with `cpus`
    CPUs running kernel `kernel_release`, in the order kube-proxy writes them."""
    out: list[Setting] = []
    table = conntrack_max(opts.max_per_core, opts.minimum, cpus)
    if table:
        why = (f"conntrack.maxPerCore {opts.max_per_core} x {cpus} CPUs, at least "
               f"conntrack.min {opts.minimum}")
        out.append(Setting(f"{PROC_SYS}net/netfilter/nf_conntrack_max", table,
                           at_least=True, node_wide=True, module=CONNTRACK_MODULE, why=why))
        out.append(Setting(HASHSIZE, table // 4, at_least=True, node_wide=True,
                           module=CONNTRACK_MODULE, why=f"a quarter of nf_conntrack_max {table}"))
    for name, seconds, what in (
            ("nf_conntrack_tcp_timeout_established", opts.tcp_established,
             "conntrack.tcpEstablishedTimeout"),
            ("nf_conntrack_tcp_timeout_close_wait", opts.tcp_close_wait,
             "conntrack.tcpCloseWaitTimeout")):
        if (setting := _timeout(name, seconds, what)) is not None:
            out.append(setting)
    if opts.tcp_be_liberal:
        out.append(Setting(f"{PROC_SYS}net/netfilter/nf_conntrack_tcp_be_liberal", 1,
                           at_least=False, node_wide=False, module=CONNTRACK_MODULE,
                           why="conntrack.tcpBeLiberal"))
    for name, seconds, what in (
            ("nf_conntrack_udp_timeout", opts.udp_timeout, "conntrack.udpTimeout"),
            ("nf_conntrack_udp_timeout_stream", opts.udp_stream_timeout,
             "conntrack.udpStreamTimeout")):
        if (setting := _timeout(name, seconds, what)) is not None:
            out.append(setting)
    if opts.ipvs:
        ipvs = dict(IPVS_SYSCTLS)
        low, fixed = CONN_REUSE_KERNELS
        if low <= kernel_version(kernel_release) < fixed:
            ipvs[CONN_REUSE_MODE] = 0
        if opts.strict_arp:
            ipvs.update(STRICT_ARP)
        for path, value in ipvs.items():
            module = IPVS_MODULE if path.startswith("net/ipv4/vs/") else ""
            why = "ipvs.strictARP" if path in STRICT_ARP else "the IPVS mode"
            out.append(Setting(PROC_SYS + path, value, at_least=False, node_wide=False,
                               module=module, why=why))
    return tuple(out)
