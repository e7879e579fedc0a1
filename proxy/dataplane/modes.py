"""Every proxy mode, described once: the data plane the factory builds, the names
`--proxy-mode` and kube-proxy's `mode` accept, the sections of kube-proxy's file the
mode reads, the names by which its objects in the kernel are known (to its own code, and
to another mode removing them as leftovers), the function that removes them, and the
counters only it reports.

Import-free on purpose (no data-plane module is imported here): the options, the factory
and the leftovers' probes read it at every start, before any mode's code is loaded
(importing a mode's modules costs 5 to 30 ms). Code is named by dotted path
(`module:attribute`) and imported by `load`, only when needed.

Adding a mode: docs/architecture.md, "Adding a mode"; tests/unit/test_layout.py checks
that this registry and the modes' code agree.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every x_tables chain sliceproxy writes, in any mode, begins with this; nothing else is
# ever ours (xtables/saved.py's clean-up reads it).
CHAIN_PREFIX = "SPX-"


@dataclass(frozen=True, slots=True)
class Markers:
    """The names of a mode's objects in the kernel that tell they are this mode's (an
    empty name: the mode makes no such object). The mode's own code reads them from
    here, so a rename is one edit."""

    # Its x_tables chains (nat and filter) begin with this. A mode whose prefix starts
    # with another's (SPX-IPVS- within SPX-) owns the chains of the longer one.
    chain_prefix: str = ""
    # A nat chain every ruleset of the mode has: the probe asks for it alone.
    marker_chain: str = ""
    # A dummy network interface only this mode makes.
    dummy_interface: str = ""
    # Its nf_tables table (in the ip and ip6 families), and how many shard tables
    # `<table>-<i>` it may add beside it (i < table_shards).
    table: str = ""
    table_shards: int = 0

    def shard_table(self, index: int) -> str:
        return f"{self.table}-{index}"

    def tables(self) -> tuple[str, ...]:
        """Every nf_tables table name the mode may use (per family)."""
        if not self.table:
            return ()
        return (self.table, *(self.shard_table(i) for i in range(self.table_shards)))


@dataclass(frozen=True, slots=True)
class ModeCounter:
    """A metric only one mode has: the agent registers it, the mode's data plane reports
    what to add to it (SyncReport.counted, ApplyError.counted), by `name`."""

    name: str
    help: str


@dataclass(frozen=True, slots=True)
class Mode:
    name: str  # `--proxy-mode`, and kube-proxy's `mode` field
    plane: str  # `module:Class` of its DataPlane (the class takes DataplaneOptions)
    # `module:function` removing this mode's leftovers when another mode runs:
    # (what the probes found of this mode, the running mode, DataplaneOptions) -> what
    # it removed (leftovers.Cleaner).
    cleaner: str
    markers: Markers
    # kube-proxy's file: the section holding the mode's syncPeriod and minSyncPeriod,
    # and the one holding its masqueradeAll and masqueradeBit (the IPVS mode's are in
    # the iptables section).
    config_section: str
    masquerade_section: str
    # `--nodeport-addresses` unset means the node's primary addresses (upstream's
    # nftables default, KEP-3866) rather than every local address.
    nodeports_on_primary_ips: bool = False
    # Running in this mode, the leftovers' probe may read the legacy nat table (False:
    # that table may be this mode's own, 100,000 rules at 10,000 services).
    probe_legacy_nat: bool = True
    counters: tuple[ModeCounter, ...] = ()


IPTABLES_RESTORE_FAILURES = ModeCounter(
    "kubeproxy_sync_proxy_rules_iptables_restore_failures",
    "iptables-restore failures (iptables mode)")
IPTABLES_PARTIAL_RESTORE_FAILURES = ModeCounter(
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
    "iptables-restore failures of partial syncs (iptables mode)")

IPVS = Mode(
    name="ipvs",
    plane="proxy.dataplane.ipvs.apply:IpvsDataPlane",
    cleaner="proxy.dataplane.leftovers:clean_ipvs",
    markers=Markers(chain_prefix=f"{CHAIN_PREFIX}IPVS-",
                    marker_chain=f"{CHAIN_PREFIX}IPVS-SERVICES",
                    dummy_interface="spx-ipvs0"),
    config_section="ipvs", masquerade_section="iptables")
IPTABLES = Mode(
    name="iptables",
    plane="proxy.dataplane.iptables.apply:IptablesDataPlane",
    cleaner="proxy.dataplane.leftovers:clean_iptables",
    markers=Markers(chain_prefix=CHAIN_PREFIX, marker_chain=f"{CHAIN_PREFIX}SERVICES"),
    config_section="iptables", masquerade_section="iptables",
    probe_legacy_nat=False,
    counters=(IPTABLES_RESTORE_FAILURES, IPTABLES_PARTIAL_RESTORE_FAILURES))
NFTABLES = Mode(
    name="nftables",
    plane="proxy.dataplane.nftables.apply:NftablesDataPlane",
    cleaner="proxy.dataplane.leftovers:clean_nftables",
    markers=Markers(table="sliceproxy", table_shards=64),
    config_section="nftables", masquerade_section="nftables",
    nodeports_on_primary_ips=True)

# Every mode, in the order another mode's leftovers are removed: the IPVS mode's first,
# so that its clean-up still finds its SPX-IPVS- chains (the iptables mode's clean-up
# sweeps every SPX- chain) and then frees the ipsets they use.
MODES: tuple[Mode, ...] = (IPVS, IPTABLES, NFTABLES)
DEFAULT = IPTABLES.name  # upstream's default on Linux (also its `mode: ""`)


def names() -> tuple[str, ...]:
    return tuple(m.name for m in MODES)


def get(name: str) -> Mode:
    """The mode called `name`; KeyError if there is none."""
    for mode in MODES:
        if mode.name == name:
            return mode
    raise KeyError(name)


def load(path: str) -> object:
    """The object a `module:attribute` path names, importing its module now."""
    import importlib  # only when a mode's code is wanted

    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
