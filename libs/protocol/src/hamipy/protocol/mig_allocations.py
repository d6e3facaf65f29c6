"""``hami.io/vgpu-mig-allocations``: the MIG instances a pod's devices are to be, or are, carved as
(docs/wire-format.md#mig-allocations).

The scheduler picks, for each device of a container placed on a dynamic MIG GPU, a profile and a
placement, and writes them here beside the device lists; the device plugin creates the instance at
Allocate and adds its MIG UUID and GPU/compute instance IDs. The value is HAMi's: ``json.Marshal``
of ``[]MigAllocation`` (``pkg/device/nvidia/mig_allocations.go``), one element per device::

    [{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"2g.10gb",
      "placement":{"start":2,"size":2},"migUUID":"MIG-b","gpuInstanceID":4,"computeInstanceID":0}]

``migUUID`` (a string) and the two IDs (``*uint32`` in Go) are ``omitempty``: absent until the
plugin made the instance. An ID is a pointer so that 0, a real ID, is written; ``None`` here is
Go's nil, left out. The decoder has HAMi's checks (no negative index, no empty UUID or profile, no
zero-size placement, all three runtime fields or none, one element per container and device) and
refuses, unlike Go's ``json.Unmarshal``, a missing index, a ``null`` or wrong-typed value where a
number or string belongs. Keys match case-insensitively and unknown keys are ignored, as in Go. An
empty value or ``null`` is no allocations (HAMi reads both so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from hamipy.protocol import keys
from hamipy.protocol.devices import MigPlacement
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_devices import (
    check_go_int,
    check_mig_placement,
    check_utf8,
    check_value,
    decode_mig_placement,
    encode_mig_placement,
    fold_keys,
    go_string,
    parse_json,
)

__all__ = [
    "MigAllocation",
    "decode_mig_allocations",
    "encode_mig_allocations",
    "runtime_ready",
    "with_runtime",
]

_KEY: Final = keys.MIG_ALLOCATIONS
_INT64_MAX: Final = 2**63 - 1
_UINT32_MAX: Final = 2**32 - 1
_NAMES: Final = (
    "containerIndex",
    "deviceIndex",
    "gpuUUID",
    "profile",
    "placement",
    "migUUID",
    "gpuInstanceID",
    "computeInstanceID",
)
_KNOWN: Final = frozenset(_NAMES)
_FOLDED: Final = {name.lower(): name for name in _NAMES}


@dataclasses.dataclass(frozen=True, slots=True)
class MigAllocation:
    """One device's MIG instance: container ``container_index`` of the pod (init containers first,
    as in the device lists), its device ``device_index``, on the GPU ``gpu_uuid``, of ``profile`` at
    ``placement``. The runtime fields are None until the device plugin made the instance."""

    container_index: int
    device_index: int
    gpu_uuid: str
    profile: str
    placement: MigPlacement
    mig_uuid: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


def runtime_ready(allocation: MigAllocation) -> bool:
    """Whether the device plugin recorded the instance (its MIG UUID and both IDs; HAMi's
    ``RuntimeReady``)."""
    return (
        allocation.mig_uuid is not None
        and allocation.gpu_instance_id is not None
        and allocation.compute_instance_id is not None
    )


def with_runtime(
    allocation: MigAllocation, mig_uuid: str, gpu_instance_id: int, compute_instance_id: int
) -> MigAllocation:
    """``allocation`` with the instance the device plugin made for it."""
    return dataclasses.replace(
        allocation,
        mig_uuid=mig_uuid,
        gpu_instance_id=gpu_instance_id,
        compute_instance_id=compute_instance_id,
    )


def decode_mig_allocations(value: str) -> tuple[MigAllocation, ...]:
    """Decode a ``hami.io/vgpu-mig-allocations`` value strictly.

    Raises ``ProtocolError`` naming the element and key (``hami.io/vgpu-mig-allocations[1].gpuUUID``).
    """
    check_value(_KEY, value)
    if not value:
        return ()
    raw = parse_json(_KEY, value)
    if raw is None:
        return ()
    if type(raw) is not list:
        raise ProtocolError(_KEY, raw, "expected a JSON array of MIG allocations")
    out = tuple(_decode_one(f"{_KEY}[{i}]", obj) for i, obj in enumerate(raw))
    _check_unique(out)
    return out


def encode_mig_allocations(allocations: Sequence[MigAllocation]) -> str:
    """The value for ``allocations``, byte for byte as HAMi's ``json.Marshal`` writes it (struct key
    order, ``omitempty`` runtime fields, Go's escaping). Refuses (``ProtocolError``) what the
    decoder would refuse."""
    parts: list[str] = []
    for i, a in enumerate(allocations):
        _check_encodable(f"{_KEY}[{i}]", a)
        out = [
            f'{{"containerIndex":{a.container_index},"deviceIndex":{a.device_index},"gpuUUID":',
            go_string(a.gpu_uuid),
            ',"profile":',
            go_string(a.profile),
            ',"placement":',
            encode_mig_placement(a.placement),
        ]
        if a.mig_uuid:
            out += [',"migUUID":', go_string(a.mig_uuid)]
        if a.gpu_instance_id is not None:
            out.append(f',"gpuInstanceID":{a.gpu_instance_id}')
        if a.compute_instance_id is not None:
            out.append(f',"computeInstanceID":{a.compute_instance_id}')
        out.append("}")
        parts.append("".join(out))
    _check_unique(allocations)
    return "[" + ",".join(parts) + "]"


def _decode_one(at: str, obj: object) -> MigAllocation:
    if type(obj) is not dict:
        raise ProtocolError(at, obj, "expected a JSON object")
    fields = fold_keys(obj, _KNOWN, _FOLDED)
    for name in ("containerIndex", "deviceIndex", "gpuUUID", "profile", "placement"):
        if name not in fields:
            raise ProtocolError(f"{at}.{name}", obj, f"{name} missing")
    container_index, device_index = fields["containerIndex"], fields["deviceIndex"]
    check_go_int(f"{at}.containerIndex", container_index, _INT64_MAX)
    check_go_int(f"{at}.deviceIndex", device_index, _INT64_MAX)
    gpu_uuid = _string(f"{at}.gpuUUID", fields["gpuUUID"], required=True)
    profile = _string(f"{at}.profile", fields["profile"], required=True)
    placement = decode_mig_placement(f"{at}.placement", fields["placement"])
    # Go reads null, or an empty migUUID, as absent (nil pointer, omitempty string).
    mig_uuid = _string(f"{at}.migUUID", fields.get("migUUID"), required=False) or None
    gi = _instance_id(f"{at}.gpuInstanceID", fields.get("gpuInstanceID"))
    ci = _instance_id(f"{at}.computeInstanceID", fields.get("computeInstanceID"))
    allocation = MigAllocation(container_index, device_index, gpu_uuid, profile, placement, mig_uuid, gi, ci)
    _check_runtime(at, allocation)
    return allocation


def _string(field: str, val: object, *, required: bool) -> str:
    if val is None and not required:
        return ""
    if type(val) is not str:
        raise ProtocolError(field, val, "expected a JSON string")
    if required and not val:
        raise ProtocolError(field, val, "must not be empty")
    return val


def _instance_id(field: str, val: object) -> int | None:
    if val is None:
        return None
    check_go_int(field, val, _UINT32_MAX)
    assert type(val) is int
    return val


def _check_runtime(at: str, a: MigAllocation) -> None:
    present = [
        name
        for name, val in (("migUUID", a.mig_uuid), ("gpuInstanceID", a.gpu_instance_id),
                          ("computeInstanceID", a.compute_instance_id))
        if val is not None
    ]  # fmt: skip
    if present and len(present) != 3:
        raise ProtocolError(
            at,
            a,
            f"partial runtime identity ({', '.join(present)} without the rest): the device plugin "
            "records migUUID, gpuInstanceID and computeInstanceID together",
        )


def _check_encodable(at: str, a: MigAllocation) -> None:
    check_go_int(f"{at}.containerIndex", a.container_index, _INT64_MAX)
    check_go_int(f"{at}.deviceIndex", a.device_index, _INT64_MAX)
    for name, val in (("gpuUUID", a.gpu_uuid), ("profile", a.profile)):
        _string(f"{at}.{name}", val, required=True)
        check_utf8(f"{at}.{name}", val)
    check_mig_placement(f"{at}.placement", a.placement)
    if a.mig_uuid is not None:
        _string(f"{at}.migUUID", a.mig_uuid, required=True)
        check_utf8(f"{at}.migUUID", a.mig_uuid)
    for name, instance_id in (
        ("gpuInstanceID", a.gpu_instance_id),
        ("computeInstanceID", a.compute_instance_id),
    ):
        if instance_id is not None:
            check_go_int(f"{at}.{name}", instance_id, _UINT32_MAX)
    _check_runtime(at, a)


def _check_unique(allocations: Sequence[MigAllocation]) -> None:
    seen: set[tuple[int, int]] = set()
    for i, a in enumerate(allocations):
        key = (a.container_index, a.device_index)
        if key in seen:
            raise ProtocolError(
                f"{_KEY}[{i}]",
                a,
                f"a second MIG allocation for container {a.container_index} device {a.device_index}",
            )
        seen.add(key)
