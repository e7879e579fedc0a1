"""Removing kube-proxy's IPVS mode from a node where sliceproxy already serves: what
`kube-proxy --cleanup` does, without its flush of the whole IPVS table.

    python -m proxy.dataplane.ipvs.handover    (sliceproxy's image; hostNetwork, root,
                                                NET_ADMIN and NET_RAW; no API server)

The last step of the switch from kube-proxy in IPVS mode to sliceproxy
(deploy/migrate/kube-proxy-cleanup-ipvs.yaml, docs/migrate.md#ipvs-mode).

`kube-proxy --cleanup` deletes every IPVS virtual server (1.21 on, always; 1.20 unless
`--cleanup-ipvs=false`), sliceproxy's included: every service of the node refuses
connections until sliceproxy's next full sync. This removes, in order:

1. the virtual servers provably kube-proxy's (ownership.is_kube_proxys: on kube-ipvs0's
   addresses or its NodePorts, and not in sliceproxy's SERVICES sets), read while
   kube-ipvs0 still says which addresses were kube-proxy's;
2. the interface kube-ipvs0;
3. kube-proxy's iptables chains and every rule jumping to them, on both back ends and
   both families: the IPVS mode's (`IPVS_NAT_CHAINS`, `IPVS_FILTER_CHAINS`), and the
   iptables mode's in nat (`NAT_CHAINS`, `CHAIN_PREFIXES`) should an earlier mode have
   left them; as upstream's clean-up, nat KUBE-MARK-MASQ and KUBE-POSTROUTING too, which
   the kubelet (before 1.28) puts back;
4. its ipsets (`ipvs_set_names`), once no rule uses them.

Names: proxy/dataplane/common/kube_proxy_objects.py. Runs in the calling thread's network
namespace (the node's: hostNetwork). It prints what it removed; exit status 1 if anything
could not be removed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.dataplane.common.kube_proxy_objects import (
    CHAIN_PREFIXES,
    IPVS_FILTER_CHAINS,
    IPVS_INTERFACE,
    IPVS_NAT_CHAINS,
    NAT_CHAINS,
    ipvs_set_names,
)
from proxy.dataplane.ipvs.diff import Op, OpKind
from proxy.dataplane.ipvs.kernel import Ipsets, IpvsTable, Links
from proxy.dataplane.ipvs.ownership import is_kube_proxys, read_claims
from proxy.dataplane.ipvs.render import DUMMY_INTERFACE, VsKey
from proxy.dataplane.xtables.cleanup import cleanup_runners
from proxy.dataplane.xtables.restore_runner import RunnerError
from proxy.dataplane.xtables.saved import Saved, Table, cleanup_restore, parse_save
from proxy.model.types import Family

log = logging.getLogger(__name__)


def kube_proxy_chain(table: Table) -> Callable[[str], bool]:
    """Whether a chain of `table` is one kube-proxy's clean-up removes."""
    if table is Table.NAT:
        return lambda chain: (chain in IPVS_NAT_CHAINS or chain in NAT_CHAINS
                              or chain.startswith(CHAIN_PREFIXES))
    return lambda chain: chain in IPVS_FILTER_CHAINS


def chains_text(saved: Saved) -> str:
    """iptables-restore --noflush input removing kube-proxy's chains and the jumps to
    them from `saved` (pure); "" if there are none."""
    return "".join(cleanup_restore({table: chains}, kube_proxy_chain(table)).render()
                   for table, chains in saved.items())


@dataclass(slots=True)
class Removed:
    virtual_servers: list[VsKey] = field(default_factory=list)
    interfaces: int = 0
    iptables_lines: int = 0
    ipsets: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def remove_kube_proxy_ipvs() -> Removed:
    """Remove kube-proxy's IPVS mode from this network namespace (module docstring)."""
    out = Removed()
    _virtual_servers(out)
    links = Links(IPVS_INTERFACE)
    try:
        if links.delete():
            out.interfaces = 1
    except Exception as exc:
        out.errors.append(f"delete interface {IPVS_INTERFACE}: {exc}")
    finally:
        links.close()
    for runner in cleanup_runners(list(Family)):
        try:  # save alone: listing a legacy table that is not there makes it
            text = chains_text(parse_save(runner.save()))
            if text:
                runner.restore(text, noflush=True)
                out.iptables_lines += text.count("\n")
        except RunnerError as exc:
            out.errors.append(f"{runner.restore_cmd}: {exc}")
    ipsets = Ipsets()
    try:
        present = set(ipsets.names())
    except Exception as exc:
        out.errors.append(f"ipsets: {exc}")
        return out
    for name in ipvs_set_names():
        if name in present:
            try:
                ipsets.destroy(name)
                out.ipsets.append(name)
            except Exception as exc:
                out.errors.append(str(exc))
    return out


def _virtual_servers(out: Removed) -> None:
    try:
        table = IpvsTable()
    except Exception as exc:  # no ip_vs module: nothing of anyone's in IPVS
        log.info("no IPVS table here", extra={"error": str(exc)})
        return
    links = Links(DUMMY_INTERFACE)
    try:
        claims = read_claims(links, Ipsets())
        doomed = sorted((k for k in table.service_keys()
                         if is_kube_proxys(k, claims.ours.keys, claims.kube_proxy)),
                        key=VsKey.order)
        codes = table.apply_many([Op(OpKind.DEL_SERVICE, k) for k in doomed])
    except Exception as exc:
        out.errors.append(f"IPVS: {exc}")
        return
    finally:
        table.close()
        links.close()
    for key, code in zip(doomed, codes, strict=True):
        if code:
            out.errors.append(f"delete virtual server {key}: errno {code}")
        else:
            out.virtual_servers.append(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.dataplane.ipvs.handover",
                                     description=__doc__.split("\n\n", 1)[0])
    parser.parse_args(argv)
    removed = remove_kube_proxy_ipvs()
    for error in removed.errors:
        print(f"kube-proxy's IPVS mode: cannot remove {error}", file=sys.stderr)
    first = f", first {removed.virtual_servers[0]}" if removed.virtual_servers else ""
    print(f"removed kube-proxy's IPVS mode: {len(removed.virtual_servers)} virtual servers "
          f"(kube-proxy's alone{first}), {removed.interfaces} interface ({IPVS_INTERFACE}), "
          f"{removed.iptables_lines} iptables-restore lines, {len(removed.ipsets)} ipsets")
    return 1 if removed.errors else 0


if __name__ == "__main__":
    sys.exit(main())
