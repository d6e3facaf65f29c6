"""The public surface of hamipy.protocol: complete, importable, and free of I/O libraries."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import hamipy.protocol
from hamipy.protocol import ContainerDevice, DeviceInfo, ProtocolError

MODULES = sorted(m.name for m in pkgutil.iter_modules(hamipy.protocol.__path__))


def test_issue_named_entry_points_are_at_the_package_root() -> None:
    for name in (
        "decode_node_devices",
        "encode_node_devices",
        "decode_pod_devices",
        "encode_pod_devices",
        "ProtocolError",
        "DeviceInfo",
        "ContainerDevice",
    ):
        assert name in hamipy.protocol.__all__
        assert getattr(hamipy.protocol, name) is not None


def test_records_have_the_wire_fields() -> None:
    fields = ("id", "index", "count", "devmem", "devcore", "type", "numa", "mode", "health", "mig_profiles")
    assert DeviceInfo.__dataclass_fields__.keys() == set(fields)
    assert ContainerDevice.__dataclass_fields__.keys() == {"uuid", "type", "usedmem", "usedcores"}
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize("module", MODULES)
def test_every_module_declares_an_all_that_resolves(module: str) -> None:
    mod = importlib.import_module(f"hamipy.protocol.{module}")
    exported = getattr(mod, "__all__", None)
    assert exported is not None, f"hamipy.protocol.{module} has no __all__"
    missing = [name for name in exported if not hasattr(mod, name)]
    assert not missing, f"hamipy.protocol.{module}.__all__ names missing objects: {missing}"
    assert len(set(exported)) == len(exported)


def test_protocol_imports_no_io_or_network_library() -> None:
    code = (
        "import sys, importlib, pkgutil, hamipy.protocol as p\n"
        "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('hamipy.protocol.' + m.name)\n"
        "bad = [n for n in ('aiohttp', 'kubernetes_asyncio', 'grpc', 'structlog', 'opentelemetry',"
        " 'prometheus_client', 'pynvml') if n in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
