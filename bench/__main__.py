"""`python -m bench`: issue 15's scale scenarios in one command, written to bench/RESULTS.md.

    sudo .venv/bin/python -m bench                  # the issues' sizes (two hours or more:
                                                    # cold-start ~35 min, realcp-cold-start
                                                    # ~4 min, rolling-update
                                                    # ~35 min, churn ~7 min, fleet...)
    sudo .venv/bin/python -m bench --size small     # CI's sizes, into a temporary directory
    sudo .venv/bin/python -m bench --only huge-service agent-start

Each scenario is a module of its own (runnable alone, with more options), run here as a
child process writing JSON; a scenario that fails is reported as failed and the others
still run (the exit status says so). Then one section is written, between markers, at
the top of OUT/RESULTS.md (the hand-written record below it is kept): the machine, the
date, the commit, the command, each scenario's table (the module's own `markdown`) and
one plot per scenario in OUT/plots/ (PNG, matplotlib). Nothing is asserted on time.

Scenarios:
  cold-start     bench.realcp_latency: kube-apiserver v1.20.2 and its real controllers;
                 sliceproxy (iptables, nftables) and kube-proxy v1.20.2 side by side:
                 process start -> every rule, RSS, one endpoint change API -> kernel
  realcp-cold-start
                 bench.realcp_cold_start: issue 29's cold start in nftables mode on
                 kube-apiserver v1.20.2 with the objects written straight to it (no Pods,
                 no controller backlog), each start after the control plane is quiet,
                 Endpoints and EndpointSlices as sources: first nf_tables commit, every
                 rule, the agent's own figures, CPU, peak RSS
  agent-start    bench.agent_start: the agent alone on the simulator (RSS over time);
                 its later runs start over the rules the run before left (restarts)
  restart        bench.rule_sync (nftables): a restart over our own tables, unchanged
                 and with one service changed, beside a full resync: time, lines,
                 system CPU
  huge-service   bench.huge_service: one service, 10,000 endpoints in 100 slices
  fleet          bench.reflector_fleet: N agents' watch layers on one real API server
  rolling-update bench.rolling_update: every endpoint of a service replaced at 100 and
                 1,000 a second with traffic flowing, 1,000 / 10,000 / 50,000
                 endpoints: failed connections, API -> kernel lag, CPU, RSS
  churn          bench.churn: 10,000 services, random endpoint changes at 10 / 100 /
                 1,000 writes a second, isolated changes (also at 1,000 services), a
                 burst of 1,000 new services: API -> kernel lag, CPU (1-s windows), RSS
  memory         bench.memory: the agent's peak and steady memory (its RSS, and what a
                 container's memory cgroup is charged, the rules' kernel memory included)
                 at 10,000 / 30,000 / 50,000 services x 10 in each mode (IPVS in the
                 kernel lab): cold start, bursts, the periodic resync, a restart

Issue 29's pacing: rolling-update, churn and cold-start run sliceproxy twice, "old"
(`--min-sync-period 1s` passed explicitly) beside "new" (no pacing flag: the agent's
default), on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- python -m bench: begin -->", "<!-- python -m bench: end -->"


@dataclass(frozen=True)
class Run:
    """One child run of a scenario module: its arguments and a label."""

    label: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class Scenario:
    name: str
    module: str
    title: str
    sizes: dict[str, tuple[Run, ...]]
    # How the module takes its JSON output: "--json FILE", or "--json" to stdout.
    json_to_stdout: bool = False


SCENARIOS = (
    Scenario("cold-start", "bench.realcp_latency", "Cold start and one change on the real "
             "API server, side by side with kube-proxy", {
                 "small": (Run("30 services x 2", ("--services", "30", "--pods-per-service",
                                                   "2", "--changes", "4")),),
                 "full": (Run("1,000 services x 10", ("--services", "1000",
                                                      "--pods-per-service", "10",
                                                      "--changes", "20",
                                                      "--pacing", "old", "new")),
                          # kube-proxy on nf_tables takes seconds per change already at
                          # 1,000 services: at 10,000 it is left out.
                          Run("10,000 services x 10", (
                              "--services", "10000", "--pods-per-service", "10",
                              "--changes", "20", "--setup-deadline", "2400",
                              "--proxies", "sliceproxy-nftables", "sliceproxy",
                              "--pacing", "old", "new")))}),
    Scenario("realcp-cold-start", "bench.realcp_cold_start", "The nftables mode's cold start "
             "on a quiet real API server, objects written directly", {
                 "small": (Run("30 services x 2", ("--services", "30", "--endpoints", "2",
                                                   "--runs", "1")),),
                 "full": (Run("10,000 services x 10", ("--services", "10000", "--endpoints",
                                                       "10", "--runs", "3")),)}),
    Scenario("agent-start", "bench.agent_start", "The agent's cold start on the simulator", {
        "small": (Run("200 services x 5", ("--services", "200", "--endpoints", "5",
                                          "--runs", "2", "--idle", "1", "--delete", "20")),
                  # A restart as another build whose ports render otherwise: the tables
                  # rewritten a transaction each (from 1,000 ports on).
                  Run("1,000 services x 2, another build", (
                      "--services", "1000", "--endpoints", "2", "--runs", "2",
                      "--rewrite", "ports"))),
        "full": (Run("1,000 services x 10", ("--services", "1000", "--endpoints", "10",
                                            "--idle", "10")),
                 Run("10,000 services x 10", ("--services", "10000", "--endpoints", "10",
                                             "--idle", "10")),
                 # 198.18.0.0/15 holds no 100,000 ClusterIPs beside the pods: IPv6. Idle
                 # long enough after its first sync to add its input marks, which the
                 # restart run looks for (nftables/marks.py); 1,000 services are deleted
                 # before the restart, which its sweep removes.
                 Run("100,000 services x 10, IPv6", ("--services", "100000", "--endpoints",
                                                    "10", "--ipv6", "--runs", "2",
                                                    "--idle", "60", "--timeout", "1200",
                                                    "--delete", "1000")),
                 Run("100,000 services x 10, IPv6, another build", (
                     "--services", "100000", "--endpoints", "10", "--ipv6", "--runs", "2",
                     "--timeout", "1200", "--rewrite", "ports")))}),
    Scenario("restart", "bench.rule_sync", "nftables restarts over the agent's own tables, "
             "beside a full resync (what every restart wrote before)", {
                 "small": (Run("200 services x 5", ("--sizes", "200", "--endpoints", "5",
                                                   "--appliers", "nftables",
                                                   "--repeat", "1")),),
                 "full": (Run("10,000 and 50,000 services x 10", (
                     "--sizes", "10000", "50000", "--endpoints", "10", "--appliers",
                     "nftables", "--repeat", "3")),)},
             json_to_stdout=True),
    Scenario("huge-service", "bench.huge_service", "One service, many endpoints", {
        "small": (Run("500 endpoints", ("--endpoints", "500", "--changes", "5",
                                        "--planes", "model", "nftables", "iptables")),),
        "full": (Run("10,000 endpoints in 100 slices", ("--endpoints", "10000",
                                                       "--changes", "50")),)},
        json_to_stdout=True),
    Scenario("fleet", "bench.reflector_fleet", "Many nodes, one API server", {
        "small": (Run("3 agents, both first lists", ("--server", "real", "--size", "small",
                                                     "--agents", "3", "--first-list",
                                                     "cache", "consistent")),),
        "full": (Run("100, 500, 1,000 agents", ("--server", "real", "--size", "full")),)}),
    Scenario("rolling-update", "bench.rolling_update", "A rolling update with traffic", {
        "small": (Run("300 endpoints", ("--endpoints", "300", "--rate", "100", "1000",
                                        "--mode", "nftables")),),
        "full": (Run("1,000 endpoints", ("--endpoints", "1000", "--rate", "100", "1000")),
                 Run("10,000 endpoints", ("--endpoints", "10000", "--rate", "100", "1000",
                                          "--mode", "nftables")),
                 Run("50,000 endpoints at 100/s", ("--endpoints", "50000", "--rate", "100",
                                                   "--mode", "nftables")),
                 # Half the connections: the bench's own client threads would otherwise
                 # take a core of the two from the agent while it replaces 1,000 a second.
                 Run("50,000 endpoints at 1,000/s", ("--endpoints", "50000", "--rate",
                                                     "1000", "--mode", "nftables",
                                                     "--traffic-rate", "100")))}),
    Scenario("churn", "bench.churn", "Churn over many services, isolated changes, a burst", {
        "small": (Run("300 services x 3", ("--services", "300", "--rates", "10", "100",
                                           "--duration", "3", "--isolated", "5",
                                           "--burst", "50")),),
        "full": (Run("10,000 services x 3", ("--services", "10000")),
                 Run("1,000 services x 3, isolated changes", (
                     "--services", "1000", "--phases", "isolated")))}),
    Scenario("memory", "bench.memory", "The agent's memory by mode, size and situation", {
        "small": (Run("200 services x 5", ("--services", "200", "--endpoints", "5",
                                          "--modes", "nftables", "--burst-new", "50",
                                          "--sync-period", "6", "--settle", "1")),),
        "full": (Run("10,000 / 30,000 / 50,000 services x 10", (
            "--services", "10000", "30000", "50000", "--modes", "iptables", "nftables",
            "ipvs")),)}),
)


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                            capture_output=True, text=True, check=False).stdout.strip()
    return {"cpu": model or platform.processor(), "cpus": os.cpu_count(),
            "kernel": platform.release(), "python": platform.python_version(),
            "commit": commit or "?",
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def run_scenario(scenario: Scenario, size: str, work: Path,
                 log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every run of one scenario at one size: [{label, command, seconds, result|error}]."""
    out: list[dict[str, Any]] = []
    for i, run in enumerate(scenario.sizes[size]):
        target = work / f"{scenario.name}-{i}.json"
        cmd = [sys.executable, "-m", scenario.module, *run.args]
        cmd += ["--json"] if scenario.json_to_stdout else ["--json", str(target)]
        log(f"{scenario.name}: {run.label}: python {' '.join(cmd[1:])}")
        began = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        # As a reader would type it: the JSON goes to a temporary file of ours.
        shown = [*cmd[2:len(cmd) - (1 if scenario.json_to_stdout else 2)]]
        entry: dict[str, Any] = {"label": run.label, "command": " ".join(shown),
                                 "seconds": round(time.monotonic() - began, 1)}
        try:
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-1500:]}")
            entry["result"] = json.loads(proc.stdout if scenario.json_to_stdout
                                         else target.read_text())
        except (RuntimeError, OSError, ValueError) as exc:
            entry["error"] = str(exc)
            log(f"{scenario.name}: {run.label}: FAILED ({str(exc)[:300]})")
        out.append(entry)
    return out


