"""nftables rendering (pure): a resolved service port -> the objects it owns in our tables.

Per family, one main table and K shard tables, holding nothing but ours:

    ip sliceproxy (main)
      nat-postrouting (nat, srcnat) -> masquerading: hairpin and marked traffic
      filter-input, filter-forward, filter-output (filter) -> for new connections nat
        did not capture: @unserved (reject: no endpoints; drop: Local policy without a
        local endpoint, or outside the source ranges), @unserved-nodeports, and a
        reject of every other port of a cluster IP (@cluster-ips)
    ip sliceproxy-<i>, i < K (shard: the service ports whose name hashes to i)
      nat-prerouting, nat-output (nat, dstnat) -> services
        services    ip daddr . meta l4proto . th dport vmap @service-ips
      nodeport-prerouting, nodeport-output (nat, dstnat + 1) -> nodeports
        nodeports   [fib daddr type local | ip daddr @nodeport-ips]
                        meta l4proto . th dport vmap @service-nodeports
      pick-<n>      for n = 1..PICK_MAX, the chain of every picked port of n endpoints:
                    `counter name ip daddr . meta l4proto . th dport map @port-counters`,
                    the masquerade mark for off-cluster clients, then per protocol
                    `meta l4proto tcp dnat ip to ip daddr . tcp dport . numgen random
                    mod n map @eps-tcp-<n>`
      eps-<p>-<n>   cluster IP . port . slot (0..n-1) -> endpoint address . port, for the
                    picked ports of protocol p and n endpoints (`th dport` would serve
                    every protocol, but nft 1.0.6 then refuses any script over the map)
      port-counters cluster IP . protocol . port -> the picked port's named counter
      svc-<h>       Cluster-policy endpoints: the masquerade mark for off-cluster clients
                    of the cluster IP, affinity, then one `numgen random mod k 0` DNAT
                    rule per endpoint (1/n, 1/(n-1), ... the last always); from
                    SLOT_MAP_MIN endpoints on (no affinity), one rule
                    `dnat to numgen random mod n map @slots-svc-<h>` instead
      svl-<h>       Local-policy endpoints, the same shape
      slots-svc-<h> slot (0..n-1) -> endpoint address . port, for a port that large
      tail-svc-<h>  from SPLIT_MIN endpoints on, the last few slots (a chain and a map:
                    slot_tail.py), so that a change of n rebinds a small map
      hash-svc-<h>  with maglev or source-hash balancing: slot (0..M-1) -> endpoint
                    address . port, Maglev's table; the chain's one rule is
                    `dnat to jhash <source> mod M seed HASH_SEED map @hash-svc-<h>`
      hashv-svc-<h> the same table of `goto ep-<h>` where the endpoints have chains
                    (affinity, or counted each): `jhash ... vmap @hashv-svc-<h>`
      ext-<h>       external traffic (NodePort, externalIP, LB IP) -> policy chain
      fw-<h>        loadBalancerSourceRanges in front of ext-<h>
      ep-<h>        one per endpoint, with ClientIP affinity (remember, DNAT) or where a
                    hash map picks an endpoint counted on its own (count, DNAT)

Why shards: the kernel checks a whole table (every chain reachable from its base chains)
whenever a transaction adds a rule or a jump to it, so one change in a table of 10,000
services cost 53 ms of kernel time, and 0.1 ms in a small table beside it (bench/
RESULTS.md). K grows with the number of service ports (SHARD_PORTS each), so a change
costs about the same at 1,000 services as at 50,000. The price: a new connection that
is for no service passes each shard's two nat chains (one map lookup each, and a fib
lookup for the node ports). The node-port chains run after every shard's service
chain (priority dstnat + 1), as upstream's nodeports jump comes last: a destination
that is both a service IP:port and a node port goes to the service, whatever the shards.

Why picked ports (no chain of their own): every nf_tables commit visits every chain of
every table in the network namespace (~0.25 µs a chain), and a rule with a DNAT makes
the kernel validate its whole table: with a chain per port, one change cost the kernel
26 ms at 100,000 ports, and a load 22 s of kernel CPU. A port reached by its cluster IP
alone (no NodePort, external or LB IP), balanced at random without affinity or counters
per endpoint, with 1 to PICK_MAX endpoints is map elements only: its
dispatch to its shard's `pick-<n>`, its endpoints in `eps-<p>-<n>` by slot (each keeps its
slot while n stays: `assign_slots`), its counter in `port-counters`. A change of its
endpoints is elements, no rule: 0.37 ms of kernel at 100,000 ports, and a load 5.7 s
of kernel CPU (bench/nftables/layout_cost.py). Anything else a port does (node ports, external
addresses, policies beyond the internal one, affinity, hashing, counting endpoints one
by one) keeps the chains below.

Why no set per service: the kernel keeps a table's sets in a list, so a set per service
makes a full load quadratic (10,000 services: 10.5 s with one anonymous numgen map per
service, 2.9 s with these rules and no per-service set). Each dispatch is one
verdict-map lookup instead of iptables' linear SPX-SERVICES walk.

Why a slot map for large ports: a change to the cascade rewrites the whole chain (10,000
endpoints: 10,000 rules, about 0.2 s of kernel time per change, every change of a rolling
update). In the slot map an endpoint keeps its slot (`assign_slots`), so one endpoint
gone or added changes one or two elements and the one rule that holds n (and when the
model says which endpoints changed, port_edit.py renders only those: O(change) in
Python). Small ports keep the cascade: a map is a set, and sets are what makes a large
table slow to load.
ClientIP affinity keeps it too: its per-endpoint checks are one rule per endpoint anyway.

Why jhash of the source for maglev and source-hash (model/balancing.py): the same flow
must reach the same endpoint from every node and after its conntrack entry is lost.
The table depends on the endpoints alone, and the kernel's jhash with a fixed seed
(never nft's default, a random one per rule) on the packet alone. maglev hashes the
source address and port, source-hash the source address only. Not the destination: a
policy chain serves one service port, so its address and port say nothing a chain does
not already know, and they differ between nodes for the same flow where it matters
(a NodePort is the node's own address: an ECMP'd load balancer sending a flow's packets
to two nodes would see two endpoints). A change of endpoints computes the table again
(O(M), 1.6 ms at M = 4093: port_edit.py) and writes the slots whose endpoint changed,
element by element, and the rule only when M moves to another rung.

Hairpin (a pod reaching itself through its service) is one set of `addr . addr` pairs,
looked up after DNAT in postrouting, instead of a chain per endpoint as upstream: the
endpoint chain is needed only to remember ClientIP affinity, or to count a hashed pick.

Names in the ruleset are hashes of what the object is for (service port, protocol,
endpoint), never of user text; the one comment per DNAT rule is reduced to printable
ASCII without quotes or backslashes, so no string from the API can change the script.

The semantics are those of the iptables renderer (iptables/render.py), with these
differences: health-check node ports and forwarding get no ACCEPT rules (an accept in
our table does not overrule another table's drop, so they would change nothing), and
other ports of a cluster IP are rejected, as upstream's nftables mode does.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from proxy.dataplane.common import naming
from proxy.dataplane.common.context import RenderContext, cluster_ip_masquerade
from proxy.dataplane.common.naming import address_text, name_hash, packed_text, port_name
from proxy.dataplane.common.paths import PortPlan, plan, sorted_nets
from proxy.dataplane.common.traffic import per_endpoint
from proxy.dataplane.modes import NFTABLES
from proxy.dataplane.nftables.marks import spelled
from proxy.dataplane.nftables.objects import (
    AnySet,
    Chain,
    Command,
    CounterRef,
    Element,
    Hook,
    Key,
    Map,
    PickMap,
    Priority,
    Set,
    SlotMap,
    Value,
    Verdict,
)
from proxy.dataplane.nftables.slot_tail import TAIL_PREFIX, main_size, tail_rule
from proxy.model.balancing import Backend, maglev_table
from proxy.model.frozen import fast_init
from proxy.model.snapshot import ResolvedServicePort, SelectedEndpoint
from proxy.model.types import (
    DEFAULT_AFFINITY_TIMEOUT,
    Balancing,
    Family,
    IPAddress,
    IPNetwork,
    Protocol,
    ServicePortKey,
)

# Our tables' names (the main one and the shards) are declared with the mode (modes.py),
# where another mode's leftovers' probe reads them.
TABLE = NFTABLES.markers.table
MASQ_MARK = f"{naming.MASQ_BIT:#010x}"  # as nft prints it
V = TypeVar("V", bound=Hashable)  # a slot's value (assign_slots)

# Sets and maps every port adds elements to (the base declares them).
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
UNSERVED = "unserved"
UNSERVED_NODEPORTS = "unserved-nodeports"
CLUSTER_IPS = "cluster-ips"
HAIRPIN = "hairpin"
NODEPORT_IPS = "nodeport-ips"
PORT_COUNTERS = "port-counters"  # a picked port's key -> its named counter
SHARED_SETS = (SERVICE_IPS, SERVICE_NODEPORTS, UNSERVED, UNSERVED_NODEPORTS, CLUSTER_IPS,
               HAIRPIN, PORT_COUNTERS)
# In each shard; the others in the main table.
SHARD_SETS = (SERVICE_IPS, SERVICE_NODEPORTS, PORT_COUNTERS)
# One element per port: a 128-bit digest of everything else it writes (`fingerprint`),
# written in the same transaction as what it stands for (restart.py reads them back),
# in every table: see `mark_element`.
FINGERPRINTS = "fingerprints"
SHARD_PORTS = 1000  # service ports per shard, about (module docstring)
MAX_SHARDS = NFTABLES.markers.table_shards

# Endpoints from which a policy chain balances through a slot map (module docstring).
SLOT_MAP_MIN = 128
# A picked port (no chain of its own, module docstring) has 1 to PICK_MAX endpoints: each
# shard declares a pick chain and map per count, and every commit visits every chain
# (a change at 100,000 services, 64 shards: 0.37 ms of kernel with 32, 1.1 ms with 127).
PICK_MAX = 32
PICK = "pick-"  # pick-<n>: the chain of a shard's picked ports of n endpoints
PICKS = "eps-"  # eps-<protocol>-<n>: its pick maps
SLOTS = "slots-"  # the slot maps' prefix: slots-<policy chain>
HASHED = "hash-"  # Maglev tables' prefix: hash-<policy chain>
HASHED_VERDICTS = "hashv-"  # Maglev tables of endpoint chains (affinity, counting)
# jhash's seed, the same on every node (module docstring); nft's default is random.
HASH_SEED = 0x5A175EED

MARK_FOR_MASQUERADE = "mark-for-masquerade"
MASQ_UNLESS_POD = "masq-unless-pod"
REJECT = "reject-chain"
REJECT_VERDICT = Verdict("goto", REJECT)
DROP_VERDICT = Verdict("drop")


def table_family(family: Family) -> str:
    return "ip" if family is Family.V4 else "ip6"


def shard_table(index: int) -> str:
    return _SHARD_TABLES[index]


def our_tables() -> tuple[str, ...]:
    """Every table name this mode may use (per family)."""
    return NFTABLES.markers.tables()


OUR_TABLES = frozenset(our_tables())
# One string per shard table, which every port of the shard shares (kept by each port).
_SHARD_TABLES = tuple(NFTABLES.markers.shard_table(i)
                      for i in range(NFTABLES.markers.table_shards))


def shards_for(ports: int) -> int:
    """How many shards `ports` service ports need: a power of two, so that growing
    doubles K instead of moving most ports."""
    k = 1
    while k * SHARD_PORTS < ports and k < MAX_SHARDS:
        k *= 2
    return k


def shard_of(key: ServicePortKey, shards: int) -> str:
    """The shard table of a service port: a hash of its name, stable across restarts."""
    return shard_table(int(name_hash(port_name(key))[:8], 16) % shards)


def _addr_type(family: Family) -> str:
    return "ipv4_addr" if family is Family.V4 else "ipv6_addr"


# A picked port's elements of its pick maps, grouped: (map, key but for the slot, values
# in slot order, flat: address, port, address, ...) per (cluster IP, port).
Picked = tuple[tuple[str, Key, tuple[object, ...]], ...]


@fast_init
@dataclass(frozen=True, slots=True)
class PortObjects:
    """Everything one service port (in one family) owns or adds."""

    key: ServicePortKey
    table: str  # its shard: where its chains, sets and map elements are
    # Chains owned by this port alone, in write order.
    chains: tuple[Chain, ...]
    # Its elements in the shared sets and maps.
    elements: tuple[Element, ...]
    # Sets and maps owned by this port alone (ClientIP affinity, slot maps).
    sets: tuple[Set | SlotMap, ...] = ()
    # Its slot maps' values in slot order, by map (also among `elements`).
    slots: tuple[tuple[str, tuple[Key, ...]], ...] = ()
    # Its named counters (common/traffic.py), each with the endpoint (address, port) it
    # counts, or None: the port's own, which every new connection of the port passes.
    counters: tuple[tuple[str, tuple[IPAddress, int] | None], ...] = ()
    # Its elements of @fingerprints (also among `elements`, marks.py): `fingerprint`,
    # and its input mark where one was added (restart.with_input_mark).
    fingerprint: Key = ()
    input_mark: Key = ()
    # Whether what it writes is what its input alone renders: no earlier slot kept.
    from_input: bool = True
    # A picked port's elements of its pick maps (also among `elements`), as its kept
    # state holds them (transaction.KeptPort.picked), made as they are rendered:
    # grouped again from `elements`, element by element, they were two thirds of
    # keeping a port, and a third of recording its owners.
    picked: Picked = ()

    def lines(self, family: Family) -> list[str]:
        """Readable, copy-pasteable `nft` lines for the debug dump (the fingerprint is
        bookkeeping, left out)."""
        ip = table_family(family)
        t = f"{ip} {self.table}"
        out = [f"add element {ip} {e.table} {e.set} {{ {e.text()} }}" for e in self.elements
               if e.set != FINGERPRINTS]
        out += [line for s in self.sets for line in Command("add", self.table, s).lines(ip)]
        out += [f"add counter {t} {name}" for name, _ in self.counters]
        return [*out, *naming.chain_lines(((c.name, c.rules) for c in self.chains),
                                          f"add chain {t}", f"add rule {t}")]


@dataclass(frozen=True, slots=True)
class BaseObjects:
    """What does not depend on any service: declarations, fixed chains, node addresses."""

    family: Family
    table: str
    sets: tuple[AnySet, ...]
    chains: tuple[Chain, ...]  # base chains (with a hook) and regular ones
    # Elements of sets only the base fills (NodePort addresses), and its fingerprint.
    elements: tuple[Element, ...] = field(default=())
    fingerprint: Key = ()

    @classmethod
    def of(cls, family: Family, table: str, sets: Sequence[AnySet], chains: Sequence[Chain],
           elements: Sequence[Element]) -> BaseObjects:
        """With its element of @fingerprints, as a port's."""
        sets = (*sets, Set(FINGERPRINTS, FINGERPRINTS_TYPES[family]))
        mark = fingerprint(family, (table,), chains, elements, sets)
        return cls(family, table, tuple(sets), tuple(chains),
                   (*elements, mark_element(table, mark)), mark)


