"""`python -m proxy`: dispatch, usage errors naming the flag, structured log lines."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.agent import logs
from proxy.cmd.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_kube_proxy_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "proxy", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 0
    for flag in ("--kubeconfig", "--master", "--hostname-override", "--proxy-mode",
                 "--endpoints-source", "--min-sync-period", "--sync-period", "--cluster-cidr",
                 "--masquerade-all", "--nodeport-addresses", "--healthz-bind-address",
                 "--metrics-bind-address", "--service-proxy-name", "--cleanup", "--config",
                 "--no-uvloop", "-v"):
        assert flag in proc.stdout, flag


@pytest.mark.parametrize(("argv", "message"), [
    (["--sync-period", "0s"], "--sync-period: must be greater than 0"),
    (["--proxy-mode", "userspace"], "--proxy-mode: invalid value 'userspace'"),
    (["--healthz-threshold", "soon"], "--healthz-threshold: invalid value 'soon'"),
    (["--nodeport-addresses", "198.18.0.1/33"], "--nodeport-addresses: '198.18.0.1/33'"),
])
def test_bad_values_exit_2_naming_the_flag(argv: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hostname-override", "n1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("python -m proxy: ")


def test_explain_still_dispatches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(ROOT / "examples"), "--service", "demo/web"]) == 0
    assert '"service": "demo/web"' in capsys.readouterr().out


def test_unreadable_kubeconfig_fails_to_start_with_a_message(tmp_path: Path) -> None:
    # Start-up stops at the kubeconfig, in a subprocess with both servers disabled and
    # a recording data plane, so nothing is touched on this host.
    code = (
        "import sys\n"
        "from proxy.agent.main import run\n"
        "from proxy.config.options import parse_args\n"
        "from tests.integration.agent_harness import FakeDataPlane\n"
        "cfg = parse_args(sys.argv[1:])\n"
        "sys.exit(run(cfg, dataplane_factory=FakeDataPlane))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "--kubeconfig", str(tmp_path / "missing"),
         "--hostname-override", "n1", "--healthz-bind-address", "127.0.0.1:0",
         "--metrics-bind-address", "127.0.0.1:0"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "level=error" in proc.stderr and "cannot start" in proc.stderr
    assert "missing" in proc.stderr


def test_logfmt_lines_carry_extra_fields_and_v_levels() -> None:
    stream = io.StringIO()
    logs.setup(2, stream)
    try:
        log = logging.getLogger("proxy.test")
        log.info("sync done", extra={"service": "demo/web", "reason": "two words"})
        log.log(logs.V(2), "shown at -v 2")
        log.log(logs.V(3), "hidden at -v 2")
        logging.getLogger("aiohttp.access").info("library noise")
    finally:
        logs.setup(0, sys.stderr)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert 'level=info logger=proxy.test msg="sync done" service=demo/web reason="two words"' \
        in lines[0]
    assert "level=v2" in lines[1] and 'msg="shown at -v 2"' in lines[1]
