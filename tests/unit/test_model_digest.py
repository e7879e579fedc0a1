"""Digests of resolved ports (model/digest.py) and of the agent's code
(source_digest.py): what lets a restart keep a port's rules without rendering them
(nftables/marks.py) must be equal exactly when the resolutions are, in any process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

import proxy
from proxy.dataplane.common import source_digest as source
from proxy.model.digest import ResolutionDigests, flat
from proxy.model.snapshot import DesiredState
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_iptables_sync import Cluster, clusters

REPO = Path(__file__).resolve().parents[2]


def digests(state: DesiredState) -> dict[Any, bytes]:
    of = ResolutionDigests().of
    return {key: of(rsp) for key, rsp in state.ports.items()}


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(first=clusters(), second=clusters())
def test_two_resolutions_have_one_digest_exactly_when_they_are_equal(
        first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    a, b = Cluster().become(first), Cluster().become(second)
    da, db = digests(a), digests(b)
    # The same objects, resolved by another model: the same digests.
    assert digests(Cluster().become(first)) == da
    for key in a.ports.keys() & b.ports.keys():
        assert (da[key] == db[key]) == (a.ports[key] == b.ports[key]), key


def test_a_digest_is_the_same_in_another_process() -> None:
    """Python's hash is salted per process (and so is the order of a frozenset): a
    digest that depended on it would never be found again after a restart."""
    script = (
        "import json\n"
        "from tests.unit.test_iptables_sync import Cluster\n"
        "from tests.unit.test_model_digest import digests, sample\n"
        "state = Cluster().become(sample())\n"
        "print(json.dumps(sorted([str(k), d.hex()] for k, d in digests(state).items())))\n")
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                              capture_output=True, text=True, check=True, timeout=120)
        outputs.add(done.stdout)
    here = json.dumps(sorted([str(k), d.hex()] for k, d in
                             digests(Cluster().become(sample())).items()))
    assert outputs == {here + "\n"}


def sample() -> list[dict[str, Any]]:
    """A cluster with what a salted hash would scramble: a port in both endpoint sets
    (external policy Local), topology hints, several zones."""
    return [
        service(ips=("198.18.128.1",), type="NodePort", externalTrafficPolicy="Local",
                ports=({"name": "http", "port": 80, "nodePort": 30080},),
                annotations={"service.kubernetes.io/topology-mode": "Auto"}),
        eps_slice("s1", [ep("198.18.1.10", node="node-a", zone="z1", zones=("z1",)),
                         ep("198.18.1.11", node="node-b", zone="z2", zones=("z2",))]),
    ]


def test_a_value_it_cannot_spell_is_refused() -> None:
    with pytest.raises(TypeError):
        flat(object())


def test_the_code_digest_follows_every_source(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(proxy, "__file__", str(tmp_path / "__init__.py"))

    def digest() -> bytes:
        source.source_digest.cache_clear()
        return source.source_digest()

    first = digest()
    assert digest() == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert digest() != first
    # No source at all: nothing says it is the same code, so never the same digest.
    for path in (tmp_path / "a.py", tmp_path / "sub" / "b.py"):
        path.unlink()
    assert digest() != digest()
    source.source_digest.cache_clear()


def test_a_digest_changes_with_an_endpoints_target_port_or_its_slices_alone() -> None:
    # What the property above may not draw: one endpoint whose target port, or the
    # slices listing it, are all that differ.
    svc = service(ips=("198.18.128.1",))
    base = [svc, eps_slice("s1", [ep("198.18.1.10")])]
    variants = {
        "target port": [svc, eps_slice("s1", [ep("198.18.1.10")],
                                       ports=({"name": "http", "port": 9090},))],
        "listed twice": [svc, eps_slice("s1", [ep("198.18.1.10")]),
                         eps_slice("s2", [ep("198.18.1.10")])],
        "another slice": [svc, eps_slice("s2", [ep("198.18.1.10")])],
    }
    a = Cluster().become(base)
    [key] = a.ports
    for what, objects in variants.items():
        b = Cluster().become(objects)
        assert a.ports[key] != b.ports[key], what
        assert digests(a)[key] != digests(b)[key], what
