"""kube-proxy's rules without kube-proxy: the text its proxiers hand to the kernel, for
N services, so tests and benchmarks can play "a kube-proxy on this node" in a namespace
they made (the foreign-proxy check: proxy/dataplane/common/foreign_proxy.py).

- `iptables_restore`: v1.20's iptables mode, as its `iptables-restore --noflush` input
  (nat and filter; every chain of its own declared, and so flushed and refilled, on
  every sync): KUBE-SERVICES with a masquerade and a jump rule per service port,
  KUBE-SVC-* balancing over KUBE-SEP-* endpoint chains, KUBE-NODEPORTS, and the
  kubelet-shared KUBE-MARK-MASQ and KUBE-POSTROUTING.
- `hooks`: the jump rules kube-proxy ensures once in the built-in chains.
- `nftables`: the nftables mode's (1.29+) table `kube-proxy`: the base chains it
  flushes and refills on every sync, the `service-ips` verdict map, a chain per service
  port and per endpoint.

Addresses are the lab's: service IPs in 198.19.0.0/16 (fd00:19::/64), endpoints in
198.18.0.0/16 (fd00:18::/64). Pure text; nothing here touches a kernel.
"""

from __future__ import annotations

import base64
import hashlib
from ipaddress import IPv4Address, IPv6Address

POD_CIDR = {4: "198.18.0.0/16", 6: "fd00:18::/64"}


def _hash(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


def _service_ip(family: int, i: int) -> str:
    if family == 4:
        return str(IPv4Address("198.19.0.0") + 1 + i)
    return str(IPv6Address("fd00:19::") + 1 + i)


def _endpoint_ip(family: int, i: int) -> str:
    if family == 4:
        return str(IPv4Address("198.18.0.0") + 1 + i)
    return str(IPv6Address("fd00:18::") + 1 + i)


def iptables_restore(services: int, endpoints: int = 2, family: int = 4,
                     generation: int = 0) -> str:
    """`services` ClusterIP services of one TCP port with `endpoints` endpoints each.
    `generation` moves every endpoint (a different ruleset of the same shape)."""
    plen = 32 if family == 4 else 128
    nat_chains = [":KUBE-SERVICES - [0:0]", ":KUBE-POSTROUTING - [0:0]",
                  ":KUBE-NODEPORTS - [0:0]", ":KUBE-MARK-MASQ - [0:0]"]
    nat = [
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring '
        'SNAT" -j MASQUERADE --random-fully',
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
    ]
    filter_chains = [":KUBE-SERVICES - [0:0]", ":KUBE-EXTERNAL-SERVICES - [0:0]",
                     ":KUBE-FORWARD - [0:0]"]
    filtered = [
        '-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP',
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
        '-m mark --mark 0x4000/0x4000 -j ACCEPT',
    ]
    for s in range(services):
        name = f"ns{s // 100}/svc{s}:http"
        vip = _service_ip(family, s)
        svc = "KUBE-SVC-" + _hash(name + "tcp")
        nat_chains.append(f":{svc} - [0:0]")
        nat.append(f'-A KUBE-SERVICES ! -s {POD_CIDR[family]} -d {vip}/{plen} -p tcp -m comment '
                   f'--comment "{name} cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ')
        nat.append(f'-A KUBE-SERVICES -d {vip}/{plen} -p tcp -m comment --comment '
                   f'"{name} cluster IP" -m tcp --dport 80 -j {svc}')
        for e in range(endpoints):
            ip = _endpoint_ip(family, (s * endpoints + e + generation) % 60000)
            sep = "KUBE-SEP-" + _hash(name + "tcp" + ip)
            nat_chains.append(f":{sep} - [0:0]")
            left = endpoints - e
            balance = (f"-m statistic --mode random --probability {1 / left:.11f} "
                       if left > 1 else "")
            nat.append(f"-A {svc} -m comment --comment {name} {balance}-j {sep}")
            nat.append(f"-A {sep} -s {ip}/{plen} -m comment --comment {name} "
                       "-j KUBE-MARK-MASQ")
            shown = ip if family == 4 else f"[{ip}]"
            nat.append(f"-A {sep} -p tcp -m comment --comment {name} -m tcp "
                       f"-j DNAT --to-destination {shown}:8080")
    nat.append('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: '
               'this must be the last rule in this chain" -m addrtype --dst-type LOCAL '
               "-j KUBE-NODEPORTS")
    return "\n".join(["*filter", *filter_chains, *filtered, "COMMIT",
                      "*nat", *nat_chains, *nat, "COMMIT", ""])


def hooks() -> str:
    """The jumps from the built-in chains (kube-proxy adds them with `iptables -I`)."""
    jump = '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    return "\n".join([
        "*nat",
        f"-I PREROUTING 1 {jump}",
        f"-I OUTPUT 1 {jump}",
        '-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" '
        "-j KUBE-POSTROUTING",
        "COMMIT", ""])


