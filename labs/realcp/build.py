"""Build Kubernetes v1.20.2's binaries (control plane, kube-proxy, kubeadm, kubelet, ...)
from Debian's source.

No registry ships these binaries; Debian bookworm ships the whole upstream v1.20.2 tree
(with vendor/) as the source package ``kubernetes``. This module installs what the build
needs, fetches that source package and runs upstream's Makefile once, caching the binaries
OUTSIDE the clone (CI uses a fresh clone on the same machine), keyed by the source package
version. A second run only checks the cache. Two concurrent runs serialise on a file lock.

    python -m labs.realcp.build          # build (or reuse) and print the bin directory

Failures raise BuildError with the log's tail; the log stays in the cache directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from labs.debian import CACHE_ROOT, dpkg_installed, locked

log = logging.getLogger("realcp.build")

SOURCE_PACKAGE = "kubernetes"
UPSTREAM_VERSION = "v1.20.2"
# kubeadm: for the configuration files it writes (tests/realcp/test_kube_proxy_config.py);
# kubelet and kube-scheduler: the real nodes of the cluster tier (tests/nodes/).
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-proxy", "kubeadm", "kubelet",
            "kube-scheduler")
# The pod sandbox's process, built from the tree's build/pause/linux/pause.c (a small C
# program) with gcc -static: the sandbox image of the real nodes (nothing can be pulled).
PAUSE = "pause"
PAUSE_SOURCE = Path("build/pause/linux/pause.c")
# etcd-client brings etcdctl (compaction in the conformance tests); rsync is used by
# upstream's build scripts; make runs them.
APT_PACKAGES = ("golang-1.19-go", "rsync", "etcd-server", "etcd-client", "make", "dpkg-dev",
                "golang-github-modern-go-reflect2-dev")
GO_BIN = Path("/usr/lib/go-1.19/bin")
DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
DEB_SRC_FILE = Path("/etc/apt/sources.list.d/sliceproxy-deb-src.sources")
MANIFEST = "manifest.json"
# Bumped whenever the recipe (patches, flags) changes, so an old cache is not reused.
RECIPE = 3
# Vendored Go packages replaced before building, by Debian's packaged source. v1.20.2
# vendors modern-go/reflect2 v1.0.1, which walks maps with the pre-Go-1.18 runtime
# iterator layout: built with Go 1.19, kube-apiserver dies with SIGSEGV in mapiterinit
# while encoding JSON (seen here on the first few requests). v1.0.2 fixed exactly that.
VENDOR_OVERRIDES = {
    "github.com/modern-go/reflect2": Path("/usr/share/gocode/src/github.com/modern-go/reflect2"),
}


class BuildError(RuntimeError):
    """The control-plane binaries could not be built; the message says where to look."""


@dataclass(frozen=True, slots=True)
class Binaries:
    """Where the cached binaries are, and what produced them."""

    bin_dir: Path
    source_version: str
    built_seconds: float  # wall time of the build that filled this cache
    reused: bool  # True when this call found the cache ready

    def path(self, name: str) -> Path:
        return self.bin_dir / name


def _run(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
         logfile: Path | None = None) -> str:
    """Run a command; on failure raise BuildError naming it, with the output's tail."""
    log.info("run", extra={"cmd": " ".join(cmd), "cwd": str(cwd or "")})
    if logfile is None:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                             f"{(proc.stdout + proc.stderr)[-4000:]}")
        return proc.stdout
    with logfile.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              check=False).returncode
    if code != 0:
        tail = logfile.read_text(errors="replace")[-4000:]
        raise BuildError(f"{' '.join(cmd)} exited {code}; full log: {logfile}\n"
                         f"--- last lines ---\n{tail}")
    return ""


