"""kube-proxy v1.20.2's node settings beside sliceproxy's `--init-only`, INSIDE the kernel
lab's guest, in its initial network namespace (the only one where the global conntrack
table size can be written): the sysctls both may touch, read, reset to a new node's
values, and kube-proxy itself run just far enough to set them.

kube-proxy sets them in Run(), before its informers need the API server, so it is given
a kubeconfig to an address nothing listens on, and bindAddress 127.0.0.1 (else it first
asks the API server for the node's IP, retrying for about half a minute; the node IP
plays no part in these settings). It is stopped once its log shows the informers
starting, which Run() does after the settings.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import yaml

from proxy.netns_lab.poll import wait

SYS = Path("/proc/sys")
HASHSIZE = Path("/sys/module/nf_conntrack/parameters/hashsize")
CONNTRACK = ("net/netfilter/nf_conntrack_max", "net/netfilter/nf_conntrack_tcp_timeout_established",
             "net/netfilter/nf_conntrack_tcp_timeout_close_wait")
IPVS = ("net/ipv4/vs/conntrack", "net/ipv4/vs/expire_nodest_conn",
        "net/ipv4/vs/expire_quiescent_template", "net/ipv4/ip_forward")
# What kube-proxy v1.20.2 also writes and sliceproxy leaves: conn_reuse_mode (v1.20.2
# sets 0 on every kernel from 4.1; later releases only below 5.9, as sliceproxy) and
# route_localnet (localhost NodePorts, which sliceproxy never serves).
ONLY_V1_20 = ("net/ipv4/vs/conn_reuse_mode", "net/ipv4/conf/all/route_localnet")
# A new node's values (a 6.1 kernel's defaults, the table small), written before each
# proxy runs so that both have everything to set.
NEW_NODE = {"net/netfilter/nf_conntrack_max": 65536, "hashsize": 16384,
            "net/netfilter/nf_conntrack_tcp_timeout_established": 432000,
            "net/netfilter/nf_conntrack_tcp_timeout_close_wait": 60,
            "net/ipv4/vs/conntrack": 0, "net/ipv4/vs/expire_nodest_conn": 0,
            "net/ipv4/vs/expire_quiescent_template": 0, "net/ipv4/ip_forward": 0,
            "net/ipv4/vs/conn_reuse_mode": 1, "net/ipv4/conf/all/route_localnet": 0}
PAST_SETTINGS = "Starting service config controller"  # Run() logs it after them
UNREACHABLE = "https://127.0.0.1:1"


def _path(name: str) -> Path:
    return HASHSIZE if name == "hashsize" else SYS / name


def read(names: tuple[str, ...] | list[str] | None = None) -> dict[str, int]:
    return {n: int(_path(n).read_text().split()[0]) for n in (names or NEW_NODE)}


def write(values: dict[str, int]) -> None:
    for name, value in values.items():
        _path(name).write_text(str(value))


def kube_proxy_config(workdir: Path, mode: str) -> Path:
    """kubeadm's KubeProxyConfiguration (its conntrack fields null: kube-proxy's
    defaults), in `mode`, pointed at an API server that is not there."""
    from tests.unit.test_kubeproxy_file import kubeadm_config

    kubeconfig = workdir / "unreachable.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": UNREACHABLE,
                                                  "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
        "users": [{"name": "none", "user": {"token": "none"}}]}))
    doc: dict[str, Any] = kubeadm_config()
    doc.update(mode=mode, bindAddress="127.0.0.1", hostnameOverride="node-a")
    doc["clientConnection"]["kubeconfig"] = str(kubeconfig)
    path = workdir / f"kube-proxy-{mode or 'iptables'}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_kube_proxy(binary: str, config: Path, log: Path, timeout: float) -> str:
    """Start kube-proxy, wait until it is past its node settings, stop it; its log."""
    with log.open("w") as out:
        proc = subprocess.Popen([binary, "--config", str(config), "-v", "2"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait(lambda: PAST_SETTINGS in log.read_text() or proc.poll() is not None, timeout,
             "kube-proxy to set its node settings", detail=lambda: log.read_text()[-3000:])
        text = log.read_text()
        if PAST_SETTINGS not in text:
            raise AssertionError(f"kube-proxy exited {proc.returncode}:\n{text[-3000:]}")
        return text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
