"""The import rules of docs/architecture.md, checked: which package of `proxy/` may import
which, no data-plane mode importing another, and mode packages that load only their own
code. Read from the source (every import statement, at module level or inside a
function), so a new module cannot break a rule unnoticed.

And the mode registry (proxy/dataplane/modes.py), checked against the modes' code: each
mode package is registered, each registered class, cleaner, kube-proxy section, object
name and counter is the one its code uses, and a mode added to the registry alone
reaches the flags, the factory, kube-proxy's file, the leftovers and the metrics."""

from __future__ import annotations

import ast
import functools
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.dataplane import modes

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "proxy"
MODES = modes.names()
# The packages of proxy/dataplane/ that every mode shares; each other one is a mode's.
SHARED = {"common", "xtables"}

# Package -> the packages it may import (besides itself). The dependency arrows of
# docs/architecture.md's layout, one way: model at the bottom, cmd at the top.
ALLOWED: dict[str, set[str]] = {
    "model": set(),
    "netns_lab": set(),
    "kube": {"model"},
    # The registry of modes (import-free: data and dotted paths) is read by the options,
    # the metrics (each mode's own counters) and the modes themselves (their names).
    "dataplane.modes": set(),
    "config": {"kube", "model", "dataplane.modes"},
    "sim": {"kube", "model"},
    "server": {"kube", "model", "dataplane.modes", "dataplane.base"},
    "dataplane.base": {"model"},
    "dataplane.common": {"dataplane.base", "model"},
    "dataplane.xtables": {"dataplane.base", "dataplane.common", "dataplane.modes", "model"},
    "dataplane.iptables": {"dataplane.base", "dataplane.common", "dataplane.xtables",
                           "dataplane.modes", "model"},
    "dataplane.ipvs": {"dataplane.base", "dataplane.common", "dataplane.xtables",
                       "dataplane.modes", "model"},
    "dataplane.nftables": {"dataplane.base", "dataplane.common", "dataplane.modes", "model"},
    # Build a mode's plane and clean up after any mode, by the registry's dotted paths:
    # they import a mode only inside a function.
    "dataplane.factory": {"dataplane.base", "dataplane.modes"},
    "dataplane.leftovers": {"dataplane.base", "dataplane.common", "dataplane.xtables",
                            "dataplane.modes", "model", *(f"dataplane.{m}" for m in MODES)},
    # The agent sees the data planes through their contract, the registry, the factory
    # and the clean-up (gives freed memory back with common.heap, holds the collector
    # off with common.collector, marks a change's sync for readings with common.priority).
    "agent": {"config", "kube", "model", "server", "dataplane.base", "dataplane.factory",
              "dataplane.leftovers", "dataplane.common", "dataplane.modes"},
    # The demo counts our kernel objects by the names the registry gives them.
    "cmd": {"agent", "config", "kube", "model", "netns_lab", "server", "sim",
            "dataplane.modes"},
    "__main__": {"cmd"},
}
LAZY_ONLY = {("dataplane.leftovers", f"dataplane.{m}") for m in MODES}
# Edges allowed for these modules only.
ONLY = {("agent", "dataplane.common"): {"proxy.dataplane.common.heap",
                                        "proxy.dataplane.common.collector",
                                        "proxy.dataplane.common.priority",
                                        "proxy.dataplane.common.node_files",
                                        "proxy.dataplane.common.node_settings",
                                        "proxy.dataplane.common.node_originals",
                                        "proxy.dataplane.common.foreign_proxy",
                                        "proxy.dataplane.common.kube_proxy_objects",
                                        # --cleanup: the table every mode shares
                                        "proxy.dataplane.common.fail_fast"}}


