"""hamipy.protocol.reserved_annotations: the CDI annotations a pod may not carry."""

from __future__ import annotations

from typing import Any

import builders
import pytest

from hamipy.protocol.reserved_annotations import CDI_ANNOTATION_PREFIX, reserved_annotation_use


def pod(annotations: Any) -> dict[str, Any]:
    """A pod carrying ``annotations`` as written, a malformed value too."""
    out = builders.pod("p")
    out["metadata"]["annotations"] = annotations
    return out


@pytest.mark.parametrize(
    "key",
    ["cdi.k8s.io/gpu", "cdi.k8s.io/vgpu_abc", "cdi.k8s.io/nvidia-device-plugin_1"],
)
def test_a_cdi_annotation_is_refused_naming_it(key: str) -> None:
    problem = reserved_annotation_use(pod({"team": "a", key: "hami.io/vgpu=other-pod_main"}))
    assert problem is not None
    assert problem.startswith(f"annotation {key}: a runtime can take CDI devices from it")


@pytest.mark.parametrize(
    "annotations",
    [
        None,
        {},
        {"team": "a"},
        {"cdi.k8s.io": "x"},  # no prefix of CDI's: the runtime reads keys under "cdi.k8s.io/"
        {"example.com/cdi.k8s.io/x": "y"},
        "not a map",
    ],
)
def test_other_annotations_are_admitted(annotations: Any) -> None:
    assert reserved_annotation_use(pod(annotations)) is None
    assert reserved_annotation_use({}) is None


def test_the_prefix_is_cdis() -> None:
    assert CDI_ANNOTATION_PREFIX == "cdi.k8s.io/"
