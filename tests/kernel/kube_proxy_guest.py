"""kube-proxy v1.20.2 itself in the kernel lab's node namespace, INSIDE the guest: in IPVS
mode, against the simulator at API level 1.20 (EndpointSlices as discovery.k8s.io/v1beta1,
as its API server served them), so that switching between it and sliceproxy is tried
with the real thing. The binary is the real-control-plane tier's build (KUBE_PROXY).

Its config is kubeadm's shape with what a lab node needs: JSON to the simulator, no
conntrack sysctls (the global ones cannot be written from a namespace; its node settings
are compared elsewhere: node_settings_guest.py), and the lab's pod network as clusterCIDR.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import yaml

from proxy.netns_lab import Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import POD_CIDR

STOP_TIMEOUT = 15.0


def config(sim: SimServer, workdir: Path, name: str) -> Path:
    kubeconfig = sim.write_kubeconfig(workdir / f"{name}.kubeconfig")
    doc: dict[str, Any] = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "ipvs", "hostnameOverride": "node-a", "bindAddress": "0.0.0.0",
        "clusterCIDR": POD_CIDR.split(",")[0],
        "clientConnection": {"kubeconfig": str(kubeconfig), "contentType": "application/json",
                             "acceptContentTypes": "application/json"},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "ipvs": {"scheduler": "rr", "syncPeriod": "30s", "minSyncPeriod": "0s"},
        "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s"},
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class KubeProxy:
    """`kube-proxy --config ...` in the node namespace; its log in `workdir`."""

    def __init__(self, lab: Lab, sim: SimServer, binary: str, workdir: Path, name: str) -> None:
        self.lab, self.binary, self.name = lab, binary, name
        self.log_path = workdir / f"{name}.log"
        self.argv = [binary, "--config", str(config(sim, workdir, name)), "-v", "2"]
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> KubeProxy:
        with self.log_path.open("ab") as log:
            self.proc = self.lab.popen(self.lab.node_ns, self.argv, stdout=log, stderr=log)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, as a deleted pod gets it: kube-proxy exits and leaves its rules."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def cleanup(lab: Lab, binary: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`kube-proxy --cleanup FLAGS` in the node namespace."""
    return lab.exec(lab.node_ns, [binary, "--cleanup", *flags, "-v", "2"], timeout=120)
