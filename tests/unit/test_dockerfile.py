"""The Dockerfile, without a Docker engine (tests/nodes builds the real image with buildah
and runs it on real nodes): every file it copies exists and survives
.dockerignore, the base and packages are what the data planes need, it runs unprivileged
by default, and its build steps work: the wheel built from exactly the build context
installs and runs `python -m proxy` (the entrypoint)."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a pattern that
    matches a directory covers what is under it."""
    result = False
    for pattern in ignore_patterns():
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        matched = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if pat.startswith("**/"):
            matched = matched or any(fnmatch.fnmatch(part, pat[3:]) for part in parts)
        if matched:
            result = not negate
    return result


def context_files() -> list[Path]:
    """What `docker build .` would send: every file not excluded by .dockerignore."""
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith((".git/", ".venv/")) or not path.is_file():
            continue
        if not ignored(rel):
            files.append(path)
    return files


def copy_sources() -> list[str]:
    sources = []
    for word, args in instructions():
        if word == "COPY" and "--from=" not in args:
            *srcs, _dest = args.split()
            sources.extend(srcs)
    return sources


def test_every_copy_source_exists_and_is_in_the_build_context() -> None:
    sources = copy_sources()
    assert sources, "the Dockerfile copies the sources"
    in_context = {p.relative_to(ROOT).as_posix() for p in context_files()}
    for src in sources:
        assert (ROOT / src).exists(), src
        if (ROOT / src).is_dir():
            assert any(f.startswith(src + "/") for f in in_context), src
        else:
            assert src in in_context, src


def test_build_context_is_small_and_free_of_local_state() -> None:
    rels = [p.relative_to(ROOT).as_posix() for p in context_files()]
    assert not [r for r in rels if "__pycache__" in r or r.startswith(("tests/", ".cache"))]
    assert all(r.startswith("proxy/") or r in ("pyproject.toml", "README.md", "LICENSE")
               for r in rels)


def test_slim_base_tools_non_root_and_entrypoint() -> None:
    steps = instructions()
    bases = [args for word, args in steps if word == "FROM"]
    assert bases and all("slim" in b for b in bases)
    installs = " ".join(args for word, args in steps if word == "RUN" and "apt-get" in args)
    for pkg in ("iptables", "ipset", "conntrack", "ipvsadm", "nftables"):
        assert f" {pkg} " in f" {installs} ", pkg
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1] not in ("0", "root")
    (entry,) = [json.loads(args) for word, args in steps if word == "ENTRYPOINT"]
    assert entry == ["python", "-m", "proxy"]
    runs = [args for word, args in steps if word == "RUN"]
    # Dependencies from pyproject.toml's own list first (a layer of their own), then the
    # package without them: the image's code is what the build context holds.
    (deps,) = [r for r in runs if "tomllib" in r]
    script = re.search(r"-c '([^']*)'", deps)
    assert script, deps
    listed = subprocess.run([sys.executable, "-c", script.group(1)], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\n")
    assert [d for d in listed if d] == tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any("pip install --no-cache-dir --no-deps ." in r for r in runs)


@pytest.mark.slow
def test_the_wheel_built_from_the_context_runs_the_entrypoint(tmp_path: Path) -> None:
    context = tmp_path / "context"
    for path in context_files():
        target = context / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(context)],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("sliceproxy-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    where = subprocess.run(
        [sys.executable, "-c", "import proxy.agent.app, proxy.sim, proxy.netns_lab; "
                               "print(proxy.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert where.stdout.strip().startswith(str(site))
    # The ENTRYPOINT, as the container runs it (`docker run IMAGE --help`).
    proc = subprocess.run([sys.executable, "-m", "proxy", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "--proxy-mode" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "proxy", "explain", str(ROOT / "examples"),
                           "--service", "demo/web"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and '"demo/web"' in proc.stdout, proc.stderr
    # The commands the package installs beside the entrypoint (docs/image.md).
    (entry_points,) = site.glob("sliceproxy-*.dist-info/entry_points.txt")
    scripts = entry_points.read_text()
    assert "sliceproxy = proxy.cmd.cli:main" in scripts
    assert "kubectl-sliceproxy = proxy.cmd.kubectl_plugin:main" in scripts
