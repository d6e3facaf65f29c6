"""Pod device lists: ``hami.io/vgpu-devices-allocated`` and ``-to-allocate``
(docs/wire-format.md#device-lists).

A list holds one slot per container, init containers first, then regular containers (HAMi >= 2.9);
each slot is ended by ``;`` and holds that container's devices, each ended by ``:``, as
``UUID,type,memMiB,cores``::

    ;GPU-A,NVIDIA,2500,25:;GPU-B,NVIDIA,2500,25:;    init container without GPU, then two GPU containers

The format follows upstream's ``EncodePodSingleDevice``/``DecodePodDevices`` (``pkg/device/devices.go``)
with these differences, all in the direction of never losing or inventing data:

- Empty slots are kept on both sides (v2.10.0 dropped them and shifted every later container onto
  the wrong devices, HAMi #2899, #3079). Upstream's decoder reads the final ``;`` as one more
  empty slot; here it is the terminator of the last slot, so ``decode(encode(x)) == x``. A value
  whose last slot lacks its ``;`` is still read.
- A malformed entry is a ``ProtocolError`` naming the slot, device and field
  (``hami.io/vgpu-devices-allocated[1][0].usedmem``), never a skipped entry (upstream #2958 skipped a
  pod whose annotation it could not parse, offering its capacity twice).
- Exactly four fields per device (upstream tolerates extra ones, which no writer produces), and an
  empty entry (a doubled ``:``) is refused rather than skipped; only the last ``:`` of a slot may be
  left out, as upstream's ``EncodeContainerDeviceType`` does.
- ``usedmem`` and ``usedcores`` are decimal digits only within Go's int32 (upstream parses int32 and
  refuses negatives too). Cores above 100 are *not* refused: upstream does not refuse them, and the
  cap on what a container may ask belongs to the resource parser (``resources.py``), not to the wire.
- UUID and type must not be empty (as upstream) and no field may hold a blank (UUIDs never do, the
  type is a vendor word such as ``NVIDIA``), nor a separator, which the encoder checks so that it
  never writes an unreadable list.

Decoding the empty string gives no slots; encoding no slots gives the empty string.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Final, NoReturn

from hamipy.protocol.devices import ContainerDevice, PodDevices
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_devices import MAX_VALUE_BYTES

__all__ = [
    "DEFAULT_FIELD",
    "clear_container_slot",
    "decode_container_devices",
    "decode_pod_devices",
    "encode_container_devices",
    "encode_pod_devices",
    "slot_owners",
]

# Callers pass the annotation key (keys.DEVICES_ALLOCATED or keys.DEVICES_TO_ALLOCATE) so errors name it.
DEFAULT_FIELD: Final = "pod-devices"

_DEVICE_SEP: Final = ":"
_SLOT_SEP: Final = ";"
_INT32_MAX: Final = 2**31 - 1
_NAMES: Final = ("uuid", "type", "usedmem", "usedcores")
# No field holds a blank (UUIDs never do; the type is a vendor word such as NVIDIA).
_BLANK: Final = re.compile(r"\s").search
_BAD_CHAR: Final = re.compile(r"[\s,:;]").search

# ContainerDevice is a frozen slots dataclass whose __init__ sets each field through
# object.__setattr__: that doubles the decoder's cost. Its __init__ does nothing else (checked here,
# so that a future __post_init__ or default is never skipped), so the decoder sets the slots directly.
_SETTERS: Final = tuple(ContainerDevice.__dict__[name].__set__ for name in _NAMES)
_DIRECT: Final = (
    tuple(f.name for f in dataclasses.fields(ContainerDevice)) == _NAMES
    and not hasattr(ContainerDevice, "__post_init__")
    and hasattr(ContainerDevice, "__slots__")
)


def decode_pod_devices(value: str, *, field: str = DEFAULT_FIELD) -> PodDevices:
    """One list of devices per container slot, empty slots kept; raises ``ProtocolError``."""
    _check_value(value, field, pod=True)
    if not value:
        return []
    slots = value.split(_SLOT_SEP)
    if slots[-1] == "":
        slots.pop()  # the terminator of the last slot, not one more slot
    ascii_only = value.isascii()
    return [_decode_slot(slot, field, i, ascii_only) if slot else [] for i, slot in enumerate(slots)]


def encode_pod_devices(devices: Sequence[Sequence[ContainerDevice]], *, field: str = DEFAULT_FIELD) -> str:
    """Each slot's devices followed by ``;``; an empty slot is a lone ``;``."""
    encoded = "".join(_encode_slot(slot, f"{field}[{i}]") + _SLOT_SEP for i, slot in enumerate(devices))
    _check_size(encoded, field)
    return encoded


