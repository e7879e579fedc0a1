"""kube-proxy's node settings, kept (`python -m proxy --init-only`; the agent's check at
start): the values worked out from each configuration (flags, kube-proxy's defaults
file, kubeadm's ConfigMap, explicit fields, 0 meaning "leave it"), and what is written
to a fake node (a folder standing for / with the /proc/sys and /sys files): only what
differs, refusals logged and never fatal, nothing written by the agent's check. The
real kernel's refusals: tests/e2e/test_node_settings_kernel.py; kube-proxy v1.20.2 itself
beside ours: tests/kernel/scenarios/scenario_mode_switch.py."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.agent.node_setup import node_settings, set_node_settings, warn_unkept
from proxy.cmd.cli import main
from proxy.config.options import Config, ConfigError, parse_args
from proxy.dataplane.common.node_files import (
    NodeFiles,
    Outcome,
    apply,
    node_cpus,
    parse_cpu_list,
)
from proxy.dataplane.common.node_settings import (
    NodeSettingsOptions,
    Setting,
    conntrack_max,
    wanted,
)
from tests.unit.test_kubeproxy_file import KUBE_PROXY_DEFAULTS, KUBEADM_CONFIGMAP, kubeadm_config

NF = "proc/sys/net/netfilter/"
MAX, HASHSIZE = NF + "nf_conntrack_max", "sys/module/nf_conntrack/parameters/hashsize"
ESTABLISHED, CLOSE_WAIT = NF + "nf_conntrack_tcp_timeout_established", \
    NF + "nf_conntrack_tcp_timeout_close_wait"
# A 6.1 kernel's own values on a small node (nothing set them).
KERNEL = {MAX: 65536, HASHSIZE: 16384, ESTABLISHED: 432000, CLOSE_WAIT: 60,
          NF + "nf_conntrack_tcp_be_liberal": 0, NF + "nf_conntrack_udp_timeout": 30,
          NF + "nf_conntrack_udp_timeout_stream": 120,
          "proc/sys/net/ipv4/vs/conntrack": 0, "proc/sys/net/ipv4/vs/expire_nodest_conn": 0,
          "proc/sys/net/ipv4/vs/expire_quiescent_template": 0,
          "proc/sys/net/ipv4/vs/conn_reuse_mode": 1, "proc/sys/net/ipv4/ip_forward": 0,
          "proc/sys/net/ipv4/conf/all/arp_ignore": 0,
          "proc/sys/net/ipv4/conf/all/arp_announce": 0}


def values(settings: tuple[Setting, ...]) -> dict[str, tuple[int, bool]]:
    """name -> (value, only raised?)"""
    return {s.name: (s.value, s.at_least) for s in settings}


KUBE_PROXY_ON_2_CPUS = {
    "net.netfilter.nf_conntrack_max": (131072, True),
    "/sys/module/nf_conntrack/parameters/hashsize": (32768, True),
    "net.netfilter.nf_conntrack_tcp_timeout_established": (86400, False),
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait": (3600, False),
}


def settings_of(cfg: Config, cpus: int = 2, kernel: str = "6.1.0-56-amd64"
                ) -> dict[str, tuple[int, bool]]:
    from proxy.agent.node_setup import node_settings_options

    return values(wanted(node_settings_options(cfg), cpus, kernel))


def write_file(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "config.conf"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# --- the values -------------------------------------------------------------------------


@pytest.mark.parametrize(("per_core", "minimum", "cpus", "table"), [
    (32768, 131072, 2, 131072),  # the minimum wins on small nodes
    (32768, 131072, 8, 262144),
    (32768, 131072, 32, 1048576),
    (32768, 131072, 96, 1048576),  # kube-proxy 1.36's cap on scaling
    (32768, 2_000_000, 96, 2_000_000),  # an explicit minimum above the cap wins
    (32768, 0, 1, 32768),
    (0, 131072, 8, 0),  # 0 per core: leave the table alone, whatever the minimum
])
def test_the_table_size_is_kube_proxys(per_core: int, minimum: int, cpus: int,
                                       table: int) -> None:
    assert conntrack_max(per_core, minimum, cpus) == table


@pytest.mark.parametrize("argv", [
    [], ["--config", str(KUBEADM_CONFIGMAP)], ["--config", str(KUBE_PROXY_DEFAULTS)]],
    ids=["flags' defaults", "kubeadm's ConfigMap (nulls)", "kube-proxy's written defaults"])
def test_unset_is_kube_proxys_defaults(argv: list[str]) -> None:
    assert settings_of(parse_args(argv)) == KUBE_PROXY_ON_2_CPUS


def test_every_conntrack_field_of_kube_proxys_file_means_what_it_means_there(
        tmp_path: Path) -> None:
    doc = kubeadm_config()
    doc["conntrack"] = {"maxPerCore": 65536, "min": 0, "tcpEstablishedTimeout": "2h",
                        "tcpCloseWaitTimeout": "90s", "tcpBeLiberal": True,
                        "udpTimeout": "30s", "udpStreamTimeout": "5m0s"}
    cfg = parse_args(["--config", write_file(tmp_path, doc)])
    assert cfg.ignored_settings == ()  # honoured, no longer named as ignored
    assert settings_of(cfg, cpus=4) == {
        "net.netfilter.nf_conntrack_max": (262144, True),
        "/sys/module/nf_conntrack/parameters/hashsize": (65536, True),
        "net.netfilter.nf_conntrack_tcp_timeout_established": (7200, False),
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait": (90, False),
        "net.netfilter.nf_conntrack_tcp_be_liberal": (1, False),
        "net.netfilter.nf_conntrack_udp_timeout": (30, False),
        "net.netfilter.nf_conntrack_udp_timeout_stream": (300, False),
    }
    # The flags, with kube-proxy's names, say the same.
    flags = parse_args(["--conntrack-max-per-core", "65536", "--conntrack-min", "0",
                        "--conntrack-tcp-timeout-established", "2h",
                        "--conntrack-tcp-timeout-close-wait", "90s",
                        "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout", "30s",
                        "--conntrack-udp-timeout-stream", "5m"])
    assert settings_of(flags, cpus=4) == settings_of(cfg, cpus=4)


def test_zero_leaves_a_setting_as_the_kernel_has_it(tmp_path: Path) -> None:
    doc = kubeadm_config()
    doc["conntrack"] = {"maxPerCore": 0, "min": None, "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": None}
    cfg = parse_args(["--config", write_file(tmp_path, doc)])
    assert settings_of(cfg) == {  # null: the default; 0: nothing written
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait": (3600, False)}
    assert settings_of(parse_args(["--conntrack-max-per-core", "0",
                                   "--conntrack-tcp-timeout-established", "0",
                                   "--conntrack-tcp-timeout-close-wait", "0s"])) == {}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("min", -1, "conntrack.min: invalid value -1"),
    ("maxPerCore", "lots", "conntrack.maxPerCore: invalid value 'lots'"),
    ("tcpEstablishedTimeout", "1 day", "conntrack.tcpEstablishedTimeout: invalid value"),
    ("tcpBeLiberal", "maybe", "conntrack.tcpBeLiberal: invalid value 'maybe'"),
])
def test_a_bad_conntrack_value_names_the_files_field(tmp_path: Path, field: str,
                                                     value: Any, message: str) -> None:
    doc = kubeadm_config()
    doc["conntrack"][field] = value
    with pytest.raises(ConfigError, match=message):
        parse_args(["--config", write_file(tmp_path, doc)])


@pytest.mark.parametrize(("kernel", "reuse"), [("4.19.0-27-amd64", True),
                                               ("5.8.18", True), ("5.10.0-30-amd64", False),
                                               ("6.1.0-56-amd64", False), ("3.10.0", False)])
def test_ipvs_mode_adds_the_ipvs_proxiers_sysctls(kernel: str, reuse: bool) -> None:
    cfg = parse_args(["--proxy-mode", "ipvs"])
    ipvs = {k: v for k, v in settings_of(cfg, kernel=kernel).items()
            if k not in KUBE_PROXY_ON_2_CPUS}
    expected = {"net.ipv4.vs.conntrack": (1, False), "net.ipv4.vs.expire_nodest_conn": (1, False),
                "net.ipv4.vs.expire_quiescent_template": (1, False),
                "net.ipv4.ip_forward": (1, False)}
    if reuse:  # kernels 4.1 to 5.8 only (kubernetes issue 93297)
        expected["net.ipv4.vs.conn_reuse_mode"] = (0, False)
    assert ipvs == expected
    strict = settings_of(parse_args(["--proxy-mode", "ipvs", "--ipvs-strict-arp"]))
    assert strict["net.ipv4.conf.all.arp_ignore"] == (1, False)
    assert strict["net.ipv4.conf.all.arp_announce"] == (2, False)
    # Other modes: the conntrack settings only; strict ARP is the IPVS mode's.
    assert settings_of(parse_args(["--proxy-mode", "nftables", "--ipvs-strict-arp"])) == \
        KUBE_PROXY_ON_2_CPUS


def test_cpus_are_the_nodes_online_ones(tmp_path: Path) -> None:
    assert parse_cpu_list("0-3,8-11\n") == 8 and parse_cpu_list("0") == 1
    online = tmp_path / "sys/devices/system/cpu/online"
    online.parent.mkdir(parents=True)
    online.write_text("0-63\n")
    assert node_cpus(tmp_path) == 64
    online.unlink()  # no sysfs: this process's CPU affinity, as Go's runtime.NumCPU
    assert node_cpus(tmp_path) == len(os.sched_getaffinity(0))


# --- writing them to a (fake) node ------------------------------------------------------


class FakeNode(NodeFiles):
    """A folder standing for the node's /: its files hold the kernel's values; `refuse`
    maps paths to the errno a write gets (the real kernel's refusals cannot be staged
    with file modes: root writes any file). Counts the writes."""

    def __init__(self, root: Path, files: dict[str, int], cpus: str = "0-1",
                 refuse: dict[str, int] | None = None) -> None:
        super().__init__(root)
        for path, value in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(f"{value}\n")
        (root / "sys/devices/system/cpu").mkdir(parents=True, exist_ok=True)
        (root / "sys/devices/system/cpu/online").write_text(cpus + "\n")
        self.refuse = refuse or {}
        self.writes: list[str] = []

    def write(self, setting: Setting, value: int) -> None:
        if setting.path in self.refuse:
            code = self.refuse[setting.path]
            raise OSError(code, os.strerror(code))
        self.writes.append(setting.path)
        super().write(setting, value)

    def value(self, path: str) -> int:
        return int((self.root / path).read_text())


def conntrack_files(**changed: int) -> dict[str, int]:
    out = {p: v for p, v in KERNEL.items() if p.startswith((NF, "sys/"))}
    names = {"max": MAX, "hashsize": HASHSIZE, "established": ESTABLISHED,
             "close_wait": CLOSE_WAIT}
    out.update({names[k]: v for k, v in changed.items()})
    return out


def defaults(tmp_path: Path) -> tuple[Setting, ...]:
    return node_settings(parse_args([]), tmp_path)


def test_only_what_differs_is_written_and_then_nothing(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, conntrack_files())
    results = apply(node, defaults(tmp_path), load=None)
    assert {r.setting.name: (r.outcome, r.before, r.after) for r in results} == {
        "net.netfilter.nf_conntrack_max": (Outcome.CHANGED, 65536, 131072),
        "/sys/module/nf_conntrack/parameters/hashsize": (Outcome.CHANGED, 16384, 32768),
        "net.netfilter.nf_conntrack_tcp_timeout_established": (Outcome.CHANGED, 432000, 86400),
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait": (Outcome.CHANGED, 60, 3600)}
    assert (node.value(MAX), node.value(HASHSIZE)) == (131072, 32768)
    node.writes.clear()
    again = apply(node, defaults(tmp_path), load=None)
    assert {r.outcome for r in again} == {Outcome.KEPT} and node.writes == []


def test_a_larger_table_is_kept_and_a_timeout_is_set_either_way(tmp_path: Path) -> None:
    """As kube-proxy since 1.36 (its #142035): nf_conntrack_max and hashsize only ever
    raised; the timeouts to exactly the configured value, lower too."""
    node = FakeNode(tmp_path, conntrack_files(max=262144, hashsize=262144,
                                              established=999999, close_wait=3600))
    results = {r.setting.name: r.outcome for r in apply(node, defaults(tmp_path), load=None)}
    assert node.writes == [ESTABLISHED] and node.value(ESTABLISHED) == 86400
    assert results["net.netfilter.nf_conntrack_max"] is Outcome.KEPT
    assert node.value(MAX) == 262144 and node.value(HASHSIZE) == 262144


def test_a_refused_write_is_logged_with_what_is_and_what_kube_proxy_sets_and_never_fails(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A node that is a network namespace (or a container without the privilege): the
    global table size is refused, the per-namespace timeouts still set, exit 0."""
    node = FakeNode(tmp_path, conntrack_files(),
                    refuse={MAX: errno.EACCES, HASHSIZE: errno.EOPNOTSUPP})
    with caplog.at_level(logging.INFO, logger="proxy"):
        set_node_settings(parse_args([]), node, load=None)
    refused = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [(r.getMessage(), r.__dict__["setting"], r.__dict__["current"],
             r.__dict__["wanted"]) for r in refused] == [
        ("node setting not changed: the kernel refused the write",
         "net.netfilter.nf_conntrack_max", 65536, ">= 131072"),
        ("node setting not changed: the kernel refused the write",
         "/sys/module/nf_conntrack/parameters/hashsize", 16384, ">= 32768")]
    assert "initial network namespace" in refused[0].__dict__["error"]
    changed = {r.__dict__["setting"]: (r.__dict__["old"], r.__dict__["new"])
               for r in caplog.records if r.getMessage() == "node setting changed"}
    assert changed == {"net.netfilter.nf_conntrack_tcp_timeout_established": (432000, 86400),
                       "net.netfilter.nf_conntrack_tcp_timeout_close_wait": (60, 3600)}
    (done,) = [r for r in caplog.records if r.getMessage() == "node settings done"]
    assert (done.__dict__["changed"], done.__dict__["refused"]) == (2, 2)
    assert node.value(MAX) == 65536


def test_a_refusal_is_no_news_where_the_node_already_holds_enough(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = FakeNode(tmp_path, conntrack_files(max=262144, hashsize=65536),
                    refuse={MAX: errno.EACCES, HASHSIZE: errno.EOPNOTSUPP})
    with caplog.at_level(logging.WARNING, logger="proxy"):
        set_node_settings(parse_args([]), node, load=None)
    assert caplog.records == []


def test_a_read_only_proc_sys_is_named_as_the_cause(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, conntrack_files(), refuse={ESTABLISHED: errno.EROFS})
    (r,) = [r for r in apply(node, defaults(tmp_path), load=None)
            if r.outcome is Outcome.REFUSED]
    assert r.setting.path == ESTABLISHED and "read-only" in r.error and "privileged" in r.error


def test_a_write_the_kernel_takes_but_does_not_keep_is_reported(tmp_path: Path) -> None:
    """Read back after each write: a kernel that clamps the value (or a file that holds
    something else) is a refusal, with the value it holds."""

    class Clamping(FakeNode):
        def write(self, setting: Setting, value: int) -> None:
            super().write(setting, min(value, 100000))

    node = Clamping(tmp_path, conntrack_files())
    results = {r.setting.path: r for r in apply(node, defaults(tmp_path), load=None)}
    assert results[MAX].outcome is Outcome.REFUSED
    assert results[MAX].error == "written, but the kernel holds 100000"
    assert results[ESTABLISHED].outcome is Outcome.CHANGED


def test_a_missing_module_is_asked_for_once_then_its_files_written(tmp_path: Path) -> None:
    """No nf_conntrack yet (nothing on the node used conntrack): ask the kernel for it
    as the agent's ctnetlink requests would load it, then set the new files."""
    node = FakeNode(tmp_path, {})
    asked: list[str] = []

    def load(module: str) -> None:  # the kernel loading nf_conntrack: its files appear
        asked.append(module)
        FakeNode(tmp_path, conntrack_files())

    results = apply(node, defaults(tmp_path), load=load)
    assert asked == ["nf_conntrack"]
    assert {r.outcome for r in results} == {Outcome.CHANGED}
    # A module that does not come: named, nothing else happens.
    other = tmp_path / "other"
    other.mkdir()
    absent = apply(FakeNode(other, {}), node_settings(parse_args([]), other),
                   load=lambda module: None)
    assert {r.outcome for r in absent} == {Outcome.ABSENT}


def test_ipvs_sysctls_are_written_in_ipvs_mode(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, KERNEL)
    cfg = parse_args(["--proxy-mode", "ipvs", "--ipvs-strict-arp"])
    apply(node, node_settings(cfg, tmp_path), load=None)
    for path in ("proc/sys/net/ipv4/vs/conntrack", "proc/sys/net/ipv4/vs/expire_nodest_conn",
                 "proc/sys/net/ipv4/vs/expire_quiescent_template",
                 "proc/sys/net/ipv4/ip_forward", "proc/sys/net/ipv4/conf/all/arp_ignore"):
        assert node.value(path) == 1, path
    assert node.value("proc/sys/net/ipv4/conf/all/arp_announce") == 2


# --- the agent's check at start ---------------------------------------------------------


def test_the_agent_warns_once_naming_what_differs_and_writes_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = FakeNode(tmp_path, conntrack_files(max=262144, hashsize=65536))
    before = {p: node.value(p) for p in (MAX, HASHSIZE, ESTABLISHED, CLOSE_WAIT)}
    with caplog.at_level(logging.WARNING, logger="proxy"):
        warn_unkept(parse_args([]), tmp_path)
    (record,) = caplog.records
    assert record.getMessage() == "node settings differ from what kube-proxy would set"
    assert record.__dict__["settings"] == [
        "net.netfilter.nf_conntrack_tcp_timeout_established=432000 (kube-proxy sets 86400)",
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait=60 (kube-proxy sets 3600)"]
    assert "--init-only" in record.__dict__["fix"]
    assert {p: node.value(p) for p in before} == before
    caplog.clear()
    apply(node, defaults(tmp_path), load=None)  # the init step ran
    with caplog.at_level(logging.WARNING, logger="proxy"):
        results = warn_unkept(parse_args([]), tmp_path)
    assert caplog.records == [] and {r.outcome for r in results} == {Outcome.KEPT}
    # Nothing asked for, nothing to warn about, whatever the node holds.
    other = tmp_path / "other"
    FakeNode(other, conntrack_files())
    with caplog.at_level(logging.WARNING, logger="proxy"):
        warn_unkept(parse_args(["--conntrack-max-per-core", "0",
                                "--conntrack-tcp-timeout-established", "0",
                                "--conntrack-tcp-timeout-close-wait", "0"]), other)
    assert caplog.records == []


def test_init_only_and_cleanup_together_are_refused(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert main(["--init-only", "--cleanup"]) == 2
    assert "--init-only and --cleanup" in capsys.readouterr().err


def test_the_options_default_to_kube_proxys() -> None:
    from proxy.agent.node_setup import node_settings_options

    assert node_settings_options(parse_args([])) == NodeSettingsOptions()