def mark_element(table: str, mark: Key) -> Element:
    """The element of @fingerprints that stands for a port or base of `table`: each
    table holds its own, so no set is large (nf_tables' dump of a set's elements walks
    it from its start for every message it fills: a restart read 100,000 in 0.25 s of
    kernel time, 64 sets of 1,600 in a few ms)."""
    return Element(table, FINGERPRINTS, mark)


# --- the fixed part --------------------------------------------------------------------------


def _node_destination(ctx: RenderContext) -> tuple[str, list[Set], list[str]]:
    """The match for "addressed to this node" (NodePorts): its text, the set it needs
    and that set's elements."""
    ip, addr = table_family(ctx.family), _addr_type(ctx.family)
    if ctx.nodeport_ips is None:
        loopback = "127.0.0.0/8" if ctx.family is Family.V4 else "::1"
        return f"fib daddr type local {ip} daddr != {loopback}", [], []
    return (f"{ip} daddr @{NODEPORT_IPS}", [Set(NODEPORT_IPS, (addr,))],
            [_text(a) for a in sorted(set(ctx.nodeport_ips))])


PORTS = "meta l4proto . th dport"


def _verdict_maps(addr: str, by_address: str, by_port: str) -> list[Map]:
    """A verdict map keyed by address . protocol . port, and one by protocol . port
    (node ports): how the dispatch maps and the unserved maps are both declared."""
    return [Map(by_address, (addr, "inet_proto", "inet_service"), "verdict"),
            Map(by_port, ("inet_proto", "inet_service"), "verdict")]