def package(module: str) -> str:
    """`proxy.dataplane.nftables.render` -> "dataplane.nftables"; `proxy.kube.x` -> "kube"."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "dataplane" and len(parts) > 1:
        return f"dataplane.{parts[1]}"
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported proxy module, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from proxy.dataplane import leftovers` names a module, not an attribute.
            names = [f"{node.module}.{a.name}" for a in node.names]
            targets = names if package(node.module) in ("", "dataplane") else [node.module]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(t, id(node) in top) for t in targets if t.startswith("proxy.")]
    return found


@functools.cache  # the source does not change during a run: read it once
def edges(with_target: bool = False) -> list[tuple[str, str, str, bool]]:
    """(importing module, its package, imported package (or module), at module level?)"""
    out = []
    for path in sorted(PROXY.rglob("*.py")):
        mod = module_name(path)
        src = package(mod) if mod != "proxy.__main__" else "__main__"
        for target, top_level in imports(path):
            dst = package(target)
            if dst != src:
                out.append((mod, src, target if with_target else dst, top_level))
    return out


def test_the_rules_cover_every_package() -> None:
    found = {src for _, src, _, _ in edges()} | {dst for _, _, dst, _ in edges()}
    assert found - set(ALLOWED) == set()
    assert len(edges()) > 100  # the scan sees the imports


def test_each_package_imports_only_what_the_layout_allows() -> None:
    wrong = [f"{mod} imports {dst}" for mod, src, dst, _ in edges()
             if dst not in ALLOWED.get(src, set())]
    assert wrong == []
    narrow = [f"{mod} imports {target}" for mod, src, target, _ in edges(with_target=True)
              if (src, package(target)) in ONLY
              and not any(target.startswith(m) for m in ONLY[(src, package(target))])]
    assert narrow == []


def test_no_mode_imports_another_and_the_two_that_know_them_import_lazily() -> None:
    wrong = [f"{mod} imports {dst}" for mod, src, dst, _ in edges()
             if src.removeprefix("dataplane.") in MODES and dst.removeprefix("dataplane.")
             in MODES]
    assert wrong == []
    eager = [f"{mod} imports {dst} at module level" for mod, src, dst, top in edges()
             if (src, dst) in LAZY_ONLY and top]
    assert eager == []


@pytest.mark.parametrize("mode", modes.names())
def test_a_mode_s_modules_load_no_other_mode(mode: str) -> None:
    """What factory.py promises: selecting a mode loads that mode's code only. Every
    module of the mode's package, imported in a fresh interpreter."""
    mine = sorted(f"proxy.dataplane.{mode}.{p.stem}"
                  for p in (PROXY / "dataplane" / mode).glob("*.py") if p.stem != "__init__")
    code = ("import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('proxy.dataplane.')))")
    loaded = subprocess.run([sys.executable, "-c", code, *mine], capture_output=True,
                            text=True, check=True, cwd=ROOT, timeout=60).stdout.split()
    assert set(mine) <= set(loaded)
    others = [m for m in loaded if package(m).removeprefix("dataplane.") in MODES
              and package(m) != f"dataplane.{mode}"]
    assert others == []