# --- plots -------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ecdf(ax: Any, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot(scenario: str, runs: list[dict[str, Any]], path: Path) -> bool:
    """The scenario's distribution plot; False when no run had data for one."""
    plt = _pyplot()
    ok = [r for r in runs if "result" in r]
    if not ok:
        return False
    if scenario in SUMMARY_PLOTS:  # one figure across the runs: lag against size / rate
        fig, axes = plt.subplots(1, 3, figsize=(18, 4.5), squeeze=False)
        drawn = SUMMARY_PLOTS[scenario](list(axes[0]), ok)
        return _save(plt, fig, path, drawn)
    fig, axes = plt.subplots(1, len(ok), figsize=(6 * len(ok), 4), squeeze=False)
    drawn = False
    for ax, run in zip(axes[0], ok, strict=True):
        res = run["result"]
        if scenario == "cold-start":
            for proxy in res["proxies"]:  # its sides: "NAME/PACING" with --pacing
                values = [c[proxy]["seconds"] * 1000 for c in res["changes"]
                          if c.get(proxy) and c[proxy].get("seconds") is not None]
                _ecdf(ax, values, proxy)
                drawn |= bool(values)
            ax.set_xscale("log")
            ax.set_xlabel("API write -> rule in the kernel (ms, log)")
        elif scenario == "agent-start":
            for i, r in enumerate(res["runs"]):
                times = [t for t, _ in r["rss_timeline"]]
                ax.plot(times, [m for _, m in r["rss_timeline"]], label=f"run {i + 1}")
                ax.axvline(r["cold_start_s"], linestyle=":", color="grey")
                drawn |= bool(times)
            ax.set_xlabel("seconds since process start (dotted: every rule in)")
            ax.set_ylabel("RSS (MiB)")
        elif scenario == "huge-service":
            for row in res:
                values = row.get("total_ms", {}).get("samples", [])
                _ecdf(ax, values, row["plane"])
                drawn |= bool(values)
            ax.set_xscale("log")
            ax.set_xlabel("one endpoint not ready / ready -> kernel (ms, log)")
        elif scenario == "fleet":
            drawn |= _fleet_plot(ax, res)
        ax.set_title(run["label"])
        if scenario not in {"agent-start", "fleet"}:
            ax.set_ylabel("fraction of changes")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return _save(plt, fig, path, drawn)


