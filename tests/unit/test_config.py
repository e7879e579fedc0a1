"""Flags and config file: kube-proxy's names and durations, clear errors naming the flag."""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path

import pytest

from proxy.config.options import ConfigError, format_duration, parse_args, parse_duration
from proxy.kube.ingest import EndpointsSource


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1.0), ("250ms", 0.25), ("0", 0.0), ("0s", 0.0), ("1h", 3600.0),
     ("1h30m", 5400.0), ("1.5s", 1.5), ("100us", 1e-4), ("2m3s", 123.0), (".5s", 0.5)],
)
def test_durations_as_go_parses_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "s", "1x", "-1s", "1s2", "1 s", "ms"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_defaults_match_kube_proxy() -> None:
    cfg = parse_args(["--hostname-override", "Node-A"])
    assert cfg.node_name == "node-a"
    assert cfg.proxy_mode == "iptables"
    assert cfg.endpoints_source is EndpointsSource.ENDPOINT_SLICES
    # Paced by cost (agent/schedule.py): no minimum period unless one is set.
    assert (cfg.min_sync_period, cfg.sync_period) == (None, 3600.0)
    assert cfg.sync_cpu_budget == 0.2
    assert cfg.as_dict()["min-sync-period"] is None
    assert cfg.as_dict()["sync-cpu-budget"] == "20%"
    assert cfg.healthz_bind_address == ("0.0.0.0", 10256)
    assert cfg.metrics_bind_address == ("127.0.0.1", 10249)
    assert cfg.uvloop


def test_flags() -> None:
    cfg = parse_args([
        "--hostname-override", "n1", "--proxy-mode", "ipvs", "--endpoints-source", "endpoints",
        "--min-sync-period", "250ms", "--sync-period", "30s", "--cluster-cidr",
        "198.18.0.0/16,fd00::/64", "--masquerade-all", "--nodeport-addresses", "198.19.0.0/24",
        "--metrics-bind-address", "[::1]:9000", "--ipvs-scheduler", "lc", "-v", "4",
        "--no-uvloop", "--iptables-applier", "iptc",
    ])
    assert cfg.proxy_mode == "ipvs" and cfg.endpoints_source is EndpointsSource.ENDPOINTS
    assert (cfg.min_sync_period, cfg.sync_period) == (0.25, 30.0)
    assert cfg.cluster_cidr == (ip_network("198.18.0.0/16"), ip_network("fd00::/64"))
    assert cfg.masquerade_all and not cfg.uvloop and cfg.verbosity == 4
    assert cfg.metrics_bind_address == ("::1", 9000)
    assert cfg.as_dict()["min-sync-period"] == "250ms"
    assert cfg.iptables_applier == "iptc"


def test_config_file_with_flags_winning(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("hostname-override: from-file\nmin-sync-period: 2s\nmasquerade-all: true\n"
                    "cluster-cidr: [198.18.0.0/16]\n")
    cfg = parse_args(["--config", str(path), "--min-sync-period", "500ms"])
    assert cfg.node_name == "from-file" and cfg.min_sync_period == 0.5 and cfg.masquerade_all
    assert cfg.cluster_cidr == (ip_network("198.18.0.0/16"),)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-sync-period", "fast"], "--min-sync-period: invalid value 'fast'"),
        (["--proxy-mode", "nft"], "--proxy-mode: invalid value 'nft': must be one of"),
        (["--endpoints-source", "slices"], "must be endpointslices or endpoints"),
        (["--cluster-cidr", "198.18.0.0/40"], "--cluster-cidr: '198.18.0.0/40' is not a CIDR"),
        (["--healthz-bind-address", "10256"], "--healthz-bind-address: '10256' is not"),
        (["--healthz-bind-address", "[::1]"], "'[::1]' is not IP:PORT or IP"),
        (["--metrics-bind-address", "node-1:10249"], "'node-1:10249' is not IP:PORT"),
        (["--metrics-bind-address", "127.0.0.1:99999"], "port 99999 is out of range"),
        (["-v", "12"], "-v: invalid value '12'"),
        (["--iptables-applier", "nft"], "--iptables-applier: invalid value 'nft': must be one"),
        (["--min-sync-period", "2h"], "must not exceed --sync-period"),
        (["--sync-cpu-budget", "lots"], "--sync-cpu-budget: invalid value 'lots': must be a "
                                        "share of one core (20% or 0.2), or off"),
        (["--sync-cpu-budget", "0"], "must be between 1% and 100% of one core, or off"),
        (["--sync-cpu-budget", "150%"], "must be between 1% and 100% of one core, or off"),
        (["--sync-cpu-budget", "0.5%"], "must be between 1% and 100% of one core"),
        (["--sync-cpu-budget", "20"], "(did you mean 20%?)"),
        (["--sync-cpu-budget", "nan"], "must be between 1% and 100%"),
        (["--sync-cpu-budget=-10%"], "must be between 1% and 100%"),
        (["--sync-period", "0s"], "--sync-period: must be greater than 0"),
        (["--healthz-threshold=-5s"], "--healthz-threshold: invalid value '-5s'"),
    ],
)
def test_errors_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(["--hostname-override", "n", *argv])
    assert message in str(info.value)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("speed: 11\n")
    with pytest.raises(ConfigError, match="unknown key 'speed'"):
        parse_args(["--config", str(bad)])


def test_format_duration_round_trips() -> None:
    for text in ("250ms", "1s", "90s", "5m", "1h"):
        assert format_duration(parse_duration(text)) == text