def decode_container_devices(value: str, *, field: str = DEFAULT_FIELD) -> list[ContainerDevice]:
    """The devices of one slot (``UUID,type,mem,cores:`` repeated, no ``;``)."""
    _check_value(value, field, pod=False)
    if _SLOT_SEP in value:
        raise ProtocolError(field, value, "one container's devices must not hold ';'")
    return _decode_slot(value, field, None, value.isascii()) if value else []


def encode_container_devices(devices: Sequence[ContainerDevice], *, field: str = DEFAULT_FIELD) -> str:
    """One slot's devices, each ended by ``:`` (no ``;``), as upstream's ``EncodeContainerDevices``."""
    return _encode_slot(devices, field)


def clear_container_slot(
    devices: Sequence[Sequence[ContainerDevice]], index: int, *, field: str = DEFAULT_FIELD
) -> PodDevices:
    """A copy of ``devices`` with slot ``index`` emptied, as the device plugin does in ``-to-allocate``
    once it has served that container. An index outside the list (negative ones included: no
    counting from the end) is a ``ProtocolError``: the annotation does not match the pod."""
    if type(index) is not int or not 0 <= index < len(devices):
        raise ProtocolError(
            f"{field}[{index!r}]", index, f"no such container slot; the list has {len(devices)} slots"
        )
    return [[] if i == index else list(slot) for i, slot in enumerate(devices)]


def slot_owners(
    slots: Sequence[Sequence[ContainerDevice]],
    containers: int,
    asking: Callable[[], Sequence[bool]],
    *,
    field: str = DEFAULT_FIELD,
) -> list[int | None]:
    """For each slot of a pod's device list, the container it belongs to: its index among the pod's
    ``containers`` in slot order (init containers first); None for an empty slot that belongs to no
    container. ``asking()`` says, per container, whether it asks for a GPU; it is called only for
    a list shorter than the pod (reading every container's quantities is not free, and a list of
    ours never needs it).

    A list with one slot per container is positional (ours, HAMi >= 2.9 as specified). HAMi's
    scheduler drops the empty slots of containers without GPUs ahead of a GPU container (an init
    container without GPU and a GPU ``main`` become one slot), and older HAMi wrote the regular
    containers only: a shorter list is read by matching its non-empty slots, in order, to the
    containers that ask for GPUs. Anything else does not match the pod: ``ProtocolError``.
    Match ``-to-allocate`` (whose served slots are emptied) by the owners of ``-allocated``."""
    if len(slots) == containers:
        return list(range(containers))
    filled = [j for j, devices in enumerate(slots) if devices]
    wanted = [i for i, asks in enumerate(asking()) if asks] if len(slots) < containers else []
    if len(slots) > containers or len(filled) != len(wanted):
        raise ProtocolError(
            field,
            encode_pod_devices(slots, field=field),
            f"{len(slots)} slots ({len(filled)} with devices) for {containers} containers, "
            f"{len(wanted)} of them asking for GPUs",
        )
    owners: list[int | None] = [None] * len(slots)
    for j, i in zip(filled, wanted, strict=True):
        owners[j] = i
    return owners


def _decode_slot(slot: str, field: str, i: int | None, ascii_only: bool) -> list[ContainerDevice]:
    entries = slot.split(_DEVICE_SEP)
    if entries[-1] == "":
        entries.pop()
    devices: list[ContainerDevice] = []
    new = object.__new__
    s_uuid, s_type, s_usedmem, s_usedcores = _SETTERS
    i32 = _INT32_MAX
    for j, entry in enumerate(entries):
        parts = entry.split(",")
        if len(parts) != 4:
            _explain(_where(field, i, j), entry, parts)
        uuid, type_, mem, cores = parts
        # Digits only, ASCII ones, so that int() sees no blanks, signs, '_' or other scripts.
        if not (
            uuid
            and type_
            and mem.isdigit()
            and cores.isdigit()
            and (ascii_only or (mem.isascii() and cores.isascii()))
        ):
            _explain(_where(field, i, j), entry, parts)
        usedmem = int(mem)
        usedcores = int(cores)
        if usedmem > i32 or usedcores > i32:
            _explain(_where(field, i, j), entry, parts)
        if _DIRECT:
            dev = new(ContainerDevice)
            s_uuid(dev, uuid)
            s_type(dev, type_)
            s_usedmem(dev, usedmem)
            s_usedcores(dev, usedcores)
        else:  # pragma: no cover (only if ContainerDevice grows more than its fields)
            dev = ContainerDevice(uuid, type_, usedmem, usedcores)
        devices.append(dev)
    return devices