def _hook(kind: str, hook: str, priority: str, offset: int = 0) -> Hook:
    return Hook(kind, hook, Priority(priority, offset))


def render_base(ctx: RenderContext) -> BaseObjects:
    """The main table: masquerading, and the filter chains for what nat did not take."""
    family = ctx.family
    ip = table_family(family)
    addr = _addr_type(family)
    node_dest, node_sets, node_ips = _node_destination(ctx)
    sets: list[AnySet] = [
        *_verdict_maps(addr, UNSERVED, UNSERVED_NODEPORTS),
        Set(CLUSTER_IPS, (addr,)),
        Set(HAIRPIN, (addr, addr)),
        *node_sets,
    ]
    new = "ct state new"
    chains = [
        Chain(REJECT, ("reject",)),
        Chain("masquerading", (
            # After DNAT the destination is the endpoint: a source equal to it is a pod
            # (or host-network endpoint) reaching itself, whose reply must come back
            # through us.
            f"ct status dnat {ip} saddr . {ip} daddr @{HAIRPIN} masquerade fully-random",
            f"meta mark & {MASQ_MARK} == 0 return",
            # Clear the bit so a packet re-entering netfilter is not masqueraded twice.
            f"meta mark set meta mark ^ {MASQ_MARK}",
            "masquerade fully-random",
        )),
        Chain("unserved-check", (
            f"{ip} daddr . {PORTS} vmap @{UNSERVED}",
            f"{ip} daddr @{CLUSTER_IPS} goto {REJECT}",
        )),
        Chain("unserved-nodeport-check", (f"{node_dest} {PORTS} vmap @{UNSERVED_NODEPORTS}",)),
        Chain("nat-postrouting", ("jump masquerading",),
              _hook("nat", "postrouting", "srcnat")),
        Chain("filter-input", (f"{new} jump unserved-nodeport-check", f"{new} jump unserved-check"),
              _hook("filter", "input", "filter")),
        Chain("filter-forward", (f"{new} jump unserved-nodeport-check",
                                 f"{new} jump unserved-check"),
              _hook("filter", "forward", "filter")),
        Chain("filter-output", (f"{new} jump unserved-check",),
              _hook("filter", "output", "filter")),
    ]
    elements = [Element(TABLE, NODEPORT_IPS, (a,)) for a in node_ips]
    return BaseObjects.of(family, TABLE, sets, chains, elements)


