"""`--config` with kube-proxy's own KubeProxyConfiguration: the file kube-proxy v1.20.2
writes for its defaults, and kubeadm's kube-proxy ConfigMap, become sliceproxy's
settings; what sliceproxy does not implement is named once at start; a bad value stops
the agent naming the file's field."""

from __future__ import annotations

import dataclasses
import logging
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.agent.main import warn_ignored_settings
from proxy.config.options import ConfigError, parse_args
from proxy.kube.ingest import EndpointsSource

FIXTURES = Path(__file__).parent / "fixtures"
KUBE_PROXY_DEFAULTS = FIXTURES / "kube-proxy-v1.20.2-defaults.yaml"
KUBEADM_CONFIGMAP = FIXTURES / "kubeadm-kube-proxy-configmap.yaml"


def kubeadm_config() -> dict[str, Any]:
    cm = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())
    doc = yaml.safe_load(cm["data"]["config.conf"])
    assert isinstance(doc, dict)
    return doc


def write(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "config.conf"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_kube_proxys_own_defaults_are_honoured_and_the_rest_named() -> None:
    cfg = parse_args(["--config", str(KUBE_PROXY_DEFAULTS)])
    assert cfg.proxy_mode == "iptables"  # mode "" is iptables on Linux
    assert (cfg.min_sync_period, cfg.sync_period) == (1.0, 30.0)  # iptables.*
    assert cfg.healthz_bind_address == ("0.0.0.0", 10256)
    assert cfg.metrics_bind_address == ("127.0.0.1", 10249)
    assert not cfg.masquerade_all and cfg.cluster_cidr == () and cfg.kubeconfig is None
    # Upstream's defaults for what sliceproxy leaves alone: named, with their values.
    # bindAddress 0.0.0.0 and masqueradeBit 14 are what sliceproxy does: not named;
    # winkernel and the userspace proxy's fields are ignored by kube-proxy here too.
    assert cfg.ignored_settings == (
        "clientConnection.burst=10",
        "clientConnection.contentType=application/vnd.kubernetes.protobuf",
        "clientConnection.qps=5", "configSyncPeriod=15m0s", "oomScoreAdj=-999")
    # The conntrack settings are honoured (the --init-only step writes them).
    assert (cfg.conntrack_max_per_core, cfg.conntrack_min) == (32768, 131072)
    assert (cfg.conntrack_tcp_timeout_established,
            cfg.conntrack_tcp_timeout_close_wait) == (86400.0, 3600.0)


def test_kubeadms_configmap_is_read_whole_and_its_zeros_mean_the_defaults() -> None:
    cfg = parse_args(["--config", str(KUBEADM_CONFIGMAP)])
    assert cfg.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert cfg.cluster_cidr == (ip_network("198.18.0.0/16"),)
    assert cfg.proxy_mode == "iptables" and cfg.ipvs_scheduler == "rr"
    # "0s": our defaults, so kubeadm's clusters are paced by cost, not by a period.
    assert (cfg.min_sync_period, cfg.sync_period) == (None, 3600.0)
    assert cfg.sync_cpu_budget == 0.2
    assert cfg.healthz_bind_address == ("0.0.0.0", 10256)
    assert cfg.ignored_settings == ()  # kubeadm sets nothing sliceproxy leaves alone


def test_every_honoured_field_means_what_it_means_to_kube_proxy(tmp_path: Path) -> None:
    doc = kubeadm_config()
    doc.update(mode="ipvs", hostnameOverride="node-7", clusterCIDR="198.18.0.0/16,fd00::/64",
               healthzBindAddress="127.0.0.1:10266", metricsBindAddress="0.0.0.0:10259",
               nodePortAddresses=["198.18.5.0/24"])
    doc["ipvs"].update(scheduler="wlc", minSyncPeriod="250ms", syncPeriod="45s")
    doc["iptables"].update(masqueradeAll=True, syncPeriod="5m")  # ipvs masquerades by it
    cfg = parse_args(["--config", write(tmp_path, doc)])
    assert (cfg.proxy_mode, cfg.ipvs_scheduler, cfg.node_name) == ("ipvs", "wlc", "node-7")
    assert (cfg.min_sync_period, cfg.sync_period) == (0.25, 45.0)  # the mode's section
    assert cfg.masquerade_all
    assert cfg.cluster_cidr == (ip_network("198.18.0.0/16"), ip_network("fd00::/64"))
    assert cfg.healthz_bind_address == ("127.0.0.1", 10266)
    assert cfg.metrics_bind_address == ("0.0.0.0", 10259)
    assert cfg.nodeport_addresses == (ip_network("198.18.5.0/24"),)
    assert cfg.endpoints_source is EndpointsSource.ENDPOINT_SLICES
    # nftables mode reads its own section (kube-proxy 1.29+), verbosity from logging.
    doc.update(mode="nftables", nftables={"masqueradeAll": False, "minSyncPeriod": "2s",
                                          "syncPeriod": "1h"},
               logging={"verbosity": 3, "format": "json"})
    cfg = parse_args(["--config", write(tmp_path, doc)])
    assert (cfg.proxy_mode, cfg.min_sync_period, cfg.sync_period) == ("nftables", 2.0, 3600.0)
    assert not cfg.masquerade_all and cfg.verbosity == 3 and cfg.logging_format == "json"


def test_flags_on_the_command_line_win_over_the_file() -> None:
    cfg = parse_args(["--config", str(KUBEADM_CONFIGMAP), "--proxy-mode", "nftables",
                      "--min-sync-period", "100ms", "--hostname-override", "n1"])
    assert (cfg.proxy_mode, cfg.min_sync_period, cfg.node_name) == ("nftables", 0.1, "n1")
    assert cfg.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"  # the rest: the file's


@pytest.mark.parametrize(("change", "message"), [
    ({"mode": "userspace"}, "mode: 'userspace' is not a mode sliceproxy has"),
    ({"mode": "kernelspace"}, "mode: 'kernelspace' is not a mode sliceproxy has"),
    ({"iptables": {"syncPeriod": "5 minutes"}},
     "iptables.syncPeriod: invalid value '5 minutes': invalid duration"),
    ({"iptables": {"minSyncPeriod": "5m", "syncPeriod": "30s"}},
     "iptables.minSyncPeriod (5m) must not exceed iptables.syncPeriod (30s)"),
    ({"clusterCIDR": "198.18.0.0/16,nope"}, "clusterCIDR: 'nope' is not a CIDR"),
    ({"healthzBindAddress": "198.18.0.1:99999"}, "healthzBindAddress: port 99999"),
    ({"ipvs": {"scheduler": "fastest"}}, "ipvs.scheduler: invalid value 'fastest'"),
    ({"nodePortAddresses": ["primary", "198.18.0.0/33"]},
     "nodePortAddresses: '198.18.0.0/33' is not a CIDR (e.g. 198.18.0.0/16) or 'primary'"),
    ({"apiVersion": "kubeproxy.config.k8s.io/v1alpha2"},
     "apiVersion: 'kubeproxy.config.k8s.io/v1alpha2' is not supported (use "
     "kubeproxy.config.k8s.io/v1alpha1, the only version kube-proxy has)"),
    ({"bindAddress": "node-1"}, "bindAddress: 'node-1' is not an IP address"),
    ({"metricsBindAddress": "[::1]"}, "metricsBindAddress: '[::1]' is not IP:PORT or IP"),
    # Not implemented, and it would change where packets go: refused.
    ({"detectLocalMode": "NodeCIDR"}, "detectLocalMode: 'NodeCIDR' is not supported: "
                                      "sliceproxy tells pod traffic by clusterCIDR alone"),
    ({"detectLocalMode": "InterfaceNamePrefix", "detectLocal": {"interfaceNamePrefix": "veth"}},
     "detectLocalMode: 'InterfaceNamePrefix' is not supported"),
    ({"iptables": {"masqueradeBit": 15}}, "iptables.masqueradeBit: 15 is not supported: "
                                          "sliceproxy always marks"),
    ({"mode": "ipvs", "iptables": {"masqueradeBit": 13}}, "iptables.masqueradeBit: 13"),
    ({"mode": "nftables", "nftables": {"masqueradeBit": 0}}, "nftables.masqueradeBit: 0"),
    # kube-proxy's primary node IP decides where `primary` opens NodePorts.
    ({"bindAddress": "198.18.0.5", "nodePortAddresses": ["primary"]},
     "bindAddress: '198.18.0.5' is kube-proxy's primary node IP, where nodePortAddresses "
     "'primary' opens NodePorts"),
    ({"mode": "nftables", "bindAddress": "fd00:18::5"}, "bindAddress: 'fd00:18::5' is"),
    ({"logging": {"verbosity": "loud"}}, "logging.verbosity: invalid value 'loud'"),
    ({"logging": {"format": "yaml"}}, "logging.format: invalid value 'yaml': must be one of"),
])
def test_a_bad_value_stops_the_agent_naming_the_files_field(
        tmp_path: Path, change: dict[str, Any], message: str) -> None:
    doc = kubeadm_config()
    for key, value in change.items():
        doc[key] = {**doc[key], **value} if isinstance(doc.get(key), dict) else value
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", path])
    assert str(err.value).startswith(f"--config: {path}: ")
    assert message in str(err.value)


def test_a_configmap_without_the_kube_proxy_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": "x"}, "data": {"other": "1"}}))
    with pytest.raises(ConfigError, match=r'data\.config\.conf: this ConfigMap has no'):
        parse_args(["--config", str(path)])


def test_what_is_not_implemented_is_named_in_one_warning_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doc = kubeadm_config()
    doc["mode"] = "ipvs"
    doc["ipvs"].update(tcpTimeout="2h", excludeCIDRs=["198.18.9.0/24"])
    doc["featureGates"] = {"TopologyAwareHints": True}
    doc["iptables"].update(masqueradeBit=14, localhostNodePorts=True)  # 14: sliceproxy's
    doc["bindAddressHardFail"] = True  # what sliceproxy does: never named
    doc["winkernel"]["enableDSR"] = True  # Windows: kube-proxy on Linux ignores it too
    doc["nftables"] = {"masqueradeBit": 3}  # another mode's: kube-proxy ignores it too
    cfg = parse_args(["--config", write(tmp_path, doc)])
    # excludeCIDRs guards virtual servers sliceproxy never touches (it deletes only its
    # own); localhostNodePorts is read in iptables mode only.
    assert cfg.ignored_settings == ("featureGates={TopologyAwareHints: True}",
                                    "ipvs.tcpTimeout=2h")
    assert cfg.unknown_settings == ()
    with caplog.at_level(logging.WARNING, logger="proxy"):
        warn_ignored_settings(cfg)
    (record,) = caplog.records
    assert record.getMessage() == ("kube-proxy configuration fields that sliceproxy does "
                                   "not implement are ignored")
    assert record.__dict__["fields"] == list(cfg.ignored_settings)
    assert record.__dict__["unknown"] == []
    caplog.clear()
    warn_ignored_settings(parse_args(["--config", str(KUBEADM_CONFIGMAP)]))
    assert not caplog.records
    # The debug dump shows them with the rest of the configuration.
    assert cfg.as_dict()["ignored-settings"] == list(cfg.ignored_settings)
    # The IPVS timeouts are another mode's in iptables mode; localhostNodePorts is not.
    doc["mode"] = ""
    cfg = parse_args(["--config", write(tmp_path, doc)])
    assert cfg.ignored_settings == ("featureGates={TopologyAwareHints: True}",
                                    "iptables.localhostNodePorts=True")


EVERY_FIELD = FIXTURES / "kube-proxy-v1alpha1-every-field.yaml"


def test_every_field_of_todays_kube_proxy_is_known_and_classified() -> None:
    """No field of the newest v1alpha1 is unknown; what sliceproxy leaves alone is named
    (conntrack's fields aside: kube-proxy's node settings have their own tests)."""
    cfg = parse_args(["--config", str(EVERY_FIELD)])
    assert cfg.unknown_settings == ()
    assert [f for f in cfg.ignored_settings if not f.startswith("conntrack.")] == [
        "clientConnection.acceptContentTypes=application/json",
        "clientConnection.burst=10",
        "clientConnection.contentType=application/vnd.kubernetes.protobuf",
        "clientConnection.qps=5", "configSyncPeriod=15m0s", "enableProfiling=True",
        "featureGates={SomeGate: True}", "logging.flushFrequency=5s",
        "logging.options={json: {'infoBufferSize': '0'}, text: {'infoBufferSize': '0'}}",
        "logging.vmodule=[{'filePattern': 'proxier*', 'verbosity': 4}]",
        "oomScoreAdj=-999", "showHiddenMetricsForVersion=1.34"]
    # Honoured: what kube-proxy would do with them.
    assert (cfg.proxy_mode, cfg.node_name, cfg.verbosity) == ("iptables", "node-7", 2)
    assert (cfg.min_sync_period, cfg.sync_period, cfg.masquerade_all) == (1.0, 30.0, True)
    assert cfg.healthz_bind_address == ("0.0.0.0", 10256)
    assert cfg.metrics_bind_address == ("127.0.0.1", 10249)


@pytest.mark.parametrize(("bind", "healthz", "metrics", "named"), [
    # Upstream's defaulting (getDefaultAddresses): the family of bindAddress picks them.
    (None, ("0.0.0.0", 10256), ("127.0.0.1", 10249), False),
    ("0.0.0.0", ("0.0.0.0", 10256), ("127.0.0.1", 10249), False),
    ("::", ("::", 10256), ("::1", 10249), False),  # what kubeadm writes for IPv6
    ("198.18.0.5", ("0.0.0.0", 10256), ("127.0.0.1", 10249), True),
    ("fd00:18::5", ("::", 10256), ("::1", 10249), True),
    ("::ffff:198.18.0.5", ("0.0.0.0", 10256), ("127.0.0.1", 10249), True),  # Go's To4()
])
def test_bind_address_gives_the_servers_addresses_as_upstreams_defaulting(
        tmp_path: Path, bind: str | None, healthz: tuple[str, int],
        metrics: tuple[str, int], named: bool) -> None:
    doc = kubeadm_config()  # healthzBindAddress and metricsBindAddress: ""
    doc["bindAddress"] = bind
    cfg = parse_args(["--config", write(tmp_path, doc)])
    assert (cfg.healthz_bind_address, cfg.metrics_bind_address) == (healthz, metrics)
    # A specific address is also kube-proxy's primary node IP: named, not used.
    assert cfg.ignored_settings == ((f"bindAddress={bind} (as the node's primary IP)",)
                                    if named else ())
    # Flags still win over the file.
    flagged = parse_args(["--config", write(tmp_path, doc),
                          "--metrics-bind-address", "0.0.0.0:9999"])
    assert flagged.metrics_bind_address == ("0.0.0.0", 9999)


@pytest.mark.parametrize(("field", "value", "want"), [
    ("healthzBindAddress", "::", ("::", 10256)),  # a bare IP takes the default port
    ("healthzBindAddress", "198.18.0.5", ("198.18.0.5", 10256)),
    ("metricsBindAddress", "0.0.0.0", ("0.0.0.0", 10249)),
    ("metricsBindAddress", "fd00:18::5", ("fd00:18::5", 10249)),
    ("metricsBindAddress", "[::]:10259", ("::", 10259)),
])
def test_a_bind_address_without_a_port_gets_kube_proxys(
        tmp_path: Path, field: str, value: str, want: tuple[str, int]) -> None:
    doc = kubeadm_config()
    doc["bindAddress"] = "::"  # the other server keeps its bindAddress default
    doc[field] = value
    cfg = parse_args(["--config", write(tmp_path, doc)])
    dest = "healthz_bind_address" if field == "healthzBindAddress" else "metrics_bind_address"
    assert getattr(cfg, dest) == want
    other = "metrics_bind_address" if dest == "healthz_bind_address" else "healthz_bind_address"
    assert getattr(cfg, other) == (("::1", 10249) if other == "metrics_bind_address"
                                   else ("::", 10256))


def test_a_field_no_release_has_is_named_and_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As kube-proxy's lenient decoding: a later release's field, a misspelling or a
    section of kube-proxy's internal configuration does not stop the agent; it is named
    in the start-up warning and changes nothing."""
    doc = kubeadm_config()
    doc["iptables"]["masqueradAll"] = True  # sic
    doc["linux"] = {"masqueradeAll": True}  # internal configuration / unreleased v1alpha2
    doc["syncPeriod"] = "5s"  # v1alpha1 has the mode's section's only
    doc["nftables"] = {"newKnob": "on"}
    cfg = parse_args(["--config", write(tmp_path, doc)])
    assert cfg.unknown_settings == ("iptables.masqueradAll=True", "linux={masqueradeAll: True}",
                                    "nftables.newKnob=on", "syncPeriod=5s")
    assert cfg == dataclasses.replace(parse_args(["--config", str(KUBEADM_CONFIGMAP)]),
                                      unknown_settings=cfg.unknown_settings)
    with caplog.at_level(logging.WARNING, logger="proxy"):
        warn_ignored_settings(cfg)
    (record,) = caplog.records
    assert record.__dict__["unknown"] == list(cfg.unknown_settings)
    assert record.__dict__["fields"] == []
    assert cfg.as_dict()["unknown-settings"] == list(cfg.unknown_settings)


def test_strict_arp_is_the_init_steps_in_ipvs_mode_and_another_modes_field_else(
        tmp_path: Path) -> None:
    doc = kubeadm_config()
    doc["mode"] = "ipvs"
    doc["ipvs"]["strictARP"] = True
    cfg = parse_args(["--config", write(tmp_path, doc)])
    assert cfg.ipvs_strict_arp and cfg.ignored_settings == ()
    doc["mode"] = "nftables"  # kube-proxy reads it in IPVS mode only
    assert not parse_args(["--config", write(tmp_path, doc)]).ipvs_strict_arp
    doc["mode"], doc["ipvs"]["strictARP"] = "ipvs", "yes"
    with pytest.raises(ConfigError, match=r"ipvs\.strictARP: invalid value 'yes'"):
        parse_args(["--config", write(tmp_path, doc)])
