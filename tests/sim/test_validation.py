"""422 Invalid answers with upstream's field paths, and the switch that turns them off."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.sim import SimServer
from tests.sim.client import EPS, SVC, Api, endpoint_slice, service


def _svc(**spec: Any) -> dict[str, Any]:
    return service("v", **spec)


def _bad_port(port: Any) -> dict[str, Any]:
    return _svc(ports=[{"port": port}])


def _eps(**changes: Any) -> dict[str, Any]:
    obj = endpoint_slice("v", "v", ["198.18.1.1"])
    obj.update(changes)
    return obj


ENDPOINTS_PATH = "/api/v1/namespaces/default/endpoints"


def _endpoints(ip: str, port: int = 80) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "v"},
            "subsets": [{"addresses": [{"ip": ip}], "ports": [{"port": port}]}]}


CASES = [
    ("svc-port-0", SVC, _bad_port(0), "spec.ports[0].port", "FieldValueInvalid"),
    ("svc-port-65536", SVC, _bad_port(65536), "spec.ports[0].port", "FieldValueInvalid"),
    ("svc-protocol", SVC, _svc(ports=[{"port": 80, "protocol": "ICMP"}]),
     "spec.ports[0].protocol", "FieldValueNotSupported"),
    ("svc-no-ports", SVC, _svc(ports=[]), "spec.ports", "FieldValueRequired"),
    ("svc-unnamed-ports", SVC, _svc(ports=[{"port": 80}, {"port": 81}]),
     "spec.ports[1].name", "FieldValueRequired"),
    ("svc-cluster-ip", SVC, _svc(clusterIP="10.0.0.300"), "spec.clusterIPs[0]",
     "FieldValueInvalid"),
    ("svc-type", SVC, _svc(type="Magic"), "spec.type", "FieldValueNotSupported"),
    ("svc-name", SVC, service("Upper_Case"), "metadata.name", "FieldValueInvalid"),
    ("svc-name-digit", SVC, service("1abc"), "metadata.name", "FieldValueInvalid"),
    ("svc-nodeport-on-clusterip", SVC, _svc(ports=[{"port": 80, "nodePort": 30080}]),
     "spec.ports[0].nodePort", "FieldValueForbidden"),
    ("svc-nodeport-range", SVC, _svc(type="NodePort", ports=[{"port": 80, "nodePort": 80}]),
     "spec.ports[0].nodePort", "FieldValueInvalid"),
    ("eps-address-type", EPS, _eps(addressType="IPv5"), "addressType",
     "FieldValueNotSupported"),
    ("eps-no-address-type", EPS, {k: v for k, v in _eps().items() if k != "addressType"},
     "addressType", "FieldValueRequired"),
    ("eps-bad-ipv4", EPS, _eps(endpoints=[{"addresses": ["fd00::1"]}]),
     "endpoints[0].addresses[0]", "FieldValueInvalid"),
    ("eps-bad-ipv6", EPS, _eps(addressType="IPv6"), "endpoints[0].addresses[0]",
     "FieldValueInvalid"),
    ("eps-no-addresses", EPS, _eps(endpoints=[{"addresses": []}]),
     "endpoints[0].addresses", "FieldValueRequired"),
    ("eps-port", EPS, _eps(ports=[{"port": 70000}]), "ports[0].port", "FieldValueInvalid"),
    ("eps-protocol", EPS, _eps(ports=[{"port": 80, "protocol": "tcp"}]), "ports[0].protocol",
     "FieldValueNotSupported"),
    ("ep-ip", ENDPOINTS_PATH, _endpoints("198.18.1.x"), "subsets[0].addresses[0].ip",
     "FieldValueInvalid"),
    ("ep-loopback", ENDPOINTS_PATH, _endpoints("127.0.0.1"), "subsets[0].addresses[0].ip",
     "FieldValueInvalid"),
    ("ep-port", ENDPOINTS_PATH, _endpoints("198.18.1.1", 0), "subsets[0].ports[0].port",
     "FieldValueInvalid"),
]


@pytest.mark.parametrize(("path", "obj", "field", "reason"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_objects_are_422_with_causes(api: Api, path: str, obj: dict[str, Any],
                                             field: str, reason: str) -> None:
    status, body = api.post(path, copy.deepcopy(obj))
    assert status == 422, body
    assert body["reason"] == "Invalid" and body["code"] == 422 and body["status"] == "Failure"
    causes = body["details"]["causes"]
    assert (reason, field) in [(c["reason"], c["field"]) for c in causes]
    assert f"{field}: " in body["message"]
    assert body["details"]["kind"] in ("Service", "EndpointSlice", "Endpoints")


def test_invalid_message_format_matches_upstream(api: Api) -> None:
    _, body = api.post(SVC, _svc(ports=[{"port": 70000, "targetPort": 80}]))
    assert body["message"] == ('Service "v" is invalid: spec.ports[0].port: Invalid value: '
                               "70000: must be between 1 and 65535, inclusive")
    _, body = api.post(EPS, _eps(addressType="IPv5"))
    assert body["message"].startswith('EndpointSlice.discovery.k8s.io "v" is invalid: '
                                      'addressType: Unsupported value: "IPv5"')
    assert body["details"]["group"] == "discovery.k8s.io"


def test_valid_variants_are_accepted(api: Api) -> None:
    assert api.post(EPS, _eps(addressType="FQDN", endpoints=[
        {"addresses": ["backend.example.com"]}]))[0] == 201
    assert api.post(SVC, service("ext", type="ExternalName", externalName="db.example.com",
                                 ports=[]))[0] == 201
    assert api.post(SVC, service("sctp", ports=[{"port": 9, "protocol": "SCTP"}]))[0] == 201


def test_no_validate_switch_stores_invalid_objects(sim: SimServer, api: Api) -> None:
    sim.set_validate(False)
    status, body = api.post(SVC, _bad_port(70000))
    assert status == 201 and body["spec"]["ports"][0]["port"] == 70000
    status, _ = api.post(EPS, _eps(addressType="IPv5"))
    assert status == 201
    sim.set_validate(True)
    assert api.post(SVC, service("v2", ports=[{"port": 0}]))[0] == 422


def test_no_validate_from_the_constructor() -> None:
    with SimServer(validate=False, objects=[_bad_port(0)]) as sim:
        assert sim.get("v1", "Service", "v")["spec"]["ports"][0]["port"] == 0