def render_shard(ctx: RenderContext, table: str) -> BaseObjects:
    """What every shard table holds besides its service ports: the dispatch maps and
    the nat chains that look them up."""
    family = ctx.family
    ip = table_family(family)
    addr = _addr_type(family)
    node_dest, node_sets, node_ips = _node_destination(ctx)
    sets: list[AnySet] = [*_verdict_maps(addr, SERVICE_IPS, SERVICE_NODEPORTS), *node_sets,
                          Map(PORT_COUNTERS, (addr, "inet_proto", "inet_service"), "counter"),
                          *(PickMap(pick_map(proto, n), family, proto)
                            for n in range(1, PICK_MAX + 1) for proto in PICK_PROTOCOLS)]
    chains = [
        Chain(MARK_FOR_MASQUERADE, (f"meta mark set meta mark | {MASQ_MARK}",)),
        Chain("services", (f"{ip} daddr . {PORTS} vmap @{SERVICE_IPS}",)),
        Chain("nodeports", (f"{node_dest} {PORTS} vmap @{SERVICE_NODEPORTS}",)),
        Chain("nat-prerouting", ("jump services",), _hook("nat", "prerouting", "dstnat")),
        Chain("nat-output", ("jump services",), _hook("nat", "output", "", -100)),
        # After every shard's services chain (module docstring).
        Chain("nodeport-prerouting", ("jump nodeports",),
              _hook("nat", "prerouting", "dstnat", 1)),
        Chain("nodeport-output", ("jump nodeports",), _hook("nat", "output", "", -99)),
    ]
    chains += [Chain(f"{PICK}{n}", _pick_rules(ctx, ip, n)) for n in range(1, PICK_MAX + 1)]
    if len(ctx.local_cidrs) > 1 and not ctx.masquerade_all:
        chains.insert(1, Chain(MASQ_UNLESS_POD, (
            *(f"{ip} saddr {c} return" for c in sorted_nets(ctx.local_cidrs)),
            f"jump {MARK_FOR_MASQUERADE}")))
    elements = [Element(table, NODEPORT_IPS, (a,)) for a in node_ips]
    return BaseObjects.of(family, table, sets, chains, elements)


# Every protocol a service port may have, as nft spells it: a pick map for each.
PICK_PROTOCOLS = tuple(p.value.lower() for p in Protocol)


@functools.cache  # a few names, each kept by every picked port of its count
def pick_map(protocol: str, n: int) -> str:
    """The pick map of a shard's picked ports of `protocol` and n endpoints."""
    return f"{PICKS}{protocol}-{n}"


@functools.cache
def _goto_pick(n: int) -> Verdict:
    """The dispatch of a picked port of n endpoints: one object for all (each port's
    element keeps it)."""
    return Verdict("goto", f"{PICK}{n}")


def _pick_rules(ctx: RenderContext, ip: str, n: int) -> tuple[str, ...]:
    """A pick chain's rules, the same for every picked port of n endpoints in the shard:
    count the connection into the port's counter, mark off-cluster clients for
    masquerade (cluster_masquerade, without the address and port: only the cluster IP
    leads here), then one of the port's n endpoints, in its protocol's pick map."""
    masq = cluster_ip_masquerade(ctx, lambda pods: f"{ip} saddr != {pods} ", MASQ_UNLESS_POD,
                                 MARK_FOR_MASQUERADE)
    return (f"counter name {ip} daddr . meta l4proto . th dport map @{PORT_COUNTERS}",
            *((f"{masq[0]}jump {masq[1]}",) if masq else ()),
            *(f"meta l4proto {p} dnat {ip} to {ip} daddr . {p} dport . numgen random mod {n} "
              f"map @{pick_map(p, n)}" for p in PICK_PROTOCOLS))


# --- names and small helpers ---------------------------------------------------------------


def port_chain(kind: str, key: ServicePortKey, protocol: str) -> str:
    """Stable across restarts: a hash of what the chain is for, never of its content."""
    return _port_named(kind, port_hash(key, protocol))


def port_hash(key: ServicePortKey, protocol: str) -> str:
    """What every chain and counter of a port is named by (`port_chain`), its kind aside."""
    return name_hash(port_name(key), protocol)


def _port_named(kind: str, hashed: str) -> str:
    return f"{kind}-{hashed}"


def endpoint_object(kind: str, key: ServicePortKey, protocol: str, endpoint: str) -> str:
    return f"{kind}-{name_hash(port_name(key), protocol, endpoint)}"


_UNSAFE = re.compile(r'[^\x20-\x7e]|["\\]')
COMMENT_MAX = 128  # nft keeps rule comments in 256 bytes of user data; stay well inside


def comment(text: str) -> str:
    return f'comment "{_UNSAFE.sub("?", text)[:COMMENT_MAX]}"'


_text = address_text


# --- one service port ------------------------------------------------------------------------


