"""sliceproxy's `--config` against kube-proxy and kubeadm v1.20.2 themselves (the binaries
this tier builds): the defaults file in tests/unit/fixtures is what kube-proxy writes, the
kubeadm ConfigMap's configuration what kubeadm writes; kube-proxy accepts
the kubeadm-shaped files the unit tests use; and kube-proxy's loading and defaulting of
a file (`--write-config-to` writes the configuration as it loaded it) changes none of
the settings sliceproxy reads from it, but those left at zero, which take each proxy's
default. Which section a mode reads is checked in the unit tests (from upstream's code),
since kube-proxy's written file does not show it.
Nothing here starts a proxy: `--write-config-to` writes the file and exits."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from labs.realcp.build import Binaries
from proxy.config.options import Config, parse_args
from tests.unit.test_kubeproxy_file import KUBE_PROXY_DEFAULTS, kubeadm_config


def kube_proxy_writes(bins: Binaries, out: Path, config: Path | None = None) -> dict[str, Any]:
    argv = [str(bins.path("kube-proxy")), "--write-config-to", str(out)]
    if config is not None:
        argv += ["--config", str(config)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    fatal = [line for line in res.stderr.splitlines() if line[:1] in ("F", "E")]
    assert res.returncode == 0, fatal or res.stderr[-2000:]
    doc = yaml.safe_load(out.read_text())
    assert isinstance(doc, dict)
    return doc


def test_the_kubeadm_fixture_is_what_kubeadm_writes(realcp_binaries: Binaries) -> None:
    """kubeadm v1.20.2's own KubeProxyConfiguration (what `kubeadm init` uploads into the
    kube-proxy ConfigMap's config.conf) is the fixture's, but for clusterCIDR, which
    kubeadm takes from the ClusterConfiguration's podSubnet (empty by default)."""
    res = subprocess.run([str(realcp_binaries.path("kubeadm")), "config", "print",
                          "init-defaults", "--component-configs", "KubeProxyConfiguration"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    (written,) = [d for d in yaml.safe_load_all(res.stdout)
                  if d and d.get("kind") == "KubeProxyConfiguration"]
    fixture = kubeadm_config()
    assert written.pop("clusterCIDR") == "" and fixture.pop("clusterCIDR")
    assert written == fixture


def honoured(cfg: Config) -> Config:
    return dataclasses.replace(cfg, ignored_settings=())


def test_the_defaults_fixture_is_what_kube_proxy_writes(realcp_binaries: Binaries,
                                                        tmp_path: Path) -> None:
    written = kube_proxy_writes(realcp_binaries, tmp_path / "defaults.yaml")
    assert written == yaml.safe_load(KUBE_PROXY_DEFAULTS.read_text())


def test_kube_proxy_accepts_the_files_and_its_loading_changes_no_setting_we_read(
        realcp_binaries: Binaries, tmp_path: Path) -> None:
    every = kubeadm_config()
    # One cluster CIDR: v1.20 takes two only behind its IPv6DualStack gate.
    every.update(mode="ipvs", hostnameOverride="node-7", clusterCIDR="198.18.0.0/16",
                 healthzBindAddress="127.0.0.1:10266", metricsBindAddress="0.0.0.0:10259",
                 nodePortAddresses=["198.18.5.0/24"])
    every["ipvs"].update(scheduler="wlc", minSyncPeriod="250ms", syncPeriod="45s")
    every["iptables"].update(masqueradeAll=True, minSyncPeriod="2s", syncPeriod="5m")
    for name, doc in (("kubeadm", kubeadm_config()), ("every-field", every)):
        given = tmp_path / f"{name}.yaml"
        given.write_text(yaml.safe_dump(doc))
        # kube-proxy accepts the file, and writes it back as it understood it.
        loaded = kube_proxy_writes(realcp_binaries, tmp_path / f"{name}-loaded.yaml", given)
        for key in ("mode", "clusterCIDR", "hostnameOverride", "nodePortAddresses"):
            assert loaded[key] == doc[key], key
        ours = parse_args(["--config", str(given)])
        theirs = parse_args(["--config", str(tmp_path / f"{name}-loaded.yaml")])
        if name == "every-field":
            # Every honoured field set: the same settings from either file.
            assert honoured(ours) == honoured(theirs)
        else:
            # Fields left at zero take each proxy's own default; sliceproxy's full resync
            # period is 1h (kube-proxy's 30s; docs/upstream-differences.md). kubeadm's
            # minSyncPeriod 0s is "not set" (sliceproxy paces by cost), while the file
            # kube-proxy writes back states its default, 1s, which keeps its pacing
            # (docs/flags.md, "When syncs run").
            assert ours.sync_period == 3600.0 and theirs.sync_period == 30.0
            assert ours.min_sync_period is None and theirs.min_sync_period == 1.0
            assert honoured(dataclasses.replace(ours, sync_period=30.0, min_sync_period=1.0)
                            ) == honoured(theirs)


def test_a_misspelt_field_is_skipped_with_a_warning_as_kube_proxy_does(
        realcp_binaries: Binaries, tmp_path: Path) -> None:
    doc = kubeadm_config()
    doc["iptables"]["masqueradAll"] = True  # sic: the operator meant masqueradeAll
    given = tmp_path / "typo.yaml"
    given.write_text(yaml.safe_dump(doc))
    argv = [str(realcp_binaries.path("kube-proxy")), "--config", str(given),
            "--write-config-to", str(tmp_path / "out.yaml")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    # kube-proxy v1.20: a warning, and the field dropped (upstream-differences K10).
    assert res.returncode == 0 and "unknown field: masqueradAll" in res.stderr
    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["iptables"][
        "masqueradeAll"] is False
    # sliceproxy: the same, the field named in its start-up warning.
    cfg = parse_args(["--config", str(given)])
    assert cfg.unknown_settings == ("iptables.masqueradAll=True",)
    assert not cfg.masquerade_all


@pytest.mark.parametrize(("bind", "healthz", "metrics"), [
    ("::", "", ""),  # kubeadm's IPv6 clusters: [::]:10256 and [::1]:10249
    ("fd00:18::5", "", ""),
    ("198.18.0.5", "", ""),
    ("::", "198.18.0.7", "::1"),  # bare IPs get the ports
])
def test_the_server_addresses_are_kube_proxys_defaulting(
        realcp_binaries: Binaries, tmp_path: Path, bind: str, healthz: str,
        metrics: str) -> None:
    """bindAddress and bare bind addresses, as kube-proxy v1.20.2 itself fills them in:
    the file it writes back gives sliceproxy the same addresses as the file given."""
    doc = kubeadm_config()
    doc.update(bindAddress=bind, healthzBindAddress=healthz, metricsBindAddress=metrics)
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(doc))
    loaded = kube_proxy_writes(realcp_binaries, tmp_path / "loaded.yaml", given)
    ours = parse_args(["--config", str(given)])
    theirs = parse_args(["--config", str(tmp_path / "loaded.yaml")])
    assert (ours.healthz_bind_address, ours.metrics_bind_address) == (
        theirs.healthz_bind_address, theirs.metrics_bind_address), loaded
