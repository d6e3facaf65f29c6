"""CDI (Container Device Interface) devices and specs of the device plugin's ``cdi-cri`` strategy
(docs/device-plugin.md#cdi).

With ``nvidia.deviceListStrategy: cdi-cri`` the device plugin answers a container's Allocate with
CDI device names (the ``cdi_devices`` the kubelet passes to the CRI runtime) instead of env and
mounts; the runtime's CDI library resolves each name from the spec files in its spec directory
and applies their ``containerEdits`` to the container. A container gets, in this order:

- ``hami.io/vgpu=<podUID>_<container>``: its slot, one device of a spec file of its own
  (``slot_spec``) holding exactly the env and mounts the ``envvar`` strategy answers
  (``hamipy.protocol.allocation_env``);
- ``nvidia.com/gpu=<GPU UUID>`` for each GPU of the slot: the NVIDIA container toolkit's spec
  injects the driver and the device nodes. Its spec-level env (``NVIDIA_VISIBLE_DEVICES=void``)
  comes after the slot's, and so has the last word on that name.

Names follow CDI's rules (``tags.cncf.io/container-device-interface/pkg/parser``): a kind is
``<vendor>/<class>``, a device name starts and ends with a letter or digit and holds only letters,
digits, ``_``, ``-``, ``.`` and ``:``. The slot's name is its region directory's name
(``allocation_env.region_dir_name``): a pod UID (a UUID, or the hex hash of a static pod) and a
container name (a DNS label) use only those characters and end in a letter or digit, so the map
is the identity and one-to-one; anything else is refused with ``ProtocolError``. A UID may start
with a digit, which CDI allows from spec version 0.5.0 on (``CDI_VERSION``, the least that holds
these specs; containerd v2.2's CDI library reads up to 1.1.0).

A slot's spec file is ``hami.io-vgpu_<podUID>_<container>.json``, CDI's name for a transient spec
of that vendor and class (``GenerateTransientSpecName``): one file per slot, so writing or removing
one never touches another's. ``parse_spec_file_name`` reads the name back. Pure: the device
plugin writes the files, the monitor removes those of pods that are gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, get_args

import msgspec

from hamipy.protocol.allocation_env import (
    ContainerAllocation,
    Mount,
    parse_region_dir_name,
    region_dir_name,
)
from hamipy.protocol.errors import ProtocolError

__all__ = [
    "CDI_VERSION",
    "DEFAULT_SPEC_DIR",
    "DEVICE_LIST_STRATEGIES",
    "GPU_KIND",
    "SLOT_KIND",
    "CdiDevice",
    "CdiMount",
    "CdiSpec",
    "ContainerEdits",
    "DeviceListStrategy",
    "decode_spec",
    "encode_spec",
    "gpu_device",
    "parse_spec_file_name",
    "slot_cdi_devices",
    "slot_device",
    "slot_spec",
    "spec_file_name",
]

DeviceListStrategy = Literal["envvar", "cdi-cri"]
"""How Allocate hands a container its slot, named as NVIDIA's device plugin names its strategies:
``envvar`` (env and mounts in the answer) or ``cdi-cri`` (CDI device names in the answer)."""
DEVICE_LIST_STRATEGIES: Final[tuple[DeviceListStrategy, ...]] = get_args(DeviceListStrategy)

DEFAULT_SPEC_DIR: Final = "/var/run/cdi"
"""Where container runtimes look for CDI specs that change while they run (containerd's and
CRI-O's default, beside the static ``/etc/cdi``); the NVIDIA toolkit writes its spec there too."""
CDI_VERSION: Final = "0.5.0"
"""The spec version written: the least that accepts a device name starting with a digit."""
_SLOT_VENDOR: Final = "hami.io"
_SLOT_CLASS: Final = "vgpu"
SLOT_KIND: Final = f"{_SLOT_VENDOR}/{_SLOT_CLASS}"
GPU_KIND: Final = "nvidia.com/gpu"
"""The NVIDIA container toolkit's kind: its spec names each GPU by index and by UUID."""
_SPEC_FILE_PREFIX: Final = f"{_SLOT_VENDOR}-{_SLOT_CLASS}_"
_SPEC_FILE_SUFFIX: Final = ".json"
_NAME_INNER: Final = frozenset("_-.:")


class CdiMount(msgspec.Struct, frozen=True, rename="camel"):
    """A CDI ``Mount``: a host path bound at a container path."""

    host_path: str
    container_path: str
    type: str
    options: tuple[str, ...]


class ContainerEdits(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    """A CDI ``ContainerEdits``: ``NAME=value`` env entries and mounts (what a slot, or the fake
    driver of the dev cluster's toolkit stand-in, needs); an empty field is left out of the file."""

    env: tuple[str, ...] = ()
    mounts: tuple[CdiMount, ...] = ()


class CdiDevice(msgspec.Struct, frozen=True, rename="camel"):
    name: str
    container_edits: ContainerEdits


class CdiSpec(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    """A CDI spec file: its version, kind and devices, and the edits every container given one of
    its devices gets once, before the first of them (a slot's spec has none; the NVIDIA toolkit's
    puts the driver there)."""

    cdi_version: str
    kind: str
    devices: tuple[CdiDevice, ...]
    container_edits: ContainerEdits | None = None


def _checked_name(field: str, name: str) -> str:
    """``name`` if CDI takes it as a device name, else ``ProtocolError``."""
    ends = name[:1].isascii() and name[:1].isalnum() and name[-1:].isascii() and name[-1:].isalnum()
    if not ends or any(not (c.isascii() and (c.isalnum() or c in _NAME_INNER)) for c in name):
        raise ProtocolError(
            field,
            name,
            "is not a CDI device name: letters, digits, '_', '-', '.', ':', starting and ending "
            "with a letter or digit",
        )
    return name


def slot_device(pod_uid: str, container_name: str) -> str:
    """The qualified CDI name of one container's slot: ``hami.io/vgpu=<podUID>_<container>``."""
    name = _checked_name("cdi device", region_dir_name(pod_uid, container_name))
    return f"{SLOT_KIND}={name}"


def gpu_device(uuid: str) -> str:
    """The qualified CDI name of one GPU in the NVIDIA toolkit's spec: ``nvidia.com/gpu=<UUID>``."""
    return f"{GPU_KIND}={_checked_name('gpu uuid', uuid)}"


def slot_cdi_devices(pod_uid: str, container_name: str, gpu_uuids: Sequence[str]) -> tuple[str, ...]:
    """A ``cdi-cri`` Allocate answer's device names: the slot first, then each of its GPUs."""
    return (slot_device(pod_uid, container_name), *(gpu_device(u) for u in gpu_uuids))


def spec_file_name(pod_uid: str, container_name: str) -> str:
    """The file name of one slot's spec: ``hami.io-vgpu_<podUID>_<container>.json``."""
    return f"{_SPEC_FILE_PREFIX}{region_dir_name(pod_uid, container_name)}{_SPEC_FILE_SUFFIX}"


def parse_spec_file_name(name: str) -> tuple[str, str]:
    """The (pod UID, container name) of a file name ``spec_file_name`` made; ``ProtocolError`` for
    any other name (another vendor's spec, a file being written)."""
    if not (name.startswith(_SPEC_FILE_PREFIX) and name.endswith(_SPEC_FILE_SUFFIX)):
        raise ProtocolError("cdi spec file", name, f"expected {_SPEC_FILE_PREFIX}<podUID>_<container>.json")
    pod_uid, container = parse_region_dir_name(name[len(_SPEC_FILE_PREFIX) : -len(_SPEC_FILE_SUFFIX)])
    if spec_file_name(pod_uid, container) != name:
        raise ProtocolError("cdi spec file", name, "not a name of a slot's spec")
    return pod_uid, container


def _mount(mount: Mount) -> CdiMount:
    # containerd's CRI plugin makes a kubelet mount (an envvar answer's) this same OCI bind mount.
    access = "ro" if mount.read_only else "rw"
    return CdiMount(
        host_path=mount.host_path,
        container_path=mount.container_path,
        type="bind",
        options=("rbind", "rprivate", access),
    )


def slot_spec(allocation: ContainerAllocation, *, pod_uid: str, container_name: str) -> CdiSpec:
    """The spec of one container's slot: one device, ``slot_device``'s name, whose edits are the
    allocation's env and mounts."""
    name = slot_device(pod_uid, container_name).partition("=")[2]
    edits = ContainerEdits(
        env=tuple(f"{key}={value}" for key, value in allocation.envs.items()),
        mounts=tuple(_mount(m) for m in allocation.mounts),
    )
    return CdiSpec(
        cdi_version=CDI_VERSION, kind=SLOT_KIND, devices=(CdiDevice(name=name, container_edits=edits),)
    )


def encode_spec(spec: CdiSpec) -> bytes:
    """The JSON of a spec file."""
    return msgspec.json.encode(spec)


def decode_spec(data: bytes) -> CdiSpec:
    """A spec file's JSON as a ``CdiSpec`` (``ProtocolError`` when it is not one)."""
    try:
        return msgspec.json.decode(data, type=CdiSpec)
    except msgspec.DecodeError as exc:
        raise ProtocolError("cdi spec", data[:64].decode(errors="replace"), str(exc)) from exc