@dataclass(slots=True)
class _PortBuild:
    """One port's objects as `render_port` collects them, in kernel write order."""

    key: ServicePortKey
    table: str
    ip: str  # "ip" or "ip6"
    proto: str  # "tcp", "udp", "sctp"
    hashed: str  # port_hash: what its chains are named by, made once
    elements: dict[str, dict[Key, Value]] = field(default_factory=dict)  # by set
    chains: list[Chain] = field(default_factory=list)
    sets: list[Set | SlotMap] = field(default_factory=list)
    slot_elements: list[Element] = field(default_factory=list)
    slot_values: list[tuple[str, tuple[Key, ...]]] = field(default_factory=list)
    picked: list[tuple[str, Key, tuple[object, ...]]] = field(default_factory=list)  # as Picked
    counters: dict[str, tuple[IPAddress, int] | None] = field(default_factory=dict)

    def chain(self, kind: str) -> str:
        """`port_chain(kind, key, proto)`: its chain, or its counter, of that kind."""
        return _port_named(kind, self.hashed)

    def count(self, name: str, endpoint: tuple[IPAddress, int] | None) -> str:
        """The statement counting into the named counter `name`, which this port owns."""
        self.counters[name] = endpoint
        return count_statement(name)

    def element(self, set_name: str, k: Key, value: Value = ()) -> None:
        members = self.elements.get(set_name)
        if members is None:
            members = self.elements[set_name] = {}
        members.setdefault(k, value)

    def objects(self, from_input: bool) -> PortObjects:
        """Its elements by set, then key (sorted: the same port renders the same), with
        its fingerprint; `from_input`: whether no earlier slot was kept (marks.py)."""
        elements = []
        for s in sorted(self.elements):
            table, members = element_table(s, self.table), self.elements[s]
            elements += [Element(table, s, k, members[k]) for k in sorted(members)]
        chains, sets = tuple(self.chains), tuple(self.sets)
        counters, picked = tuple(self.counters.items()), tuple(self.picked)
        # A picked port's slot elements are its pick maps' (`picked` spells them whole).
        mark = fingerprint(self.key.family, (*self.key, self.table), chains,
                           elements if picked else [*elements, *self.slot_elements], sets,
                           counters, picked)
        elements += self.slot_elements
        elements.append(mark_element(self.table, mark))
        return PortObjects(self.key, self.table, chains, tuple(elements), sets,
                           tuple(self.slot_values), counters, mark, from_input=from_input,
                           picked=picked)


def fingerprint(family: Family, owner: tuple[object, ...], chains: Sequence[Chain],
                elements: Sequence[Element], sets: Sequence[AnySet] = (),
                counters: Sequence[object] = (), picked: Picked = ()) -> Key:
    """128 bits of BLAKE2b over what a port or base (`owner`: its key and table) writes,
    spelled as an element of @fingerprints: four IPv4 addresses or one IPv6 address. The
    same on any process and version that renders the same (never Python's per-process
    `hash`). Hashed as the str of every part, joined by a byte no rule or name holds
    (comments are printable ASCII, `comment`): the repr of the objects, in Python for a
    NamedTuple, was a fifth of a port's render. The elements' parts (most of them, most
    already text) are made text as they are listed: a second pass of `str` over them
    was a third of the fingerprint. A picked port's pick-map elements come as `picked`
    (PortObjects.picked), not among `elements`: a group's values in slot order say
    what its elements do, from about half the parts."""
    flat: list[object] = [*owner]
    for c in chains:
        flat.append(c.name)
        flat.extend(c.rules)
        flat.append(c.hook)
    parts = [x if type(x) is str else str(x)
             for e in elements for x in (e.set, *e.key, ":", *e.value, ";")]
    rest = [x for s in sets for x in (type(s).__name__, *s)]
    for name, (at, port), values in picked:
        rest += (PICKS, name, at, port, *values)
    text = "\x1f".join([*map(str, flat), *parts, *map(str, rest), *map(str, counters)])
    return spelled(family, hashlib.blake2b(text.encode(), digest_size=16).digest())


# @fingerprints' key: 128 bits in either family.
FINGERPRINTS_TYPES = {Family.V4: ("ipv4_addr",) * 4, Family.V6: ("ipv6_addr",)}


def render_port(rsp: ResolvedServicePort, ctx: RenderContext, shards: int = 1,
                slots: Mapping[str, Sequence[Key]] | None = None) -> PortObjects:
    """The chains and elements of one service port (the iptables renderer's semantics),
    in its shard of `shards`. `slots`: what the kernel's slot maps hold of this port
    (map -> endpoints in slot order), so that endpoints keep their slots
    (`assign_slots`); then it is not `from_input` (marks.py)."""
    key = rsp.key
    proto = rsp.port.protocol.value.lower()
    build = _PortBuild(key, shard_of(key, shards), table_family(key.family), proto,
                       port_hash(key, proto))
    p = plan(rsp, build.chain)
    picked = _picked(rsp, ctx, p)
    if picked:
        return build.objects(_pick(build, rsp, picked, slots))
    _dispatch(build, rsp, p)
    if p.ext:
        build.chains.append(Chain(p.ext, _external_rules(build.ip, ctx, p.external_local,
                                                         p.svc, p.external_policy)))
    if p.fw and p.ext:
        build.chains.append(Chain(p.fw, _firewall_rules(build.ip, ctx, p.ranges, p.lb_ips,
                                                        p.ext)))
    texts, addrs = _endpoint_texts(build, (*p.cluster_eps, *p.local_eps), key.family)
    label = comment(port_name(key))
    # Endpoints are counted one by one where a rule or a chain of their own picks them (a
    # cascade, affinity's chains, a hash map of chains); a random slot map's pick is
    # counted as the port's alone.
    hashed = rsp.balancing is not Balancing.RANDOM
    affinity = rsp.service.affinity_timeout
    own_pick = hashed or affinity is not None \
        or max(len(p.cluster_eps), len(p.local_eps)) < SLOT_MAP_MIN
    counts = _endpoint_counters(build, (*p.cluster_eps, *p.local_eps), texts) \
        if own_pick and per_endpoint(rsp.service, ctx.traffic_per_endpoint) else {}
    ep_chains = _endpoint_chains(build, affinity, texts, label, counts,
                                 hashed and bool(counts))
    for policy_chain, eps in ((p.svc, p.cluster_eps), (p.svl, p.local_eps)):
        if policy_chain:
            build.count(build.chain("cnt"), None)
            first = policy_first(rsp, ctx, policy_chain == p.internal)
            if hashed and eps:
                _hashed_chain(build, policy_chain, eps, first, (addrs, ep_chains), label,
                              rsp.balancing, affinity is not None)
                continue
            _policy_chain(build, policy_chain, eps, first, (texts, addrs, ep_chains), label,
                          slots, counts)
    return build.objects(not slots)