def cleanup(rules: str) -> str:
    """`iptables-restore --noflush` input that removes what `rules` and `hooks()` made,
    as `kube-proxy --cleanup` does: the jumps first, then each chain flushed and
    deleted."""
    out = []
    for section in ("filter", "nat"):
        body = rules.split(f"*{section}\n", 1)[1].split("COMMIT", 1)[0]
        chains = [line[1:].split(" ", 1)[0] for line in body.splitlines()
                  if line.startswith(":")]
        out.append(f"*{section}")
        if section == "nat":
            out += [line.replace("-I ", "-D ", 1).replace(" 1 ", " ", 1)
                    for line in hooks().splitlines() if line.startswith("-I ")]
        out += [f"-F {chain}" for chain in chains] + [f"-X {chain}" for chain in chains]
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def nftables(services: int, endpoints: int = 2, family: int = 4, generation: int = 0) -> str:
    """`nft -f` input for the nftables mode's table (one family), as a sync leaves it:
    the table made if missing, its base chains flushed and refilled."""
    ipx, addr = ("ip", "ipv4_addr") if family == 4 else ("ip6", "ipv6_addr")
    t = f"{ipx} kube-proxy"
    lines = [
        f"add table {t} {{ comment \"rules for kube-proxy\" ; }}",
        f"add map {t} service-ips {{ type {addr} . inet_proto . inet_service : verdict ; }}",
        f"add chain {t} services",
        f"flush chain {t} services",
        f"add rule {t} services {ipx} daddr . meta l4proto . th dport vmap @service-ips",
        f"add chain {t} mark-for-masquerade",
        f"flush chain {t} mark-for-masquerade",
        f"add rule {t} mark-for-masquerade meta mark set meta mark | 0x4000",
        f"add chain {t} masquerading",
        f"flush chain {t} masquerading",
        f"add rule {t} masquerading meta mark & 0x4000 == 0 return",
        f"add rule {t} masquerading meta mark set meta mark ^ 0x4000",
        f"add rule {t} masquerading masquerade fully-random",
    ]
    for chain, hook, prio, jump in (
            ("nat-prerouting", "prerouting", "-100", "services"),
            ("nat-output", "output", "-100", "services"),
            ("nat-postrouting", "postrouting", "100", "masquerading")):
        lines += [f"add chain {t} {chain} {{ type nat hook {hook} priority {prio} ; }}",
                  f"flush chain {t} {chain}",
                  f"add rule {t} {chain} jump {jump}"]
    for s in range(services):
        name = f"ns{s // 100}/svc{s}/tcp/http"
        svc = f"service-{_hash(name)[:8]}-{name.replace('/', '-')}"[:60]
        lines += [f"add chain {t} {svc}", f"flush chain {t} {svc}"]
        targets = []
        for e in range(endpoints):
            ip = _endpoint_ip(family, (s * endpoints + e + generation) % 60000)
            ep = f"endpoint-{_hash(name + ip)[:8]}-{name.replace('/', '-')}"[:60]
            lines += [f"add chain {t} {ep}", f"flush chain {t} {ep}",
                      f"add rule {t} {ep} {ipx} saddr {ip} jump mark-for-masquerade",
                      f"add rule {t} {ep} meta l4proto tcp dnat to "
                      f"{ip if family == 4 else f'[{ip}]'}:8080"]
            targets.append(f"{e} : goto {ep}")
        lines.append(f"add rule {t} {svc} numgen random mod {endpoints} vmap "
                     f"{{ {', '.join(targets)} }}")
        lines.append(f"add element {t} service-ips {{ {_service_ip(family, s)} . tcp . 80 "
                     f": goto {svc} }}")
    return "\n".join(lines) + "\n"