def test_healthz_threshold_flag_and_file(tmp_path: Path) -> None:
    assert parse_args(["--hostname-override", "n"]).healthz_threshold == 0.0  # derived
    assert parse_args(["--hostname-override", "n", "--healthz-threshold", "90s"]
                      ).healthz_threshold == 90.0
    path = tmp_path / "c.yaml"
    path.write_text("hostname-override: n\nhealthz-threshold: 2m\n")
    cfg = parse_args(["--config", str(path)])
    assert cfg.healthz_threshold == 120.0 and cfg.as_dict()["healthz-threshold"] == "2m"


def test_iptables_applier_reaches_the_data_plane() -> None:
    from proxy.agent.app import dataplane_options
    from proxy.dataplane.iptables.apply import IptablesDataPlane

    assert parse_args(["--hostname-override", "n"]).iptables_applier == "restore"
    options = dataplane_options(parse_args(["--hostname-override", "n",
                                            "--iptables-applier", "iptc"]))
    assert IptablesDataPlane(options, runners={}).applier == "iptc"


def test_debug_dump_is_local_unless_asked_and_takes_go_bools(tmp_path: Path) -> None:
    base = ["--hostname-override", "n"]
    assert parse_args(base).debug_dump == "local"  # loopback clients only
    assert parse_args([*base, "--debug-dump=false"]).debug_dump == "false"
    assert parse_args([*base, "--debug-dump", "0"]).debug_dump == "false"
    assert parse_args([*base, "--debug-dump=LOCAL"]).debug_dump == "local"
    assert parse_args([*base, "--debug-dump=true"]).debug_dump == "true"
    assert parse_args([*base, "--debug-dump"]).debug_dump == "true"  # bare, as in Go
    cfg = parse_args([*base, "--debug-dump=false"])
    assert cfg.as_dict()["debug-dump"] == "false"
    assert cfg.metrics_bind_address == ("127.0.0.1", 10249)  # /metrics stays
    path = tmp_path / "c.yaml"
    path.write_text("hostname-override: n\ndebug-dump: false\n")  # YAML's false
    assert parse_args(["--config", str(path)]).debug_dump == "false"
    assert parse_args(["--config", str(path), "--debug-dump=local"]).debug_dump == "local"
    path.write_text("hostname-override: n\ndebug-dump: true\n")
    assert parse_args(["--config", str(path)]).debug_dump == "true"
    with pytest.raises(ConfigError, match="--debug-dump: invalid value 'off': must be "
                                          "false, local or true"):
        parse_args([*base, "--debug-dump=off"])


@pytest.mark.parametrize(("flag", "value", "want"), [
    ("--healthz-bind-address", "::", ("::", 10256)),  # kube-proxy: a bare IP takes the port
    ("--healthz-bind-address", "[::]:10266", ("::", 10266)),
    ("--healthz-bind-address", "198.18.0.5", ("198.18.0.5", 10256)),
    ("--metrics-bind-address", "0.0.0.0", ("0.0.0.0", 10249)),
    ("--metrics-bind-address", "::1", ("::1", 10249)),
    ("--metrics-bind-address", "127.0.0.1:0", ("127.0.0.1", 0)),  # off
])
def test_bind_addresses_as_kube_proxys_flags_take_them(flag: str, value: str,
                                                       want: tuple[str, int]) -> None:
    cfg = parse_args(["--hostname-override", "n", flag, value])
    dest = flag.lstrip("-").replace("-", "_")
    assert getattr(cfg, dest) == want


@pytest.mark.parametrize(("text", "share", "shown"), [
    ("20%", 0.2, "20%"), ("0.2", 0.2, "20%"), ("5%", 0.05, "5%"), ("100%", 1.0, "100%"),
    ("1", 1.0, "100%"), ("12.5%", 0.125, "12.5%"), ("off", None, "off"), ("OFF", None, "off"),
])
def test_sync_cpu_budget_takes_a_share_or_off(text: str, share: float | None,
                                              shown: str) -> None:
    cfg = parse_args(["--hostname-override", "n", "--sync-cpu-budget", text])
    assert cfg.sync_cpu_budget == (pytest.approx(share) if share is not None else None)
    assert cfg.as_dict()["sync-cpu-budget"] == shown


def test_pacing_keys_in_our_config_file(tmp_path: Path) -> None:
    """YAML reads a bare `off` as false and `0.3` as a number: both mean what they say."""
    path = tmp_path / "c.yaml"
    path.write_text("hostname-override: n\nsync-cpu-budget: off\nmin-sync-period: 0\n")
    cfg = parse_args(["--config", str(path)])
    assert cfg.sync_cpu_budget is None and cfg.min_sync_period == 0.0  # 0: set, no limit
    path.write_text("hostname-override: n\nsync-cpu-budget: 0.3\n")
    assert parse_args(["--config", str(path)]).sync_cpu_budget == pytest.approx(0.3)
    path.write_text("hostname-override: n\nsync-cpu-budget: true\n")
    with pytest.raises(ConfigError, match="--sync-cpu-budget: invalid value True"):
        parse_args(["--config", str(path)])
    # The flag wins over the file, as for every key.
    path.write_text("hostname-override: n\nsync-cpu-budget: 30%\n")
    assert parse_args(["--config", str(path), "--sync-cpu-budget", "10%"]
                      ).sync_cpu_budget == pytest.approx(0.1)


def test_healthz_threshold_follows_a_min_sync_period_only_when_set() -> None:
    from proxy.agent.app import health_threshold

    base = ["--hostname-override", "n"]
    assert health_threshold(parse_args(base)) == 60.0
    assert health_threshold(parse_args([*base, "--min-sync-period", "30s"])) == 90.0
    assert health_threshold(parse_args([*base, "--min-sync-period", "0"])) == 60.0
    # Unset, --sync-period may be anything above 0; set, it must not be below it.
    assert parse_args([*base, "--sync-period", "100ms"]).sync_period == 0.1
