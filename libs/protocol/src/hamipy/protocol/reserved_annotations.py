"""The pod annotations a pod's author may not set (docs/security.md, rule 9).

CDI devices reach a container through the CRI's ``cdi_devices`` (what the kubelet passes from a
device plugin's ``cdi-cri`` answer) or through ``cdi.k8s.io/<name>`` annotations whose value lists
qualified device names. Runtimes take those annotations from more than the device plugins: a
containerd runtime whose ``pod_annotations`` pass ``cdi.k8s.io/*`` hands a pod's own annotations to
the OCI spec, where the NVIDIA container runtime in CDI mode, or a Kata agent, injects the devices
they name. A pod that names ``hami.io/vgpu=<another pod's slot>`` would get that pod's limits, and
``nvidia.com/gpu=<UUID>`` a GPU with no limit at all. So every ``cdi.k8s.io/`` key is reserved on
pods: refused when a pod is created with one or an update sets or changes one.

Checked in two places from this prefix: the webhook (GPU pods at creation,
``reserved_annotation_use``) and the ValidatingAdmissionPolicy of
``hamipy.manifests.reserved_annotation_policy`` (every pod, creation and update). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["CDI_ANNOTATION_PREFIX", "CDI_RESERVED_REASON", "reserved_annotation_use"]

CDI_ANNOTATION_PREFIX: Final = "cdi.k8s.io/"
"""CDI's annotation prefix (``tags.cncf.io/container-device-interface/pkg/cdi.AnnotationPrefix``)."""
CDI_RESERVED_REASON: Final = (
    "a runtime can take CDI devices from it (the GPU slice of another pod, or a whole GPU with no limit), "
    "which only the device plugin hands out; remove the annotation"
)


def reserved_annotation_use(pod: Mapping[str, Any]) -> str | None:
    """Why ``pod`` may not be admitted for its annotations (the first ``cdi.k8s.io/`` key, by
    name), or None."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict):
        return None
    found = sorted(k for k in annotations if isinstance(k, str) and k.startswith(CDI_ANNOTATION_PREFIX))
    if not found:
        return None
    return f"annotation {found[0]}: {CDI_RESERVED_REASON}"