def deb_src_stanzas(deb_sources: str) -> str:
    """The ``deb`` stanzas of a deb822 sources file, rewritten as ``deb-src`` (pure)."""
    out: list[str] = []
    for stanza in re.split(r"\n\s*\n", deb_sources.strip()):
        lines = [ln for ln in stanza.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        types = [ln for ln in lines if ln.lower().startswith("types:")]
        if not types or "deb" not in types[0].split(":", 1)[1].split():
            continue
        body = [("Types: deb-src" if ln.lower().startswith("types:") else ln) for ln in lines]
        out.append("\n".join(body))
    return "\n\n".join(out) + ("\n" if out else "")


def _deb_src_enabled() -> bool:
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        if path == DEB_SRC_FILE or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if re.search(r"^\s*deb-src\s", text, re.M) or re.search(
                r"^Types:.*\bdeb-src\b", text, re.M | re.I):
            return True
    return False


def ensure_apt(logfile: Path) -> None:
    """Enable source packages (idempotently) and install the build's Debian packages."""
    changed = False
    if not _deb_src_enabled():
        want = deb_src_stanzas(DEBIAN_SOURCES.read_text())
        if not want:
            raise BuildError(f"no deb stanza in {DEBIAN_SOURCES} to mirror as deb-src")
        if not DEB_SRC_FILE.exists() or DEB_SRC_FILE.read_text() != want:
            DEB_SRC_FILE.write_text(want)
            log.info("enabled deb-src", extra={"file": str(DEB_SRC_FILE)})
            changed = True
    missing = [p for p in APT_PACKAGES if not dpkg_installed(p)]
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if changed or missing or not _has_source_index():
        _run(["apt-get", "update", "-qq"], env=apt_env, logfile=logfile)
    if missing:
        _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
             env=apt_env, logfile=logfile)


def _has_source_index() -> bool:
    return any(Path("/var/lib/apt/lists").glob("*_source_Sources*"))


def source_version() -> str:
    """The candidate version of the ``kubernetes`` source package (the cache key)."""
    out = _run(["apt-cache", "showsrc", SOURCE_PACKAGE])
    versions = re.findall(r"^Version:\s*(\S+)", out, re.M)
    if not versions:
        raise BuildError(f"apt-cache showsrc {SOURCE_PACKAGE}: no Version (deb-src enabled?)")
    # Several suites may list it; the build is keyed by the highest one apt would fetch.
    best = str(versions[0])
    for v in versions[1:]:
        if subprocess.run(["dpkg", "--compare-versions", v, "gt", best],
                          check=False).returncode == 0:
            best = v
    return best


def cache_dir(version: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9.+-]", "_", version)
    return CACHE_ROOT / f"kubernetes-{UPSTREAM_VERSION}-deb{safe}-r{RECIPE}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached(version: str) -> Binaries | None:
    """The cache for ``version`` if complete and intact (manifest + matching hashes)."""
    root = cache_dir(version)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    bin_dir = root / "bin"
    for name in (*BINARIES, PAUSE):
        p = bin_dir / name
        if not p.is_file() or manifest.get("sha256", {}).get(name) != _sha256(p):
            log.warning("cache entry invalid", extra={"binary": str(p)})
            return None
    return Binaries(bin_dir, version, float(manifest.get("built_seconds", 0.0)), reused=True)


def _fetch_source(version: str, work: Path, logfile: Path) -> Path:
    """Download the source package into ``work`` and unpack its orig tarball; return the tree."""
    work.mkdir(parents=True, exist_ok=True)
    origs = list(work.glob(f"{SOURCE_PACKAGE}_*.orig.tar.*"))
    if not origs:
        _run(["apt-get", "source", "--download-only", f"{SOURCE_PACKAGE}={version}"],
             cwd=work, logfile=logfile)
        origs = list(work.glob(f"{SOURCE_PACKAGE}_*.orig.tar.*"))
    # The Debian package may carry component tarballs (orig-foo.tar.*); the main one holds
    # the upstream tree with vendor/.
    main = [o for o in origs if re.search(r"\.orig\.tar\.", o.name)]
    if len(main) != 1:
        raise BuildError(f"expected one orig tarball in {work}, found {[o.name for o in origs]}")
    tree = work / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir()
    with tarfile.open(main[0]) as tar:
        tar.extractall(tree, filter="tar")
    # Tarballs unpack into one top directory.
    tops = list(tree.iterdir())
    root = tops[0] if len(tops) == 1 and tops[0].is_dir() else tree
    if not (root / "Makefile").is_file() or not (root / "vendor").is_dir():
        raise BuildError(f"{root} does not look like the Kubernetes tree (no Makefile/vendor)")
    return root


def _override_vendor(tree: Path, logfile: Path) -> None:
    """Replace the VENDOR_OVERRIDES packages in the tree's vendor/ (Go and assembly only)."""
    for package, source in VENDOR_OVERRIDES.items():
        files = [f for f in source.iterdir()
                 if f.suffix in (".go", ".s") and not f.name.endswith("_test.go")]
        if not files:
            raise BuildError(f"{source} has no Go files (is its -dev package installed?)")
        target = tree / "vendor" / package
        shutil.rmtree(target)
        target.mkdir(parents=True)
        for f in files:
            shutil.copy2(f, target / f.name)
        with logfile.open("a") as out:
            out.write(f"# vendor/{package} replaced by {source} ({len(files)} files)\n")