def test_what_starts_every_agent_loads_no_mode() -> None:
    """The options, the factory and the leftovers' probes read the registry at every
    start: none of them loads a mode's code (5 to 30 ms each) until asked to."""
    code = ("import sys; import proxy.config.options, proxy.dataplane.factory, "
            "proxy.dataplane.leftovers, proxy.server.metrics; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('proxy.dataplane.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT, timeout=60).stdout.split()
    assert "proxy.dataplane.modes" in loaded
    assert [m for m in loaded if package(m).removeprefix("dataplane.") in MODES] == []


# --- the registry against the modes' code ----------------------------------------------


def test_every_mode_package_is_registered_and_every_mode_has_one() -> None:
    packages = {p.name for p in (PROXY / "dataplane").iterdir()
                if (p / "__init__.py").exists()} - SHARED
    assert packages == set(MODES)
    for mode in modes.MODES:
        assert mode.plane.startswith(f"proxy.dataplane.{mode.name}."), mode.name


@pytest.mark.parametrize("mode", modes.MODES, ids=MODES)
def test_each_mode_s_plane_and_cleaner_are_what_the_registry_names(mode: modes.Mode) -> None:
    from proxy.dataplane.factory import dataplane_class

    plane = dataplane_class(mode.name)
    said = inspect.getattr_static(plane, "mode")  # a class attribute, or a property
    assert (said.fget(None) if isinstance(said, property) else said) == mode.name
    cleaner: Any = modes.load(mode.cleaner)
    assert list(inspect.signature(cleaner).parameters)[:3] == ["found", "running",
                                                              "options"]


def test_each_mode_reads_its_own_sections_of_kube_proxy_s_file() -> None:
    from proxy.config import kubeproxy_file

    for mode in modes.MODES:
        assert f"{mode.config_section}.syncPeriod" in kubeproxy_file.HONOURED
        assert f"{mode.config_section}.minSyncPeriod" in kubeproxy_file.HONOURED
        assert f"{mode.masquerade_section}.masqueradeAll" in kubeproxy_file.HONOURED
        assert f"{mode.masquerade_section}.masqueradeBit" in kubeproxy_file.GUARDED


def test_the_names_the_leftovers_know_are_the_ones_each_mode_writes() -> None:
    from proxy.dataplane.iptables import render as iptables_render
    from proxy.dataplane.ipvs import netfilter as ipvs_netfilter
    from proxy.dataplane.ipvs import render as ipvs_render
    from proxy.dataplane.leftovers import chain_mode, interface_mode, table_mode
    from proxy.dataplane.nftables import render as nft_render
    from proxy.dataplane.xtables.saved import Table

    # Every chain each x_tables mode declares is told to be its own, and its marker is
    # one of its nat chains.
    assert iptables_render.PREFIX == modes.CHAIN_PREFIX
    iptables_chains = {c for _, c in iptables_render.DISPATCH_CHAINS} | {
        iptables_render.MARK_MASQ, iptables_render.MASQ_UNLESS_POD}
    assert {chain_mode(c) for c in iptables_chains} == {"iptables"}
    assert (Table.NAT, modes.IPTABLES.markers.marker_chain) in iptables_render.DISPATCH_CHAINS
    ipvs_chains = {c for chains in ipvs_netfilter.CHAINS.values() for c in chains}
    assert {chain_mode(c) for c in ipvs_chains} == {"ipvs"}
    assert modes.IPVS.markers.marker_chain in ipvs_netfilter.CHAINS["nat"]
    assert interface_mode(ipvs_render.DUMMY_INTERFACE) == "ipvs"
    # The nftables mode's tables, shards included.
    assert nft_render.our_tables() == modes.NFTABLES.markers.tables()
    assert {table_mode(nft_render.shard_table(i)) for i in range(nft_render.MAX_SHARDS)} \
        == {"nftables"}
    # No two modes claim one name.
    for kind in ("marker_chain", "dummy_interface", "table"):
        named = [getattr(m.markers, kind) for m in modes.MODES if getattr(m.markers, kind)]
        assert len(named) == len(set(named)), kind


def test_each_mode_counter_is_declared_once_and_served() -> None:
    from proxy.server.metrics import AgentMetrics

    declared = [c for c in vars(modes).values() if isinstance(c, modes.ModeCounter)]
    registered = [c for m in modes.MODES for c in m.counters]
    assert sorted(c.name for c in declared) == sorted(c.name for c in registered)
    assert set(AgentMetrics().mode_counters) == {c.name for c in registered}


# --- a mode added to the registry alone ---------------------------------------------


class ToyPlane:
    mode = "toy"

    def __init__(self, options: object) -> None:
        self.options = options


def clean_toy(found: Any, running: str, options: object) -> str:
    return f"{len(found.chains)} toy chains, running {running}"


TOY = modes.Mode(
    name="toy", plane=f"{__name__}:ToyPlane", cleaner=f"{__name__}:clean_toy",
    markers=modes.Markers(chain_prefix="SPX-TOY-", marker_chain="SPX-TOY-SERVICES"),
    config_section="nftables", masquerade_section="nftables",
    counters=(modes.ModeCounter("sliceproxy_toy_failures", "toy failures"),))


def test_a_mode_in_the_registry_alone_reaches_everything_that_knows_modes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.config import kubeproxy_file, options
    from proxy.dataplane import leftovers
    from proxy.dataplane.base import DataplaneOptions
    from proxy.dataplane.factory import make_dataplane
    from proxy.model.types import Family
    from proxy.server.metrics import AgentMetrics

    monkeypatch.setattr(modes, "MODES", (*modes.MODES, TOY))
    # The flags (and a config file's `proxy-mode`), and kube-proxy's file.
    assert "toy" in options.choices("proxy_mode")
    assert options.parse_args(["--proxy-mode", "toy"]).proxy_mode == "toy"
    settings, _, _ = kubeproxy_file.translate({
        "apiVersion": kubeproxy_file.API_VERSION, "kind": kubeproxy_file.KIND,
        "mode": "toy", "nftables": {"syncPeriod": "5m"}})
    assert (settings["proxy_mode"], settings["sync_period"]) == ("toy", "5m")
    # The factory.
    plane: Any = make_dataplane("toy", DataplaneOptions("node-a"))
    assert isinstance(plane, ToyPlane)
    # The leftovers: probed for and removed when another mode runs, by its cleaner.
    assert "SPX-TOY-SERVICES" in leftovers.probes("nftables").nft_markers
    found = leftovers.Found(chains=[leftovers.Chain("nft", Family.V4, "SPX-TOY-SERVICES")])
    assert leftovers.clean("nftables", DataplaneOptions("node-a"), lambda mode: found) == {
        "toy": "1 toy chains, running nftables"}
    # Its own counter.
    metrics = AgentMetrics()
    metrics.count_mode({"sliceproxy_toy_failures": 2})
    assert metrics.registry.get_sample_value("sliceproxy_toy_failures_total") == 2