def _save(plt: Any, fig: Any, path: Path, drawn: bool) -> bool:
    if drawn:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


PACING_STYLE = {"old": "--", "new": "-"}


def _rolling_plot(axes: list[Any], runs: list[dict[str, Any]]) -> bool:
    """Lag p99, p50 and agent CPU against the service's size, a line per mode, rate and
    pacing (old dashed, new solid)."""
    lines: dict[tuple[str, float, str], list[tuple[int, dict[str, Any]]]] = {}
    for run in runs:
        for row in run["result"]:
            key = (row["mode"], row["rate"], str(row.get("pacing", "old")))
            lines.setdefault(key, []).append((row["endpoints"], row))
    for (mode, rate, pacing), points in sorted(lines.items()):
        points.sort(key=lambda p: p[0])
        xs = [n for n, _ in points]
        label = f"{mode} {rate:g}/s, {pacing}"
        style = PACING_STYLE.get(pacing, ":")
        for ax, ys in zip(axes, (
                [r["lag"]["during"].get("p99") for _, r in points],
                [r["lag"]["during"].get("p50") for _, r in points],
                [r["agent"]["cpu_percent"] for _, r in points]), strict=True):
            ax.plot(xs, ys, style, marker="o", label=label)
    for ax, what in zip(axes, ("lag p99 (ms, log)", "lag p50 (ms, log)",
                               "agent CPU, % of one core, over the roll"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("endpoints in the service (log)")
        ax.set_ylabel(what)
        if "log" in what:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].set_title("slice write -> kernel, during the roll (old dashed, new solid)")
    axes[2].axhline(20, color="grey", linestyle=":", label="20% (the default budget)")
    axes[2].legend(fontsize=7)
    return bool(lines)


def _churn_plot(axes: list[Any], runs: list[dict[str, Any]]) -> bool:
    """Random churn's lag against the write rate; isolated changes' lag (ECDF); the
    burst's CPU in 1-s windows; old pacing dashed, new solid."""
    drawn = False
    for run in runs:
        res = run["result"]
        size = f"{res['services']:,} svc"
        for r in res["runs"]:
            style = PACING_STYLE.get(r["pacing"], ":")
            random_ = [p for p in r["phases"] if p["phase"] == "random"]
            if random_:
                rates = [p["rate"] for p in random_]
                for q, marker in (("p99", "o"), ("p50", "s")):
                    axes[0].plot(rates, [p["lag"].get(q) for p in random_], style,
                                 marker=marker, label=f"{size}, {r['pacing']}, {q}")
                drawn = True
            for p in r["phases"]:
                if p["phase"] == "isolated":
                    _ecdf(axes[1], p["lag"]["samples_ms"], f"{size}, {r['pacing']}")
                    drawn |= bool(p["lag"]["samples_ms"])
                elif p["phase"] == "burst" and p["cpu_1s"]:
                    axes[2].plot([t for t, _ in p["cpu_1s"]], [c for _, c in p["cpu_1s"]],
                                 style, marker=".", label=f"{size}, {r['pacing']}: "
                                 f"{p['changes']:,} services")
                    drawn = True
    axes[0].set(xscale="log", yscale="log", xlabel="random endpoint writes a second (log)",
                ylabel="slice write -> kernel (ms, log)", title="random churn")
    axes[1].set(xscale="log", xlabel="slice write -> kernel (ms, log)",
                ylabel="fraction of changes", title="isolated changes")
    axes[2].axhline(20, color="grey", linestyle=":", label="20% (the default budget)")
    axes[2].set(xlabel="seconds since the burst's first write",
                ylabel="agent CPU, % of one core, 1-s windows", title="a burst of new services")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return drawn


SUMMARY_PLOTS: dict[str, Callable[[list[Any], list[dict[str, Any]]], bool]] = {
    "rolling-update": _rolling_plot, "churn": _churn_plot}


def _fleet_plot(ax: Any, res: dict[str, Any]) -> bool:
    """API server CPU during a simultaneous start of N agents, per first-list kind."""
    by_kind: dict[str, list[tuple[int, float]]] = {}
    for row in res.get("runs", []):
        cpu = row.get("start", {}).get("apiserver", {}).get("cpu_s")
        if cpu is not None:
            by_kind.setdefault(str(row.get("first_list")), []).append((row["agents"], cpu))
    for kind, points in by_kind.items():
        points.sort()
        ax.plot([n for n, _ in points], [c for _, c in points], marker="o",
                label=f"first list: {kind}")
    ax.set_xlabel("agents started at once (N)")
    ax.set_ylabel("kube-apiserver CPU seconds until all listed")
    return bool(by_kind)


# --- RESULTS.md --------------------------------------------------------------------------


def section(size: str, argv: Sequence[str], host: dict[str, Any],
            results: dict[str, list[dict[str, Any]]], plots: dict[str, str]) -> str:
    lines = [BEGIN, "", "## Scale scenarios (`python -m bench`)", "",
             f"- command: `sudo .venv/bin/python -m bench {' '.join(argv)}`".rstrip() + " "
             f"(size {size})",
             f"- date: {host['date']}; commit {host['commit']}",
             f"- machine: {host['cpu']}, {host['cpus']} CPUs, kernel {host['kernel']}, "
             f"Python {host['python']}", ""]
    for scenario in SCENARIOS:
        if scenario.name not in results:
            continue
        lines += [f"### {scenario.title} (`{scenario.name}`)", ""]
        markdown = importlib.import_module(scenario.module).markdown
        for run in results[scenario.name]:
            lines += [f"**{run['label']}** — `python -m {run['command']}` "
                      f"({run['seconds']:.0f} s)", ""]
            if "error" in run:
                lines += ["```", f"failed: {run['error'][-800:]}", "```", ""]
                continue
            lines += [markdown(run["result"]).rstrip(), ""]
        if scenario.name in plots:
            lines += [f"![{scenario.name}]({plots[scenario.name]})", ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_results(path: Path, text: str) -> None:
    """Replace the generated section of `path` (or put it first), keeping the rest."""
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END) + "\n?", re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _m: text, old, count=1)
    else:
        head, sep, rest = old.partition("\n")  # after the title line, if there is one
        new = f"{head}{sep}\n{text}\n{rest}" if old.startswith("# ") else text + old
    path.write_text(new)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("small", "full"), default="full")
    ap.add_argument("--only", nargs="+", choices=[s.name for s in SCENARIOS])
    ap.add_argument("--out", type=Path, help="where RESULTS.md and plots/ go (default: "
                    "bench/ at full size, a temporary directory at small size)")
    args = ap.parse_args(argv)
    raw_argv = list(argv if argv is not None else sys.argv[1:])
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]

    def log(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    with tempfile.TemporaryDirectory(prefix="spx-bench-") as tmp:
        out = args.out or (ROOT / "bench" if args.size == "full" else Path(tmp) / "out")
        out.mkdir(parents=True, exist_ok=True)
        host = machine()
        results = {s.name: run_scenario(s, args.size, Path(tmp), log) for s in chosen}
        plots: dict[str, str] = {}
        for s in chosen:
            rel = f"plots/{s.name}-{args.size}.png"
            if plot(s.name, results[s.name], out / rel):
                plots[s.name] = rel
        write_results(out / "RESULTS.md", section(args.size, raw_argv, host, results, plots))
        (out / f"results-{args.size}.json").write_text(json.dumps(
            {"machine": host, "size": args.size, "results": results}, indent=1))
        log(f"wrote {out / 'RESULTS.md'} and {len(plots)} plot(s) in {out / 'plots'}")
        failed = [f"{s}: {r['label']}" for s, runs in results.items() for r in runs
                  if "error" in r]
        if failed:
            log("failed: " + "; ".join(failed))
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
