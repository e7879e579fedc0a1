"""The real-node lab's DNS, as real clusters have it: the nodes' own resolver, which
knows the API server's name, and a cluster DNS behind a Service's ClusterIP.

    cp ns (labs/realcp/controlplane.py), on the control plane's bridge (IPv4 shown; the
    cluster's primary family's addresses, at the same offsets in IPv6):
      198.18.96.1  kube-apiserver, named API_NAME (api.cluster.test) by the resolver
      198.18.96.2  the nodes' resolver (dnsmasq): API_NAME -> the API server; other names
                   under .test NXDOMAIN; nothing else answered. Each kubelet's
                   --resolv-conf names it, and so does /etc/resolv.conf in the node's
                   private mount namespace (kubelet's own look-ups: its kubeconfig names
                   the API server by API_NAME)
      198.18.96.3  the cluster DNS server (dnsmasq): `kubernetes.default.svc.<domain>`
                   -> the `kubernetes` Service; other <domain> names NXDOMAIN; anything
                   else forwarded to the resolver (as CoreDNS forwards to the node's)
    kube-system/kube-dns: ClusterIP the 10th address of the (primary) service range
      (kubeadm's choice; kubelet's --cluster-dns), no selector, its Endpoints naming
      the server above (the EndpointSlice mirroring controller makes its slice). Pods
      with the default dnsPolicy ask it, so their names resolve only once a proxy has
      programmed it.

The servers are two dnsmasq processes (Debian's dnsmasq-base: the binary, no system
service) in the control plane's namespace, which already routes every node's pod range;
they die with it.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import signal
import socket
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labs.realcp.addressing import IPV4, Family, IPAddress
from labs.realcp.controlplane import API_NAME, BRIDGE, add_address
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import TimedOut, wait

DNSMASQ = "dnsmasq"
CLUSTER_DOMAIN = "cluster.local"
KUBERNETES_NAME = f"kubernetes.default.svc.{CLUSTER_DOMAIN}"
_TYPES = {4: ("A", 1), 6: ("AAAA", 28)}


class DnsError(RuntimeError):
    pass


def resolver_addr(family: Family) -> IPAddress:
    """The nodes' resolver: what a node's /etc/resolv.conf names."""
    return family.api_addr + 1


def cluster_dns_server(family: Family) -> IPAddress:
    """The cluster DNS server, behind the kube-dns Service."""
    return family.api_addr + 2


def cluster_dns_ip(family: Family) -> IPAddress:
    """The kube-dns Service's ClusterIP (kubelet's --cluster-dns)."""
    return family.services[10]


def query(netns: str, server: IPAddress, name: str, timeout: float = 2.0) -> list[str]:
    """The addresses of `server`'s family that it answers for `name` (one UDP question
    from `netns`); raises DnsError with the response code when it answers with one."""
    qtype = _TYPES[server.version][1]
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    with entered(netns):
        sock = socket.socket(socket.AF_INET6 if server.version == 6 else socket.AF_INET,
                             socket.SOCK_DGRAM)
    with sock:
        sock.settimeout(timeout)
        ident = int.from_bytes(os.urandom(2), "big")
        sock.sendto(struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question
                    + struct.pack("!HH", qtype, 1), (str(server), 53))
        data = sock.recv(4096)
    rid, flags, _, count = struct.unpack("!HHHH", data[:8])
    if rid != ident:
        raise DnsError(f"{server}: an answer to another question")
    if flags & 0xF:
        raise DnsError(f"{server}: {name}: response code {flags & 0xF}")
    offset = 12 + len(question) + 4
    out = []
    for _ in range(count):
        # A name is a pointer (2 bytes) or labels ending in a zero byte.
        while data[offset] and data[offset] < 0xC0:
            offset += data[offset] + 1
        offset += 2 if data[offset] >= 0xC0 else 1
        atype, _, _, length = struct.unpack("!HHIH", data[offset:offset + 10])
        offset += 10
        if atype == qtype:
            out.append(str(ipaddress.ip_address(data[offset:offset + length])))
        offset += length
    return out


def kube_dns_objects(server: IPAddress, cluster_ip: IPAddress) -> list[dict[str, Any]]:
    """kube-system/kube-dns at `cluster_ip`, backed by `server` (no selector: the
    Endpoints are ours, and the mirroring controller writes the EndpointSlice)."""
    ports = [{"name": n, "port": 53, "protocol": p} for n, p in (("dns", "UDP"),
                                                                 ("dns-tcp", "TCP"))]
    meta = {"name": "kube-dns", "namespace": "kube-system",
            "labels": {"k8s-app": "kube-dns"}}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"clusterIP": str(cluster_ip), "ports": ports}},
        {"apiVersion": "v1", "kind": "Endpoints", "metadata": meta,
         "subsets": [{"addresses": [{"ip": str(server)}], "ports": ports}]},
    ]


@dataclass
class LabDns:
    """The two DNS servers in `netns` (the control plane's), on `family`'s addresses;
    logs under `workdir`."""

    netns: str
    workdir: Path
    family: Family = IPV4
    api_name: str = API_NAME
    _procs: list[subprocess.Popen[bytes]] = field(init=False, default_factory=list)

    def start(self, timeout: float = 20.0) -> None:
        f = self.family
        self._spawn("resolver", resolver_addr(f), [
            f"--host-record={self.api_name},{f.api_addr}", "--local=/test/"])
        self._spawn("cluster-dns", cluster_dns_server(f), [
            f"--host-record={KUBERNETES_NAME},{f.kubernetes_service_ip}",
            f"--local=/{CLUSTER_DOMAIN}/", f"--server={resolver_addr(f)}"])
        for server, name, addr in (
                (resolver_addr(f), self.api_name, f.api_addr),
                (cluster_dns_server(f), KUBERNETES_NAME, f.kubernetes_service_ip),
                (cluster_dns_server(f), self.api_name, f.api_addr)):
            try:
                wait(functools.partial(self._answers, server, name, str(addr)), timeout,
                     f"{server} to answer {name}", interval=0.05)
            except TimedOut as exc:
                raise DnsError(f"{exc}; logs:\n{self.logs()}") from None

    def _answers(self, server: IPAddress, name: str, addr: str) -> bool:
        for proc in self._procs:
            if proc.poll() is not None:
                raise DnsError(f"dnsmasq exited ({proc.returncode}):\n{self.logs()}")
        with contextlib.suppress(OSError, DnsError):
            return query(self.netns, server, name) == [addr]
        return False

    def _spawn(self, name: str, addr: IPAddress, records: Sequence[str]) -> None:
        add_address(self.netns, BRIDGE, addr, addr.max_prefixlen)
        self.workdir.mkdir(parents=True, exist_ok=True)
        with (self.workdir / f"{name}.log").open("ab") as out:
            self._procs.append(subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.netns}", DNSMASQ,
                 "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                 "--no-hosts", "--bind-interfaces", f"--listen-address={addr}",
                 "--pid-file=", "--log-facility=-", "--log-queries", *records],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(p.read_text(errors="replace")[-chars:]
                         for p in sorted(self.workdir.glob("*.log")))

    def stop(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self._procs.clear()
