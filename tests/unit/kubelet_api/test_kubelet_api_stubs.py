"""The committed stubs match the proto, and the proto speaks the kubelet's wire
(docs/wire-format.md#device-plugin-api)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from hamipy.kubelet_api.podresources_v1 import api_pb2 as podresources_pb2
from hamipy.kubelet_api.podresources_v1 import api_pb2_grpc as podresources_pb2_grpc
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]
LIB = ROOT / "libs" / "kubelet-api"
GENERATED = ("hamipy/kubelet_api/v1beta1", "hamipy/kubelet_api/podresources_v1")

# (message, field, number) from k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto
FIELD_NUMBERS = [
    ("DevicePluginOptions", "pre_start_required", 1),
    ("DevicePluginOptions", "get_preferred_allocation_available", 2),
    ("RegisterRequest", "version", 1),
    ("RegisterRequest", "endpoint", 2),
    ("RegisterRequest", "resource_name", 3),
    ("RegisterRequest", "options", 4),
    ("ListAndWatchResponse", "devices", 1),
    ("Device", "ID", 1),
    ("Device", "health", 2),
    ("Device", "topology", 3),
    ("TopologyInfo", "nodes", 1),
    ("NUMANode", "ID", 1),
    ("ContainerPreferredAllocationRequest", "available_deviceIDs", 1),
    ("ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2),
    ("ContainerPreferredAllocationRequest", "allocation_size", 3),
    ("PreferredAllocationRequest", "container_requests", 1),
    ("PreferredAllocationResponse", "container_responses", 1),
    ("ContainerPreferredAllocationResponse", "deviceIDs", 1),
    ("AllocateRequest", "container_requests", 1),
    ("ContainerAllocateRequest", "devices_ids", 1),
    ("AllocateResponse", "container_responses", 1),
    ("ContainerAllocateResponse", "envs", 1),
    ("ContainerAllocateResponse", "mounts", 2),
    ("ContainerAllocateResponse", "devices", 3),
    ("ContainerAllocateResponse", "annotations", 4),
    ("ContainerAllocateResponse", "cdi_devices", 5),
    ("Mount", "container_path", 1),
    ("Mount", "host_path", 2),
    ("Mount", "read_only", 3),
    ("DeviceSpec", "container_path", 1),
    ("DeviceSpec", "host_path", 2),
    ("DeviceSpec", "permissions", 3),
    ("CDIDevice", "name", 1),
    ("PreStartContainerRequest", "devices_ids", 1),
]


# (message, field, number) from k8s.io/kubelet/pkg/apis/podresources/v1/api.proto
POD_RESOURCES_FIELD_NUMBERS = [
    ("ListPodResourcesResponse", "pod_resources", 1),
    ("PodResources", "name", 1),
    ("PodResources", "namespace", 2),
    ("PodResources", "containers", 3),
    ("ContainerResources", "name", 1),
    ("ContainerResources", "devices", 2),
    ("ContainerDevices", "resource_name", 1),
    ("ContainerDevices", "device_ids", 2),
    ("ContainerDevices", "topology", 3),
    ("TopologyInfo", "nodes", 1),
    ("NUMANode", "ID", 1),
]


@pytest.mark.parametrize(("message", "field", "number"), FIELD_NUMBERS, ids=lambda v: str(v))
def test_field_numbers_match_the_kubelet(message: str, field: str, number: int) -> None:
    descriptor = getattr(api_pb2, message).DESCRIPTOR
    assert descriptor.fields_by_name[field].number == number


@pytest.mark.parametrize(("message", "field", "number"), POD_RESOURCES_FIELD_NUMBERS, ids=lambda v: str(v))
def test_pod_resources_field_numbers_match_the_kubelet(message: str, field: str, number: int) -> None:
    descriptor = getattr(podresources_pb2, message).DESCRIPTOR
    assert descriptor.fields_by_name[field].number == number


def test_pod_resources_service_path_is_the_kubelets() -> None:
    service = podresources_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List"]
    assert hasattr(podresources_pb2_grpc, "PodResourcesListerStub")


def test_service_paths_are_the_kubelets() -> None:
    services = api_pb2.DESCRIPTOR.services_by_name
    assert services["Registration"].full_name == "v1beta1.Registration"
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert services["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming
    assert hasattr(api_pb2_grpc, "add_DevicePluginServicer_to_server")


def test_committed_stubs_are_generated_from_the_proto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mypy plugins are executables next to the interpreter.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    spec = importlib.util.spec_from_file_location("kubelet_api_generate", LIB / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    for package in GENERATED:
        for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py", "api_pb2_grpc.pyi"):
            fresh = (tmp_path / package / name).read_text()
            committed = (LIB / "src" / package / name).read_text()
            assert fresh == committed, f"{package}/{name} is stale: run `make proto`"
