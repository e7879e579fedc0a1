"""What an operator types at a node: `python -m proxy explain` on a real terminal (tmux,
read back with capture-pane), `python -m proxy dump` against a running agent, and the
`kubectl sliceproxy` plugin run by the real kubectl against the simulator. The agent
here has a recording data plane: nothing is written to the host's kernel."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.cmd.explain import explain
from proxy.kube.ingest import EndpointsSource
from proxy.kube.manifests import load_paths
from proxy.sim import SimServer
from tests.integration.agent_harness import AgentThread, running_agent, wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
VENV_BIN = Path(sys.executable).parent
TMUX, KUBECTL = Path("/usr/bin/tmux"), Path("/usr/bin/kubectl")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[SimServer, AgentThread]]:
    with SimServer(objects=load_paths([str(EXAMPLES)])) as sim, \
            running_agent(sim, tmp_path) as agent:
        wait_until(lambda: agent.dataplane.syncs, timeout=20, what="the first sync")
        yield sim, agent


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, cwd=ROOT, timeout=60,
                          check=False, env={**os.environ, **(env or {})})


def address(agent: AgentThread) -> str:
    host, port = agent.config.metrics_bind_address
    return f"{host}:{port}"


def offline(service: str) -> list[dict[str, Any]]:
    """explain's service ports for the example files."""
    services: list[dict[str, Any]] = explain(
        load_paths([str(EXAMPLES)]), node_name="node-a", node_labels={},
        source=EndpointsSource.ENDPOINT_SLICES, service=service)["services"]
    return services


def agents_view(agent: AgentThread, service: str) -> list[dict[str, Any]]:
    """The running agent's service ports (the cluster as the API server keeps it: node
    ports allocated), without the rules and the kernel's counts: explain's shape."""
    return [{k: v for k, v in s.items() if k not in ("applied_rules", "traffic")}
            for s in agent.dump(service)["services"]]


def test_dump_shows_a_running_agent_as_a_table_and_as_its_json(
        cluster: tuple[SimServer, AgentThread]) -> None:
    _sim, agent = cluster
    proc = run(sys.executable, "-m", "proxy", "dump", address(agent), "--service",
               "demo/web", "-o", "table")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "node node-a (zone zone-a)"
    assert any(line.startswith("demo/web:http  IPv4 TCP 80  cluster IP 198.18.128.10  "
                               "node port 30080") for line in lines), lines
    assert any(line.split()[:3] == ["198.18.1.11:8080", "ready", "node-a"] for line in lines)
    assert any(line.split()[:4] == ["198.18.1.13:8080", "not", "ready", "node-b"]
               for line in lines)
    assert "  rules  2 in the kernel for this port (-o json lists them)" in lines
    # The data plane's counts (the harness's fake counts one connection per port).
    assert ("  traffic  1 new connections (counted per port: "
            "sliceproxy.io/traffic-per-endpoint for each endpoint's)") in lines
    assert not any(line.startswith("demo/nearby") for line in lines)  # --service
    # -o json: the very document the agent serves (with its rules), as explain's shape.
    proc = run(sys.executable, "-m", "proxy", "dump", address(agent), "--service",
               "demo/web", "-o", "json")
    doc = json.loads(proc.stdout)
    assert [{k: v for k, v in s.items() if k not in ("applied_rules", "traffic")}
            for s in doc["services"]] == agents_view(agent, "demo/web")
    assert doc["services"][1]["traffic"] == {"connections": 1, "endpoints": None}
    assert doc["services"][1]["applied_rules"] == ["-> 198.18.1.11:8080", "-> 198.18.1.12:8080"]


def test_dump_says_why_when_no_agent_answers(tmp_path: Path) -> None:
    from tests.integration.agent_harness import free_port

    proc = run(sys.executable, "-m", "proxy", "dump", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "is the agent running, and is this its --metrics-bind-address?" in proc.stderr


def test_kubectl_runs_the_plugin_against_the_cluster_it_points_at(
        cluster: tuple[SimServer, AgentThread], tmp_path: Path) -> None:
    if not KUBECTL.exists():
        pytest.fail("/usr/bin/kubectl is expected on this machine image")
    sim, agent = cluster
    env = {"KUBECONFIG": str(sim.write_kubeconfig(tmp_path / "kubeconfig")),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "HOME": str(tmp_path)}  # kubectl's cache stays in the test's directory
    listed = run(str(KUBECTL), "plugin", "list", env=env)
    assert str(VENV_BIN / "kubectl-sliceproxy") in listed.stdout, listed.stdout + listed.stderr
    # explain: the plugin asks kubectl for the objects, then explains them.
    proc = run(str(KUBECTL), "sliceproxy", "explain", "--node", "node-a", "--service",
               "demo/web", "-o", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    # What kubectl printed, explained offline, is what the agent on node-a does.
    assert json.loads(proc.stdout)["services"] == agents_view(agent, "demo/web")
    # A change in the cluster is what the next run explains.
    sim.delete("discovery.k8s.io/v1", "EndpointSlice", "web-abc12", "demo")
    proc = run(str(KUBECTL), "sliceproxy", "explain", "--node", "node-a", "--service",
               "demo/web", "-o", "table", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("  no endpoints") == 2, proc.stdout
    # dump: a running agent, by address.
    proc = run(str(KUBECTL), "sliceproxy", "dump", address(agent), "-o", "json", env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout)["node"]["name"] == "node-a"
    # A cluster kubectl cannot reach: its error, and a non-zero exit.
    proc = run(str(KUBECTL), "sliceproxy", "explain", "--node", "node-a",
               "--kubeconfig", str(tmp_path / "missing"), env=env)
    assert proc.returncode == 1 and "kubectl get services," in proc.stderr


def test_on_a_terminal_explain_prints_the_table(tmp_path: Path) -> None:
    """A real terminal: tmux's pane is a tty, so the default output is the table."""
    if not TMUX.exists():
        pytest.fail("tmux is installed by ./run setup")
    socket = f"spx-test-{uuid.uuid4().hex[:8]}"  # a tmux server of the test's own
    command = shlex.join([sys.executable, "-m", "proxy", "explain", str(EXAMPLES),
                          "--service", "demo/web"])
    tmux = [str(TMUX), "-L", socket, "-f", "/dev/null"]
    try:
        subprocess.run([*tmux, "new-session", "-d", "-x", "200", "-y", "50", "-c", str(ROOT),
                        f"{command}; echo EXIT=$?; exec cat"], check=True, timeout=30)

        def screen() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-J"], capture_output=True,
                                  text=True, timeout=10, check=True).stdout

        def finished() -> str:
            shown = screen()
            return shown if "EXIT=" in shown else ""

        text = wait_until(finished, timeout=30, what="explain to finish in the tmux pane")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10, check=False)
    assert "EXIT=0" in text, text
    lines = text.splitlines()
    assert "node node-a (zone zone-a)" in lines
    header = next(line for line in lines if line.strip().startswith("ENDPOINT"))
    assert header.split() == ["ENDPOINT", "STATE", "NODE", "ZONE", "CHOSEN", "REASON"]
    assert any(line.split()[:2] == ["198.18.1.12:8080", "ready"] for line in lines)
    assert not any(line.lstrip().startswith(("{", '"')) for line in lines)  # no JSON
    # The same command on a pipe (no terminal) keeps today's JSON.
    piped = run(*shlex.split(command))
    assert json.loads(piped.stdout)["services"] == offline("demo/web")
