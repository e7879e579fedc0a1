"""Client construction against the simulator served over TLS with a bearer token:
in-cluster service account (environment variables, token and CA files), kubeconfig,
--master overriding either (all read by proxy/kube/kubeconfig.py), and a kubeconfig
with an exec credential plugin, left to the `kubernetes` package's loaders."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from proxy.kube.client import ClientOptions, ConfigError, KubeApi
from proxy.kube.reflector import Reflector
from proxy.kube.resources import SERVICES
from proxy.sim import SimServer
from tests.integration.watchkit import FAST, Recorder, eventually, run, self_signed
from tests.sim.client import service

TOKEN = "sliceproxy-test-token"


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_sim(cert: tuple[Path, Path]) -> Iterator[SimServer]:
    with SimServer(tls_cert=cert[0], tls_key=cert[1], token=TOKEN,
                   objects=[service("web")]) as sim:
        yield sim


@pytest.fixture
def no_in_cluster_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)


def service_account(tmp: Path, ca: Path, token: str = TOKEN) -> Path:
    sa = tmp / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token)
    shutil.copy(ca, sa / "ca.crt")
    return sa


async def list_services(api: KubeApi) -> Recorder:
    """A real reflector over `api`, until its first list is done."""
    rec = Recorder()
    reflector = Reflector(api, SERVICES, rec, FAST)
    task = asyncio.create_task(reflector.run())
    try:
        await eventually(lambda: reflector.synced.is_set() or reflector.stats.errors > 0,
                         what="a list or an error")
        if not reflector.synced.is_set():
            raise ConnectionError(reflector.stats.last_error)
        return rec
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()


def test_in_cluster_service_account(tls_sim: SimServer, tmp_path: Path,
                                    cert: tuple[Path, Path],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(tls_sim.port))
    sa = service_account(tmp_path, cert[0])

    async def main() -> None:
        api = await KubeApi.connect(ClientOptions(service_account_dir=str(sa)))
        assert api.host == f"https://127.0.0.1:{tls_sim.port}"
        rec = await list_services(api)
        assert list(rec.keys("Service")) == [("default", "web")]

    run(main)


def test_in_cluster_with_a_wrong_token_is_unauthorized(tls_sim: SimServer, tmp_path: Path,
                                                      cert: tuple[Path, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(tls_sim.port))
    sa = service_account(tmp_path, cert[0], token="wrong")

    async def main() -> None:
        api = await KubeApi.connect(ClientOptions(service_account_dir=str(sa)))
        with pytest.raises(ConnectionError, match="HTTP 401: Unauthorized"):
            await list_services(api)

    run(main)


def test_in_cluster_checks_the_servers_certificate(tls_sim: SimServer, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    other_ca, _ = self_signed(tmp_path)  # not the certificate the server presents
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(tls_sim.port))
    sa = service_account(tmp_path, other_ca)

    async def main() -> None:
        api = await KubeApi.connect(ClientOptions(service_account_dir=str(sa)))
        with pytest.raises(ConnectionError, match=r"(?i)certificate"):
            await list_services(api)

    run(main)


def test_in_cluster_without_a_token_file_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")

    async def main() -> None:
        with pytest.raises(ConfigError, match="token file"):
            await KubeApi.connect(ClientOptions(service_account_dir=str(tmp_path)))

    run(main)


def test_kubeconfig_with_tls_and_token(tls_sim: SimServer, tmp_path: Path,
                                       no_in_cluster_env: None) -> None:
    config = tls_sim.write_kubeconfig(tmp_path / "kubeconfig")

    async def main() -> None:
        api = await KubeApi.connect(ClientOptions(kubeconfig=str(config)))
        assert api.via == "sliceproxy"
        rec = await list_services(api)
        assert list(rec.keys("Service")) == [("default", "web")]

    run(main)


def test_an_exec_plugin_is_left_to_the_kubernetes_package(
        tls_sim: SimServer, tmp_path: Path, no_in_cluster_env: None) -> None:
    config = tls_sim.write_kubeconfig(tmp_path / "kubeconfig")
    doc = yaml.safe_load(config.read_text())
    credential = json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1",
                             "kind": "ExecCredential", "status": {"token": TOKEN}})
    doc["users"][0]["user"] = {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
        "args": ["-c", f"print({credential!r})"], "interactiveMode": "Never"}}
    config.write_text(yaml.safe_dump(doc))

    async def main() -> None:
        api = await KubeApi.connect(ClientOptions(kubeconfig=str(config)))
        assert api.via == "kubernetes package"
        rec = await list_services(api)
        assert list(rec.keys("Service")) == [("default", "web")]

    run(main)


def test_master_overrides_the_kubeconfigs_server(tls_sim: SimServer, tmp_path: Path,
                                                 no_in_cluster_env: None) -> None:
    config = tls_sim.write_kubeconfig(tmp_path / "kubeconfig")
    # Point the kubeconfig at a port nobody listens on; --master says where to go.
    config.write_text(config.read_text().replace(tls_sim.url, "https://127.0.0.1:9"))

    async def main() -> None:
        api = await KubeApi.connect(ClientOptions(kubeconfig=str(config),
                                                  master=tls_sim.url + "/"))
        assert api.host == tls_sim.url
        rec = await list_services(api)
        assert list(rec.keys("Service")) == [("default", "web")]

    run(main)


def test_master_overrides_the_in_cluster_address(tls_sim: SimServer, tmp_path: Path,
                                                 cert: tuple[Path, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The service account's token and CA are kept; only the address moves (kube-proxy
    # would drop the service account here, see client.py).
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "9")
    sa = service_account(tmp_path, cert[0])

    async def main() -> None:
        api = await KubeApi.connect(ClientOptions(master=tls_sim.url,
                                                  service_account_dir=str(sa)))
        rec = await list_services(api)
        assert list(rec.keys("Service")) == [("default", "web")]

    run(main)


def test_the_shipped_master_placeholder_says_what_to_set(
        tmp_path: Path, cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # deploy/daemonset.yaml ships `master: https://API-SERVER-ADDRESS:6443`: left as is,
    # the agent stops at once naming the setting, instead of retrying a name that never
    # resolves.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "9")
    sa = service_account(tmp_path, cert[0])

    async def main() -> None:
        with pytest.raises(ConfigError, match=r"placeholder: set `master` in the sliceproxy "
                                              r"ConfigMap to your API server's address"):
            await KubeApi.connect(ClientOptions(master="https://API-SERVER-ADDRESS:6443",
                                                service_account_dir=str(sa)))

    run(main)
    shipped = (Path(__file__).resolve().parents[2] / "deploy/daemonset.yaml").read_text()
    assert "master: https://API-SERVER-ADDRESS:6443" in shipped


def test_master_alone_talks_to_an_open_server(no_in_cluster_env: None) -> None:
    with SimServer(objects=[service("web")]) as sim:
        async def main() -> None:
            rec = await list_services(await KubeApi.connect(ClientOptions(master=sim.url)))
            assert list(rec.keys("Service")) == [("default", "web")]

        run(main)


def test_nothing_configured_is_a_config_error(no_in_cluster_env: None) -> None:
    async def main() -> None:
        with pytest.raises(ConfigError, match="no API server configured"):
            await KubeApi.connect(ClientOptions())

    run(main)
