"""deploy/daemonset.yaml: what operators apply. Checked for structure, least privilege
(the ClusterRole grants exactly the requests the real agent makes, read-only; the
container gets two capabilities and nothing else), the flags it passes, and by the real
kubectl (`create --dry-run=client`) against the simulator. docs/security.md says why."""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.agent.app import Agent
from proxy.config.options import Config, parse_args
from proxy.kube.client import ClientOptions, KubeApi, Response
from proxy.netns_lab.poll import eventually
from proxy.sim import SimServer
from tests.integration.agent_harness import FakeDataPlane

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "daemonset.yaml"
KUBECTL = Path("/usr/bin/kubectl")


def documents() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


def container() -> dict[str, Any]:
    (c,) = documents()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    return c


def test_kinds() -> None:
    assert set(documents()) == {"Namespace", "ServiceAccount", "ClusterRole",
                                "ClusterRoleBinding", "ConfigMap", "DaemonSet"}


Grant = tuple[str, str, str]  # (API group, resource, verb)


def granted() -> set[Grant]:
    rules = documents()["ClusterRole"]["rules"]
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, \
            "no resourceNames, nonResourceURLs or wildcards"
    return {(g, r, v) for rule in rules for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


class RecordingApi:
    """The real client (connected on first use), recording every request it sends."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.inner: KubeApi | None = None
        self.requests: list[tuple[str, dict[str, str]]] = []

    @property
    def host(self) -> str:
        return self.inner.host if self.inner is not None else "?"

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response:
        if self.inner is None:
            self.inner = await KubeApi.connect(ClientOptions(kubeconfig=str(self.kubeconfig)))
        self.requests.append((path, dict(query)))
        return await self.inner.get(path, query, timeout)

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()


def authorization(path: str, query: Mapping[str, str]) -> Grant | str:
    """What RBAC checks for one GET: (group, resource, verb), or the non-resource path."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return path  # discovery: /apis/GROUP[/VERSION]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    assert len(rest) == 1, f"only collections are read, not single objects: {path}"
    return group, rest[0], "watch" if query.get("watch") in ("1", "true") else "list"


def shipped_config(tmp_path: Path, *extra: str) -> Config:
    """The ConfigMap and args exactly as shipped; servers off (flags win over the file)."""
    c = container()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(documents()["ConfigMap"]["data"]["config.yaml"])
    args = [a.replace("$(NODE_NAME)", "node-a")
             .replace("/etc/sliceproxy/config.yaml", str(config_file)) for a in c["args"]]
    return parse_args([*args, "--healthz-bind-address=127.0.0.1:0",
                       "--metrics-bind-address=127.0.0.1:0", *extra])


def requests_of_a_real_run(tmp_path: Path, *extra: str) -> list[tuple[str, dict[str, str]]]:
    """Run the real agent (a fake data plane) against the simulator until every
    resource it lists has its watch open; return the requests it sent."""
    with SimServer() as sim:
        api = RecordingApi(sim.write_kubeconfig(tmp_path / "kubeconfig"))
        agent = Agent(shipped_config(tmp_path, *extra), api_factory=lambda: api,
                      dataplane_factory=FakeDataPlane)

        async def go() -> None:
            stop = asyncio.Event()
            run = asyncio.create_task(agent.run(stop))

            def watching_all() -> bool:
                assert not run.done(), run
                if agent.watch is None:
                    return False
                watched = {p for p, q in api.requests if "watch" in q}
                return watched == {r.resource.path for r in agent.watch.reflectors}

            await eventually(watching_all, 30, "a watch on every resource listed",
                             interval=0.02)
            stop.set()
            await run

        asyncio.run(go())
    return api.requests


def test_cluster_role_grants_exactly_what_the_agent_requests(tmp_path: Path) -> None:
    requests = requests_of_a_real_run(tmp_path)
    needed = {authorization(p, q) for p, q in requests}
    resources = {n for n in needed if isinstance(n, tuple)}
    # The API group discovery (which EndpointSlice version) is a non-resource URL that
    # every authenticated client may GET (system:discovery): nothing to grant.
    assert needed - resources == {"/apis/discovery.k8s.io"}
    assert resources == granted()
    assert {v for _, _, v in resources} == {"list", "watch"}
    # Its own Node only, by field selector (RBAC cannot narrow a role that every node's
    # pod shares to each node's own name).
    node_queries = [q for p, q in requests if p == "/api/v1/nodes"]
    assert node_queries and all(q.get("fieldSelector") == "metadata.name=node-a"
                                for q in node_queries)


def test_legacy_endpoints_need_exactly_the_one_resource_the_manifest_says_to_add(
        tmp_path: Path) -> None:
    requests = requests_of_a_real_run(tmp_path, "--endpoints-source=endpoints")
    needed = {authorization(p, q) for p, q in requests}
    slices = {g for g in granted() if g[1] == "endpointslices"}
    assert needed == (granted() - slices) | {("", "endpoints", "list"),
                                             ("", "endpoints", "watch")}
    assert "add `endpoints` to the first rule's resources" in MANIFEST.read_text()


def test_the_client_can_only_read() -> None:
    """No Events, no status writes: the only HTTP method the client sends is GET."""
    source = inspect.getsource(KubeApi)
    # Its own session: only .get(); the kubernetes package's client: only "GET".
    assert re.findall(r"_session\.(\w+)\(", source) == ["get", "close"]
    assert re.findall(r'param_serialize\(\s*"(\w+)"', source) == ["GET"]
    assert source.count("call_api(") == 1 and "aiohttp.request(" not in source


def test_binding_ties_the_role_to_the_daemonsets_service_account() -> None:
    docs = documents()
    binding, ds = docs["ClusterRoleBinding"], docs["DaemonSet"]
    (subject,) = binding["subjects"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    assert subject["name"] == ds["spec"]["template"]["spec"]["serviceAccountName"]
    assert subject["namespace"] == ds["metadata"]["namespace"] == \
        docs["ServiceAccount"]["metadata"]["namespace"]


def test_pod_runs_on_every_node_in_the_host_network_with_just_enough_privilege() -> None:
    ds = documents()["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert container()["resources"]["requests"]


def test_memory_is_requested_and_never_limited() -> None:
    """docs/deploy.md, "Memory": what the container is charged grows with the cluster
    (the rules' kernel memory, iptables-restore's copy of the table): a limit shared by
    every node OOM-killed every agent at once at 50,000 services (issue 36). The request
    holds the agent's steady RSS at 10,000 services x 10 in every mode (bench/memory)."""
    resources = container()["resources"]
    assert "limits" not in resources
    assert resources["requests"]["memory"] == "320Mi"
    assert "a request of 320Mi, and no limit" in (ROOT / "docs" / "deploy.md").read_text()


def test_the_agent_resolves_names_with_the_nodes_resolver() -> None:
    """docs/bootstrap.md: the cluster DNS Service's ClusterIP routes only once a proxy has
    programmed it, so an API server named by a host name in `master` must be resolved by
    the node's own resolver (kubelet's --resolv-conf), or a new node never starts."""
    pod = documents()["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["dnsPolicy"] == "Default"


def test_every_shipped_daemonset_runs_on_linux_nodes_only() -> None:
    """Each tolerates every taint: without the selector its pod lands on a Windows node,
    never starts there, and `kubectl rollout status` (docs/migrate.md) never completes."""
    daemonsets = {(str(path.relative_to(ROOT)), d["metadata"]["name"]): d
                  for path in sorted((ROOT / "deploy").rglob("*.yaml"))
                  for d in yaml.safe_load_all(path.read_text())
                  if isinstance(d, dict) and d.get("kind") == "DaemonSet"}
    assert sorted(daemonsets) == [
        ("deploy/daemonset.yaml", "sliceproxy"),
        ("deploy/kubeadm/daemonset.yaml", "sliceproxy"),
        ("deploy/migrate/kube-proxy-cleanup-ipvs.yaml", "kube-proxy-cleanup-ipvs"),
        ("deploy/migrate/kube-proxy-cleanup.yaml", "kube-proxy-cleanup"),
        ("deploy/migrate/sliceproxy-cleanup.yaml", "sliceproxy-cleanup"),
        ("deploy/uninstall.yaml", "sliceproxy-uninstall")]
    for where, ds in daemonsets.items():
        pod = ds["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}, where


def test_security_context_is_two_capabilities_and_nothing_else() -> None:
    """docs/security.md, "The container": root (added capabilities reach only uid 0),
    NET_ADMIN and NET_RAW, no privilege, no escalation, no writable root, seccomp on."""
    assert container()["securityContext"] == {
        "runAsUser": 0,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod = documents()["DaemonSet"]["spec"]["template"]["spec"]
    for shared in ("hostPID", "hostIPC", "shareProcessNamespace"):
        assert shared not in pod
    assert "securityContext" not in pod  # everything is said on the container
    (c,) = pod["containers"]
    assert "sysctls" not in c


def init_container() -> dict[str, Any]:
    (c,) = documents()["DaemonSet"]["spec"]["template"]["spec"]["initContainers"]
    return c


def test_only_the_node_settings_step_is_privileged_and_it_runs_the_agents_configuration(
        tmp_path: Path) -> None:
    """docs/security.md, "The node-settings init container": privileged because no
    capability makes /proc/sys and /sys writable in a container, so it runs our one-shot
    `--init-only` and nothing else, with the agent's own configuration, the same image,
    and one host path: the node's /run/sliceproxy, where it records what the node held
    before (docs/uninstall.md)."""
    init, agent = init_container(), container()
    assert init["securityContext"] == {"runAsUser": 0, "privileged": True,
                                       "readOnlyRootFilesystem": True}
    assert init["image"] == agent["image"]
    assert init["args"] == [a for a in agent["args"] if a.startswith("--config=")] + [
        "--init-only"]
    assert init["volumeMounts"] == [m for m in agent["volumeMounts"]
                                    if m["mountPath"] == "/etc/sliceproxy"] + [
        {"name": "node-settings-record", "mountPath": "/run/sliceproxy"}]
    volumes = {v["name"]: v for v in documents()["DaemonSet"]["spec"]["template"]["spec"][
        "volumes"]}
    assert volumes["node-settings-record"]["hostPath"] == {"path": "/run/sliceproxy",
                                                           "type": "DirectoryOrCreate"}
    assert set(init) == {"name", "image", "args", "securityContext", "resources",
                         "volumeMounts"}  # no ports, probes, env or commands of its own
    config_file = tmp_path / "config.yaml"
    config_file.write_text(documents()["ConfigMap"]["data"]["config.yaml"])
    cfg = parse_args([a.replace("/etc/sliceproxy/config.yaml", str(config_file))
                      for a in init["args"]])
    assert cfg.init_only and not cfg.cleanup


def test_host_paths_are_only_the_xtables_lock() -> None:
    """No /lib/modules: nothing in the container can load a module (no SYS_MODULE)."""
    pod = documents()["DaemonSet"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    host = {path: volumes[m["name"]]["hostPath"] for path, m in mounts.items()
            if "hostPath" in volumes[m["name"]]}
    assert host == {"/run/xtables.lock": {"path": "/run/xtables.lock",
                                          "type": "FileOrCreate"}}
    for path, m in mounts.items():
        if path != "/tmp" and "hostPath" not in volumes[m["name"]]:
            assert m.get("readOnly") is True, path


def test_namespace_admits_the_host_network_pod() -> None:
    labels = documents()["Namespace"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_debug_dump_and_metrics_stay_node_local(tmp_path: Path) -> None:
    cfg = shipped_config(tmp_path)
    config_text = documents()["ConfigMap"]["data"]["config.yaml"]
    assert yaml.safe_load(config_text)["metrics-bind-address"] == "127.0.0.1:10249"
    # The shipped default: loopback clients only; `debug-dump: false` turns it off.
    assert cfg.debug_dump == "local"
    assert "# debug-dump: false" in config_text
    exposed = {p["containerPort"] for p in container()["ports"]}
    assert exposed == {10256}


def test_probes_hit_the_agents_health_server(tmp_path: Path) -> None:
    c = container()
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    config_file = tmp_path / "config.yaml"
    config_file.write_text(documents()["ConfigMap"]["data"]["config.yaml"])
    args = [a.replace("$(NODE_NAME)", "node-1") for a in c["args"]]
    args = [a.replace("/etc/sliceproxy/config.yaml", str(config_file)) for a in args]
    cfg = parse_args(args)  # the shipped config file and args are valid flags
    assert cfg.node_name == "node-1" and cfg.proxy_mode == "iptables"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] == cfg.healthz_bind_address[1]
    assert cfg.healthz_bind_address[0] == "0.0.0.0"  # the kubelet probes the node IP
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/sliceproxy")
    assert mount["name"] in {v["name"] for v in
                             documents()["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}


def kubectl_dry_run(manifest: Path, tmp_path: Path) -> list[str]:
    """What the real kubectl would create from `manifest` (`-o name`), checked against the
    simulator's discovery."""
    if not KUBECTL.exists():
        pytest.fail("/usr/bin/kubectl (v1.32) is expected on this machine image")
    with SimServer() as sim:
        kubeconfig = sim.write_kubeconfig(tmp_path / "kubeconfig")
        proc = subprocess.run(
            [str(KUBECTL), f"--kubeconfig={kubeconfig}", f"--cache-dir={tmp_path / 'cache'}",
             "create", "--dry-run=client", "--validate=false", "-f", str(manifest),
             "-o", "name"],
            capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_kubectl_dry_run_accepts_it(tmp_path: Path) -> None:
    assert sorted(kubectl_dry_run(MANIFEST, tmp_path)) == sorted([
        "namespace/sliceproxy", "serviceaccount/sliceproxy",
        "clusterrole.rbac.authorization.k8s.io/sliceproxy",
        "clusterrolebinding.rbac.authorization.k8s.io/sliceproxy",
        "configmap/sliceproxy", "daemonset.apps/sliceproxy"])


# --- deploy/kubeadm/daemonset.yaml: the same agent, from kube-proxy's file in its own ConfigMap

KUBEADM_MANIFEST = ROOT / "deploy" / "kubeadm" / "daemonset.yaml"


def kubeadm_documents() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(KUBEADM_MANIFEST.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


def kubeadm_daemonset() -> dict[str, Any]:
    return kubeadm_documents()["DaemonSet"]


def test_kubeadm_variant_is_the_same_container_on_its_own_account_and_configmap() -> None:
    """None of kubeadm's objects: `kubeadm upgrade` skips its kube-proxy add-on only
    once kube-proxy's ConfigMap is gone (docs/migrate.md, "kubeadm upgrades"), and a
    cluster made without kube-proxy has neither that ConfigMap nor its account."""
    ds = kubeadm_daemonset()
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["namespace"] == "kube-system"  # beside kubeadm's add-ons
    assert pod["serviceAccountName"] == "sliceproxy"
    (c,) = pod["containers"]
    ours = container()

    def without_config(spec: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in spec.items() if k not in ("args", "volumeMounts")}
        out["args"] = [a for a in spec["args"] if not a.startswith("--config=")]
        out["volumeMounts"] = [m for m in spec["volumeMounts"]
                               if m["name"] not in ("config", "kube-proxy")]
        return out

    # Everything but where the configuration comes from, so the two cannot drift apart.
    assert without_config(c) == without_config(ours)
    (init,) = pod["initContainers"]
    assert without_config(init) == without_config(init_container())
    main_pod = documents()["DaemonSet"]["spec"]["template"]["spec"]
    differ = ("containers", "initContainers", "volumes", "serviceAccountName")
    assert {k: v for k, v in pod.items() if k not in differ} == \
        {k: v for k, v in main_pod.items() if k not in differ}
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == "sliceproxy"


def test_kubeadm_variant_has_the_least_privilege_of_the_main_manifest() -> None:
    """The same rules (docs/security.md) under names of its own, bound to its own
    account in kube-system: deleting either manifest's objects never takes the other's."""
    docs = kubeadm_documents()
    assert set(docs) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"}
    account = docs["ServiceAccount"]["metadata"]
    assert (account["namespace"], account["name"]) == (
        "kube-system", kubeadm_daemonset()["spec"]["template"]["spec"]["serviceAccountName"])
    assert docs["ClusterRole"]["rules"] == documents()["ClusterRole"]["rules"]
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole",
                                  "name": docs["ClusterRole"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                    "namespace": "kube-system"}]
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        assert docs[kind]["metadata"]["name"] != documents()[kind]["metadata"]["name"]


def test_kubeadm_variant_reads_kubeadms_configmap_as_mounted(tmp_path: Path) -> None:
    """kubeadm's kube-proxy ConfigMap's two keys, copied into sliceproxy's ConfigMap
    (docs/migrate.md, step 1), become files in the mount: the args' --config names one
    of them, and the configuration's kubeconfig (a path in kube-proxy's mount) the
    other."""
    from tests.unit.test_kubeproxy_file import KUBEADM_CONFIGMAP

    (c,) = kubeadm_daemonset()["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
    cm = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())
    mounted = tmp_path / mount["mountPath"].lstrip("/")
    mounted.mkdir(parents=True)
    for key, text in cm["data"].items():
        (mounted / key).write_text(text)
    args = [a.replace("$(NODE_NAME)", "node-1") for a in c["args"]]
    (flag,) = [a for a in args if a.startswith("--config=")]
    path = flag.removeprefix("--config=")
    assert path.startswith(mount["mountPath"] + "/")
    cfg = parse_args([f"--config={tmp_path / path.lstrip('/')}",
                      *(a for a in args if a != flag)])
    assert cfg.node_name == "node-1" and cfg.proxy_mode == "iptables"
    assert cfg.kubeconfig is not None
    assert Path(cfg.kubeconfig).parent == Path(mount["mountPath"])
    assert Path(cfg.kubeconfig).name in cm["data"]
    assert cfg.ignored_settings == ()


def test_kubectl_dry_run_accepts_the_kubeadm_variant(tmp_path: Path) -> None:
    assert sorted(kubectl_dry_run(KUBEADM_MANIFEST, tmp_path)) == [
        "clusterrole.rbac.authorization.k8s.io/sliceproxy-kubeadm",
        "clusterrolebinding.rbac.authorization.k8s.io/sliceproxy-kubeadm",
        "daemonset.apps/sliceproxy", "serviceaccount/sliceproxy"]


# --- deploy/uninstall.yaml: the rules and the node settings, once on every node ----------

UNINSTALL = ROOT / "deploy" / "uninstall.yaml"


def test_uninstall_removes_the_rules_as_the_agent_then_gives_settings_back_as_its_init_step(
        tmp_path: Path) -> None:
    """docs/uninstall.md, step 2: each step with the privilege of the agent's container it
    undoes, and nothing more; all of it in a namespace of its own, whose deletion takes
    its pods and their events."""
    assert sorted(kubectl_dry_run(UNINSTALL, tmp_path)) == [
        "daemonset.apps/sliceproxy-uninstall", "namespace/sliceproxy-uninstall"]
    ns, ds = [d for d in yaml.safe_load_all(UNINSTALL.read_text()) if d]
    assert ds["metadata"]["namespace"] == ns["metadata"]["name"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["automountServiceAccountToken"] is False
    cleanup, restore = pod["initContainers"]
    assert cleanup["args"] == ["--cleanup"]
    assert cleanup["securityContext"] == container()["securityContext"]
    assert restore["args"] == ["--restore-node-settings"]
    assert restore["securityContext"] == init_container()["securityContext"]
    assert {c["image"] for c in [cleanup, restore, *pod["containers"]]} == {
        container()["image"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The node's /run, where the init step's /run/sliceproxy is (the record and its
    # folder are removed).
    (mount,) = restore["volumeMounts"]
    assert mount["mountPath"] == "/run"
    assert volumes[mount["name"]]["hostPath"] == {"path": "/run", "type": "Directory"}
    agent_volumes = {v["name"]: v for v in documents()["DaemonSet"]["spec"]["template"][
        "spec"]["volumes"]}
    host = {m["mountPath"]: agent_volumes[m["name"]]["hostPath"]["path"]
            for m in init_container()["volumeMounts"] if "hostPath" in agent_volumes[m["name"]]}
    assert host == {"/run/sliceproxy": "/run/sliceproxy"}