def _picked(rsp: ResolvedServicePort, ctx: RenderContext, p: PortPlan
            ) -> tuple[SelectedEndpoint, ...]:
    """The endpoints of a port its shard's pick chain balances (no chain of its own:
    module docstring), or () if it needs one: reached by its cluster IP alone, random
    balancing without affinity or per-endpoint counters, 1 to PICK_MAX endpoints."""
    if rsp.balancing is not Balancing.RANDOM or rsp.service.affinity_timeout is not None \
            or rsp.port.node_port or p.external_ips or p.lb_ips or p.internal is None \
            or per_endpoint(rsp.service, ctx.traffic_per_endpoint):
        return ()
    eps, other = (p.cluster_eps, p.svl) if p.internal == p.svc else (p.local_eps, p.svc)
    if other is not None or (
            len(eps) > PICK_MAX and len({(ep.packed, ep.port) for ep in eps}) > PICK_MAX):
        return ()
    return eps


def _pick(build: _PortBuild, rsp: ResolvedServicePort, eps: Sequence[SelectedEndpoint],
          slots: Mapping[str, Sequence[Key]] | None) -> bool:
    """A picked port: each cluster IP's dispatch to the shard's pick chain of its count,
    its counter map element, and its endpoints in the pick map, each keeping its slot
    (`assign_slots`) while the count stays. Whether the slots are those its input alone
    gives (marks.py)."""
    proto, port = build.proto, rsp.port.port
    addrs = _endpoint_addresses(build, eps)
    values = list(dict.fromkeys([slot_value(addrs[id(ep)], ep.port) for ep in eps]))
    picks = pick_map(proto, len(values))
    assigned = tuple(assign_slots(values, (slots or {}).get(picks, ())))
    build.slot_values.append((picks, assigned))
    counter = build.chain("cnt")
    build.count(counter, None)
    goto = _goto_pick(len(values))
    flat = tuple(itertools.chain.from_iterable(assigned))
    for destination in destinations(rsp):  # one key for both maps' elements
        at = destination[0]
        build.element(CLUSTER_IPS, (at,))
        build.element(SERVICE_IPS, destination, goto)
        build.element(PORT_COUNTERS, destination, CounterRef(counter))
        build.slot_elements += [Element(build.table, picks, (at, port, i), v)
                                for i, v in enumerate(assigned)]
        build.picked.append((picks, (at, port), flat))
    return list(assigned) == values


Destination = tuple[str, str, int]  # a cluster IP's key in the dispatch maps


def destinations(rsp: ResolvedServicePort) -> list[Destination]:
    """The port's cluster IPs as its keys in the dispatch maps: (address, protocol,
    port)."""
    proto, port = rsp.port.protocol.value.lower(), rsp.port.port
    return [(_text(a), proto, port) for a in rsp.cluster_ips]


def count_statement(name: str) -> str:
    """A rule's statement counting the packet into the named counter `name`."""
    return f'counter name "{name}"'


def port_counter(key: ServicePortKey, protocol: str) -> str:
    """The named counter of a service port's new connections (common/traffic.py)."""
    return port_chain("cnt", key, protocol)


def policy_first(rsp: ResolvedServicePort, ctx: RenderContext, internal: bool
                 ) -> tuple[str, ...]:
    """What a policy chain does before it picks an endpoint: count the connection as the
    port's, then (on the path cluster-IP traffic takes) mark off-cluster clients for
    masquerade."""
    ip, proto = table_family(rsp.key.family), rsp.port.protocol.value.lower()
    count = count_statement(port_counter(rsp.key, proto))
    return (count, *cluster_masquerade(rsp, ctx, ip, proto)) if internal else (count,)


def _endpoint_counters(build: _PortBuild, eps: Sequence[SelectedEndpoint],
                       texts: Mapping[int, str]) -> dict[str, str]:
    """Per endpoint (by its DNAT target's text): the statement counting into its own
    named counter, which the port owns (common/traffic.py)."""
    counts: dict[str, str] = {}
    for ep in eps:
        text = texts[id(ep)]
        if text not in counts:
            name = endpoint_object("cep", build.key, build.proto, text)
            counts[text] = build.count(name, (ep.address, ep.port))
    return counts


def _dispatch(build: _PortBuild, rsp: ResolvedServicePort, p: PortPlan) -> None:
    """The port's entries in the shared verdict maps: each address (and the NodePort)
    to its chain, or to what happens when nothing serves it."""
    port, proto = rsp.port, build.proto
    # Traffic nat did not capture: rejected when nothing serves the port anywhere,
    # dropped when only the policy keeps it from the endpoints that exist.
    unserved = REJECT_VERDICT if not p.has_endpoints else DROP_VERDICT

    def dest(a: IPAddress) -> Key:
        return (_text(a), proto, port.port)

    for a in rsp.cluster_ips:
        at = _text(a)
        build.element(CLUSTER_IPS, (at,))
        if p.internal:
            build.element(SERVICE_IPS, (at, proto, port.port), Verdict("goto", p.internal))
        else:
            build.element(UNSERVED, (at, proto, port.port), unserved)
    external_unserved = not p.external_policy or not p.has_endpoints
    for ips, target in ((p.external_ips, p.ext), (p.lb_ips, p.fw or p.ext)):
        for a in ips:
            if target:
                build.element(SERVICE_IPS, dest(a), Verdict("goto", target))
            if external_unserved:
                build.element(UNSERVED, dest(a), unserved)
    if p.fw:
        # Allowed sources were DNATed by fw-<h>; what still has the LB IP was refused.
        for a in p.lb_ips:
            build.element(UNSERVED, dest(a), DROP_VERDICT)
    if port.node_port:
        nport = (proto, port.node_port)
        if p.ext:
            build.element(SERVICE_NODEPORTS, nport, Verdict("goto", p.ext))
        if external_unserved:
            build.element(UNSERVED_NODEPORTS, nport, unserved)


def cluster_masquerade(rsp: ResolvedServicePort, ctx: RenderContext, ip: str,
                        proto: str) -> tuple[str, ...]:
    """Off-cluster clients of a cluster IP may be answered from another node: the rules,
    first in the internal path's chain, that mark them for masquerade."""
    masq = cluster_ip_masquerade(ctx, lambda pods: f"{ip} saddr != {pods} ", MASQ_UNLESS_POD,
                                 MARK_FOR_MASQUERADE)
    if masq is None:
        return ()
    source, target = masq
    return tuple(f"{ip} daddr {_text(a)} {proto} dport {rsp.port.port} {source}jump {target}"
                 for a in rsp.cluster_ips)


