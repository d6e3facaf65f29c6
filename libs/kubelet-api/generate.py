"""Regenerate the committed gRPC stubs from proto/ (run by `make proto`; a unit test checks they
are current). Needs grpcio-tools and mypy-protobuf, which are dev dependencies only."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "proto"
PROTOS = (
    "hamipy/kubelet_api/v1beta1/api.proto",
    "hamipy/kubelet_api/podresources_v1/api.proto",
)


def generate(out: Path) -> None:
    """Write api_pb2.py, api_pb2.pyi, api_pb2_grpc.py and api_pb2_grpc.pyi of each proto under ``out``."""
    include = Path(protoc.__file__).parent / "_proto"
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            proto,
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "src")
