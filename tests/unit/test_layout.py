"""The import rules of docs/architecture.md, checked: which package of `proxy/` may import
which, no data-plane mode importing another, and mode packages that load only their own
code. Read from the source (every import statement, at module level or inside a
function), so a new module cannot break a rule unnoticed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "proxy"
MODES = ("iptables", "nftables", "ipvs")

# Package -> the packages it may import (besides itself). The dependency arrows of
# docs/architecture.md's layout, one way: model at the bottom, cmd at the top.
ALLOWED: dict[str, set[str]] = {
    "model": set(),
    "lab": set(),
    "kube": {"model"},
    "config": {"kube", "model"},
    "sim": {"kube", "model"},
    "server": {"kube", "model"},
    "dataplane.base": {"model"},
    "dataplane.common": {"dataplane.base", "model"},
    "dataplane.xtables": {"dataplane.base", "dataplane.common", "model"},
    "dataplane.iptables": {"dataplane.base", "dataplane.common", "dataplane.xtables", "model"},
    "dataplane.ipvs": {"dataplane.base", "dataplane.common", "dataplane.xtables", "model"},
    "dataplane.nftables": {"dataplane.base", "dataplane.common", "model"},
    # Picks a mode by name (importlib) and cleans up after any mode: the two places
    # that know every mode, and they import a mode only inside a function.
    "dataplane.factory": {"dataplane.base"},
    "dataplane.leftovers": {"dataplane.base", "dataplane.common", "dataplane.xtables",
                            "model", *(f"dataplane.{m}" for m in MODES)},
    # The agent sees the data planes through their contract, the factory and the
    # clean-up (and gives freed memory back with common.heap).
    "agent": {"config", "kube", "model", "server", "dataplane.base", "dataplane.factory",
              "dataplane.leftovers", "dataplane.common"},
    "cmd": {"agent", "config", "kube", "lab", "model", "server", "sim"},
    "__main__": {"cmd"},
}
LAZY_ONLY = {("dataplane.leftovers", f"dataplane.{m}") for m in MODES}
# Edges allowed for these modules only.
ONLY = {("agent", "dataplane.common"): {"proxy.dataplane.common.heap",
                                        "proxy.dataplane.common.node_files",
                                        "proxy.dataplane.common.node_settings",
                                        "proxy.dataplane.common.node_originals",
                                        "proxy.dataplane.common.foreign_proxy",
                                        "proxy.dataplane.common.kube_proxy_objects"}}


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


@pytest.mark.parametrize("module", [
    "proxy.dataplane.nftables.render", "proxy.dataplane.nftables.apply",
    "proxy.dataplane.iptables.render", "proxy.dataplane.iptables.apply",
    "proxy.dataplane.ipvs.render", "proxy.dataplane.ipvs.apply",
])
def test_a_mode_module_loads_no_other_mode(module: str) -> None:
    """What factory.py promises: selecting a mode loads that mode's code only."""
    mine = module.split(".")[2]
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            "print('\\n'.join(m for m in sys.modules if m.startswith('proxy.dataplane.')))")
    loaded = subprocess.run([sys.executable, "-c", code, module], capture_output=True,
                            text=True, check=True, cwd=ROOT, timeout=60).stdout.split()
    assert module in loaded
    others = [m for m in loaded if package(m).removeprefix("dataplane.") in MODES
              and package(m) != f"dataplane.{mine}"]
    assert others == []