def _endpoint_texts(build: _PortBuild, eps: Sequence[SelectedEndpoint],
                    family: Family) -> tuple[dict[int, str], dict[int, str]]:
    """Each endpoint's DNAT target (address:port) and address (`_endpoint_addresses`),
    by the endpoint object's id."""
    addrs = _endpoint_addresses(build, eps)
    if family is Family.V6:
        return {id(ep): f"[{addrs[id(ep)]}]:{ep.port}" for ep in eps}, addrs
    return {id(ep): f"{addrs[id(ep)]}:{ep.port}" for ep in eps}, addrs


def _endpoint_addresses(build: _PortBuild, eps: Sequence[SelectedEndpoint]
                        ) -> dict[int, str]:
    """Each endpoint's address, by the endpoint object's id, and its hairpin element. By
    id: the cluster and local sets hold the same objects, and hashing a SelectedEndpoint
    (all its fields, the address's hash in Python) for every endpoint was a third of
    rendering a large service."""
    addrs: dict[int, str] = {}
    hairpin = build.elements.setdefault(HAIRPIN, {})
    for ep in eps:
        if id(ep) not in addrs:
            at = addrs[id(ep)] = packed_text(ep.packed)
            hairpin.setdefault(hairpin_element(at), ())
    return addrs


def _endpoint_chains(build: _PortBuild, affinity: int | None, texts: Mapping[int, str],
                     label: str, counts: Mapping[str, str], wanted: bool) -> dict[int, str]:
    """One chain per endpoint text (equal endpoints share it), in text order, where the
    pick goes through one: with ClientIP affinity (and a timeout set each, which the
    chain updates), or when `wanted` (a hash map of verdicts whose endpoints are
    counted); the chain of each endpoint, by id."""
    if affinity is None and not wanted:
        return {}
    address_type = _addr_type(build.key.family)
    chain_of: dict[str, str] = {}
    for text in sorted(set(texts.values())):
        chain = chain_of[text] = endpoint_object("ep", build.key, build.proto, text)
        count = f"{counts[text]} " if text in counts else ""
        dnat = f"{count}meta l4proto {build.proto} dnat to {text} {label}"
        if affinity is None:
            build.chains.append(Chain(chain, (dnat,)))
            continue
        aff = _affinity_set(chain)
        build.sets.append(Set(aff, (address_type,), ("dynamic", "timeout"),
                              affinity or DEFAULT_AFFINITY_TIMEOUT))
        build.chains.append(Chain(chain, (f"update @{aff} {{ {build.ip} saddr }}", dnat)))
    return {i: chain_of[text] for i, text in texts.items()}


def _policy_chain(build: _PortBuild, chain: str, eps: Sequence[SelectedEndpoint],
                  first: tuple[str, ...],
                  spelled: tuple[Mapping[int, str], Mapping[int, str], Mapping[int, str]],
                  label: str, slots: Mapping[str, Sequence[Key]] | None,
                  counts: Mapping[str, str]) -> None:
    """A path's chain: `first` (policy_first), then the endpoints, as a cascade
    (affinity, or few endpoints) or one numgen lookup in a slot map (`assign_slots`;
    its endpoints are not counted one by one)."""
    texts, addrs, ep_chains = spelled
    ip, proto = build.ip, build.proto
    if ep_chains or len(eps) < SLOT_MAP_MIN:
        build.chains.append(Chain(chain, (*first, *_balance(ip, proto, eps, texts, ep_chains,
                                                             label, counts))))
        return
    slot_map, tail_map = SLOTS + chain, TAIL_PREFIX + chain
    kept = slots or {}
    kept_main = kept.get(slot_map)
    before = (*kept_main, *kept.get(tail_map, ())) if kept_main is not None else ()
    # In the model's order (merge sorts them): only endpoints without a slot yet are
    # placed by it.
    values = list(dict.fromkeys(slot_value(addrs[id(ep)], ep.port) for ep in eps))
    assigned = assign_slots(values, before)
    n = len(assigned)
    main = main_size(n, None if kept_main is None else len(kept_main))
    for name, part in ((slot_map, assigned[:main]), (tail_map, assigned[main:])):
        if not part:
            continue
        build.slot_values.append((name, tuple(part)))
        build.sets.append(SlotMap(name, build.key.family, proto))
        build.slot_elements += [Element(build.table, name, (i,), v)
                                for i, v in enumerate(part)]
    build.chains += slot_chains(ip, proto, chain, first, n, main, label)


def _hashed_chain(build: _PortBuild, chain: str, eps: Sequence[SelectedEndpoint],
                  first: tuple[str, ...],
                  spelled: tuple[Mapping[int, str], Mapping[int, str]], label: str,
                  balancing: Balancing, affinity: bool) -> None:
    """A path's chain balancing by a hash of the source into Maglev's table of its
    endpoints (module docstring): `first`, then the one rule. Where the endpoints have
    chains of their own (`spelled`'s second: affinity, or counting), the table holds
    `goto` those chains, after affinity's checks when there is affinity."""
    addrs, ep_chains = spelled
    ip, proto = build.ip, build.proto
    if ep_chains:
        values: dict[Backend, Value] = {
            (ep.address, ep.port): Verdict("goto", ep_chains[id(ep)]) for ep in eps}
        slot_map = HASHED_VERDICTS + chain
    else:
        values = {(ep.address, ep.port): slot_value(addrs[id(ep)], ep.port) for ep in eps}
        slot_map = HASHED + chain
    table = maglev_table(values)
    build.sets.append(SlotMap(slot_map, build.key.family, proto, verdicts=bool(ep_chains)))
    if not ep_chains:
        # Kept, so that a change of endpoints writes only the slots that change
        # (port_edit.py).
        build.slot_values.append((slot_map, tuple(values[b] for b in table)))
    build.slot_elements += [Element(build.table, slot_map, (i,), values[b])
                            for i, b in enumerate(table)]
    checks = _affinity_checks(ip, eps, ep_chains) if affinity else ()
    build.chains.append(Chain(chain, (*first, *checks, hashed_rule(
        ip, proto, len(table), slot_map, label, balancing, bool(ep_chains)))))