def _where(field: str, i: int | None, j: int) -> str:
    return f"{field}[{j}]" if i is None else f"{field}[{i}][{j}]"


def _explain(where: str, entry: str, parts: list[str]) -> NoReturn:
    """Raise the ProtocolError for the first bad field of one device entry."""
    if not entry:
        raise ProtocolError(where, entry, "empty device entry (doubled ':')")
    if len(parts) != 4:
        raise ProtocolError(where, entry, f"{len(parts)} fields; expected UUID,type,memMiB,cores")
    uuid, type_, mem, cores = parts
    if not uuid:
        raise ProtocolError(f"{where}.uuid", uuid, "device UUID is empty")
    if not type_:
        raise ProtocolError(f"{where}.type", type_, "device type is empty")
    for name, text in (("usedmem", mem), ("usedcores", cores)):
        if not (text.isascii() and text.isdigit()):
            negative = text[:1] == "-" and text[1:].isascii() and text[1:].isdigit()
            raise ProtocolError(
                f"{where}.{name}", text, "must not be negative" if negative else "not a decimal integer"
            )
        if int(text) > _INT32_MAX:
            raise ProtocolError(f"{where}.{name}", text, f"out of range (at most {_INT32_MAX})")
    raise AssertionError("unreachable: entry passed every check")  # pragma: no cover


def _encode_slot(devices: Sequence[ContainerDevice], where: str) -> str:
    out: list[str] = []
    for j, dev in enumerate(devices):
        _check_encodable(dev, f"{where}[{j}]")
        out.append(f"{dev.uuid},{dev.type},{dev.usedmem},{dev.usedcores}{_DEVICE_SEP}")
    return "".join(out)


def _check_encodable(dev: ContainerDevice, where: str) -> None:
    if type(dev.uuid) is not str or not dev.uuid or _BAD_CHAR(dev.uuid):
        raise ProtocolError(f"{where}.uuid", dev.uuid, "expected a non-empty UUID without blanks or ,:;")
    if type(dev.type) is not str or not dev.type or _BAD_CHAR(dev.type):
        raise ProtocolError(f"{where}.type", dev.type, "expected a non-empty type without blanks or ,:;")
    for name in ("usedmem", "usedcores"):
        val = getattr(dev, name)
        if type(val) is not int:
            raise ProtocolError(f"{where}.{name}", val, "expected an integer")
        if not 0 <= val <= _INT32_MAX:
            raise ProtocolError(f"{where}.{name}", val, f"out of range (0 to {_INT32_MAX})")


def _check_value(value: str, field: str, *, pod: bool) -> None:
    """Size bound, then blanks, which no field may hold: one search over the whole value."""
    _check_size(value, field)
    blank = _BLANK(value)
    if blank is not None:
        where, entry = _locate(value, blank.start(), field, pod=pod)
        raise ProtocolError(where, entry, "blank inside a field")


def _locate(value: str, offset: int, field: str, *, pod: bool) -> tuple[str, str]:
    """The ``field[slot][device].name`` path and the device entry of the character at ``offset``."""
    head = value[:offset]
    slot_start = head.rfind(_SLOT_SEP) + 1
    entry_start = max(slot_start, head.rfind(_DEVICE_SEP) + 1)
    device = head[slot_start:].count(_DEVICE_SEP)
    name = _NAMES[min(head[entry_start:].count(","), len(_NAMES) - 1)]
    entry = re.split(r"[:;]", value[entry_start:], maxsplit=1)[0]
    where = f"{field}[{head.count(_SLOT_SEP)}][{device}]" if pod else f"{field}[{device}]"
    return f"{where}.{name}", entry


def _check_size(value: str, field: str) -> None:
    if len(value) > MAX_VALUE_BYTES or (not value.isascii() and len(value.encode()) > MAX_VALUE_BYTES):
        raise ProtocolError(field, value, f"value longer than {MAX_VALUE_BYTES} bytes")