def _build_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GO", "KUBE_")) and k not in ("CGO_ENABLED",)}
    env.update({
        "PATH": f"{GO_BIN}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}",
        "GOCACHE": str(work / "gocache"),
        "HOME": str(work / "home"),
        "KUBE_GIT_VERSION": UPSTREAM_VERSION,
        "KUBE_GIT_TREE_STATE": "clean",
        "KUBE_GIT_MAJOR": "1",
        "KUBE_GIT_MINOR": "20",
    })
    (work / "home").mkdir(parents=True, exist_ok=True)
    return env


def _find_output(tree: Path, name: str) -> Path:
    for cand in (tree / "_output/local/go/bin" / name, tree / "_output/bin" / name):
        if cand.is_file():
            return cand
    found = list((tree / "_output").rglob(name)) if (tree / "_output").exists() else []
    files = [f for f in found if f.is_file() and os.access(f, os.X_OK)]
    if not files:
        raise BuildError(f"build finished but {name} is not under {tree / '_output'}")
    return files[0]


def build(*, force: bool = False) -> Binaries:
    """Return the cached binaries, building them first if needed (serialised by a lock)."""
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    bootstrap_log = CACHE_ROOT / "apt.log"
    with locked(CACHE_ROOT / "apt.lock"):
        ensure_apt(bootstrap_log)
    version = source_version()
    root = cache_dir(version)
    with locked(CACHE_ROOT / f"{root.name}.lock"):
        if not force and (hit := cached(version)) is not None:
            return hit
        root.mkdir(parents=True, exist_ok=True)
        logfile = root / "build.log"
        logfile.write_text(f"# building {SOURCE_PACKAGE} {version} at {time.ctime()}\n")
        work = root / "work"
        started = time.monotonic()
        tree = _fetch_source(version, work / "src", logfile)
        _override_vendor(tree, logfile)
        what = " ".join(f"cmd/{b}" for b in BINARIES)
        log.info("building", extra={"what": what, "log": str(logfile)})
        _run(["make", f"WHAT={what}"], env=_build_env(work), cwd=tree, logfile=logfile)
        bin_dir = root / "bin"
        bin_dir.mkdir(exist_ok=True)
        hashes = {}
        for name in BINARIES:
            dst = bin_dir / name
            shutil.copy2(_find_output(tree, name), dst)
            hashes[name] = _sha256(dst)
            _check_version(dst)
        pause = bin_dir / PAUSE
        _run(["gcc", "-Os", "-static", "-Wall", "-Werror",
              f"-DVERSION={UPSTREAM_VERSION}", "-o", str(pause), str(tree / PAUSE_SOURCE)],
             logfile=logfile)
        hashes[PAUSE] = _sha256(pause)
        elapsed = time.monotonic() - started
        # The manifest is written last and atomically: it is what marks the cache complete.
        tmp = root / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({
            "source_package": SOURCE_PACKAGE, "source_version": version,
            "upstream_version": UPSTREAM_VERSION, "built_seconds": round(elapsed, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sha256": hashes,
        }, indent=2))
        tmp.replace(root / MANIFEST)
        # The tree and Go cache are ~2 GB; the binaries are all later runs need.
        shutil.rmtree(work, ignore_errors=True)
        with logfile.open("a") as out:
            out.write(f"\n# done in {elapsed:.0f}s\n")
        return Binaries(bin_dir, version, elapsed, reused=False)


def _check_version(binary: Path) -> None:
    flags = ["version", "-o", "short"] if binary.name == "kubeadm" else ["--version"]
    out = _run([str(binary), *flags])
    if UPSTREAM_VERSION not in out:
        raise BuildError(f"{binary} --version says {out.strip()!r}, expected {UPSTREAM_VERSION}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labs.realcp.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        bins = build(force=args.force)
    except BuildError as e:
        print(f"realcp build FAILED: {e}", file=sys.stderr)
        return 1
    state = "reused" if bins.reused else "built"
    print(f"{state} {UPSTREAM_VERSION} (source {bins.source_version}, build took "
          f"{bins.built_seconds:.0f}s): {bins.bin_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