def hashed_rule(ip: str, proto: str, m: int, slot_map: str, label: str,
                balancing: Balancing, verdicts: bool = False) -> str:
    """A hashed chain's one rule: the source (and its port, for maglev) hashed as every
    node hashes it, into one of the `m` slots: its endpoint, or (`verdicts`) its chain."""
    source = f"{ip} saddr . {proto} sport" if balancing is Balancing.MAGLEV else f"{ip} saddr"
    hashed = f"jhash {source} mod {m} seed {HASH_SEED:#x}"
    if verdicts:
        return f"meta l4proto {proto} {hashed} vmap @{slot_map} {label}"
    return f"meta l4proto {proto} dnat {ip} to {hashed} map @{slot_map} {label}"


def slot_chains(ip: str, proto: str, chain: str, first: Sequence[str], n: int, main: int,
                label: str) -> list[Chain]:
    """A slot-mapped path's chains for its `n` slots, `main` of them in its main map: the
    tail's chain where they split (slot_tail.py), before the policy chain that jumps to
    it; the policy chain is `first`, then the main map's one rule."""
    tail_map = TAIL_PREFIX + chain
    tail = [Chain(tail_map, (tail_rule(ip, proto, n, main, tail_map, label),))] \
        if main < n else []
    rules = (*first, *(f"jump {t.name}" for t in tail),
             slot_rule(ip, proto, main, SLOTS + chain, label))
    return [*tail, Chain(chain, rules)]


def slot_rule(ip: str, proto: str, n: int, slot_map: str, label: str) -> str:
    """A slot-mapped chain's one balancing rule: any of the `n` slots, uniformly."""
    return f"meta l4proto {proto} dnat {ip} to numgen random mod {n} map @{slot_map} {label}"


def slot_value(address: str, port: int) -> Key:
    """What a slot holds: an endpoint's address (as address_text spells it) and port."""
    return (address, port)


def hairpin_element(address: str) -> Key:
    return (address, address)


def element_table(set_name: str, port_table: str) -> str:
    """Where a port's element of `set_name` lives: its shard (`port_table`) for the sets
    every shard declares, the main table for the rest (@cluster-ips, @hairpin)."""
    return port_table if set_name in SHARD_SETS else TABLE


def assign_slots(values: Sequence[V], before: Sequence[V]) -> list[V]:
    """Slot -> value for the distinct `values`, slots 0..n-1 all used (numgen picks any
    of them), given the values `before` in their slots: a value keeps its slot while
    that is below n; the others fill the free slots in order. So an endpoint gone moves
    one other (the one in the last slot, into its place), and one added takes the new
    last slot."""
    if not before:  # a first render: each value in its own order
        return list(values)
    previous = dict(zip(before, range(len(before)), strict=True))
    n = len(values)
    slots: list[V | None] = [None] * n
    homeless = []
    for v in values:
        s = previous.get(v)
        if s is not None and s < n and slots[s] is None:
            slots[s] = v
        else:
            homeless.append(v)
    free = (i for i, v in enumerate(slots) if v is None)
    for v, i in zip(homeless, free, strict=True):
        slots[i] = v
    return [v for v in slots if v is not None]  # all of them: n values, n slots


def _external_rules(ip: str, ctx: RenderContext, external_local: bool, svc_chain: str | None,
                    policy_chain: str | None) -> tuple[str, ...]:
    rules: list[str] = []
    if not external_local:
        # Endpoints may be on other nodes: masquerade so replies come back through us.
        rules.append(f"jump {MARK_FOR_MASQUERADE}")
    else:
        # Pods going to an external address act as if they went out and came back in:
        # neither traffic policy applies (upstream's short-circuit).
        if svc_chain:
            rules.extend(f"{ip} saddr {c} goto {svc_chain}"
                         for c in sorted_nets(ctx.local_cidrs))
        # The node itself is the source: its address is local, so masquerade.
        rules.append(f"fib saddr type local jump {MARK_FOR_MASQUERADE}")
        if svc_chain:
            rules.append(f"fib saddr type local goto {svc_chain}")
    if policy_chain:
        rules.append(f"goto {policy_chain}")
    return tuple(rules)


def _firewall_rules(ip: str, ctx: RenderContext, ranges: Sequence[IPNetwork],
                    lb_ips: Sequence[IPAddress], ext_chain: str) -> tuple[str, ...]:
    # One rule per range, no anonymous set: sets are what makes a big table slow.
    rules = [f"{ip} saddr {r} goto {ext_chain}" for r in sorted_nets(ranges)]
    # A node sending to its own LB IP (often a local address) comes from that IP.
    if any(a in r for r in ranges for a in ctx.node_ips):
        rules.extend(f"{ip} saddr {_text(a)} goto {ext_chain}" for a in lb_ips)
    return tuple(dict.fromkeys(rules))


def _balance(ip: str, proto: str, eps: Sequence[SelectedEndpoint],
             texts: Mapping[int, str], ep_chains: Mapping[int, str],
             label: str, counts: Mapping[str, str]) -> tuple[str, ...]:
    """Affinity checks first, then endpoint i (of n) with probability 1/(n-i) among what
    is left, the last one always: uniform, like iptables' `statistic` cascade. In the
    order of `eps`: a resolved port's, by address and port (ResolvedServicePort)."""
    ordered = eps
    rules: list[str] = list(_affinity_checks(ip, ordered, ep_chains)) if ep_chains else []
    n = len(ordered)
    for i, ep in enumerate(ordered):
        pick = f"numgen random mod {n - i} 0 " if i < n - 1 else ""
        if ep_chains:
            rules.append(f"{pick}goto {ep_chains[id(ep)]}")
        else:
            text = texts[id(ep)]
            count = f"{counts[text]} " if text in counts else ""
            rules.append(f"{pick}{count}meta l4proto {proto} dnat to {text} {label}")
    return tuple(rules)


def _affinity_checks(ip: str, eps: Sequence[SelectedEndpoint], ep_chains: Mapping[int, str]
                     ) -> Iterator[str]:
    """A client with a live affinity entry goes back to its endpoint's chain."""
    for ep in eps:
        chain = ep_chains[id(ep)]
        yield f"{ip} saddr @{_affinity_set(chain)} goto {chain}"


def _affinity_set(ep_chain: str) -> str:
    return "aff-" + ep_chain.removeprefix("ep-")
