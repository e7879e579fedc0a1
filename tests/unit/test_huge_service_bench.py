"""The one-service-many-endpoints benchmark keeps working (tiny; timings reported, never
asserted): the planes that need no kernel. The iptables and nftables runs build a
network namespace of their own, so they need root: tests/e2e/test_huge_service_bench_kernel.py."""

from __future__ import annotations

import orjson
import pytest

from bench.common import ENDPOINTS_PER_SLICE
from bench.huge_service import (
    changes,
    markdown,
    pod_address,
    run_plane,
    slice_object,
)
from proxy.kube.decode import decode_endpoint_slice


def test_slices_are_written_as_the_endpointslice_controller_writes_them() -> None:
    obj = slice_object(1, 250)
    assert obj["metadata"]["labels"] == {
        "kubernetes.io/service-name": "huge",
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
    [owner] = obj["metadata"]["ownerReferences"]
    assert owner["kind"] == "Service" and owner["controller"] is True
    assert len(obj["endpoints"]) == ENDPOINTS_PER_SLICE
    assert obj["endpoints"][0]["targetRef"]["kind"] == "Pod"
    assert len(slice_object(2, 250)["endpoints"]) == 50
    sl, skips = decode_endpoint_slice(obj)
    assert sl is not None and not skips
    # 50,000 endpoints fit in the bench ranges without repeating an address.
    assert len({pod_address(i) for i in range(0, 50_000, 7)}) == len(range(0, 50_000, 7))
    assert pod_address(70_000).startswith("198.18.")


def test_each_change_flips_one_endpoint_of_one_slice() -> None:
    flips = []
    for _n, raw in changes(250, 4):
        obj = orjson.loads(raw)
        flips.append(sum(not e["conditions"]["ready"] for e in obj["endpoints"]))
    assert flips == [1, 0, 1, 0]


def test_draining_takes_one_more_endpoint_out_each_change() -> None:
    down: dict[str, set[str]] = {}
    counts = []
    for _n, raw in changes(250, 7, drain=True):
        obj = orjson.loads(raw)
        down[obj["metadata"]["name"]] = {e["addresses"][0] for e in obj["endpoints"]
                                         if not e["conditions"]["ready"]}
        counts.append(sum(map(len, down.values())))
    assert counts == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("plane", ["model", "ipvs"])
def test_pure_planes_run_small(plane: str) -> None:
    result = run_plane(plane, 250, 4)
    assert result["slices"] == 3 and result["changes"] == 4
    assert result["model_ms"]["p50"] > 0 and result["decode_ms"]["p99"] > 0
    if plane == "ipvs":
        # One endpoint leaves (drained, weight 0) or comes back: one operation.
        assert result["lines"]["p50"] == 1 and result["render_ms"]["p50"] > 0
    assert plane in markdown([result])
