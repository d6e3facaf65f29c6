"""``hami.io/node-nvidia-register``: the GPUs a node's device plugin registers
(docs/wire-format.md#register-annotation).

Two forms reach the decoder, told apart by their first non-blank character (``[`` or ``{``: JSON):

- JSON (HAMi >= 2.8), what upstream's ``MarshalNodeDevices`` writes: ``json.Marshal`` of
  ``[]*DeviceInfo`` (``pkg/device/devices.go``). The Go struct fixes the keys, their order and types:

  ====================  ==========  ======================================
  key (in this order)   Go type     here
  ====================  ==========  ======================================
  ``id``                string      non-empty, unique; no blank, ``,:;``
  ``index``             uint        0 .. 2**64-1
  ``count``             int32       0 .. 2**31-1
  ``devmem``            int32       0 .. 2**31-1
  ``devcore``           int32       0 .. 2**31-1
  ``type``              string      any string
  ``numa``              int         0 .. 2**63-1
  ``mode``              string      ``hami-core``, ``mig``, ``mps``
  ``migProfiles``       []object    ``mig_profiles``, below; ``null`` is none
  ``migtemplate``       []object    accepted, ignored (deprecated)
  ``health``            bool
  ``devicevendor``      string      accepted, ignored (set by the reader)
  ``custominfo``        object      accepted, ignored
  ====================  ==========  ======================================

  A ``migProfiles`` element (``MigProfile``, a dynamic MIG GPU's profile) has the keys ``name``
  (string, non-empty), ``memoryMB`` and ``core`` (int32, 0 .. 2**31-1), ``sliceCount`` (uint32)
  and ``placements`` (``null`` or objects of ``start`` and ``size``, uint32, ``size`` at least 1).
  These tags have no ``omitempty``: Go writes every key, ``"placements":null`` for none.

  Every device tag has ``omitempty``: a zero value is left out, so a missing ``health`` is false, a missing
  ``index``/``numa``/``count`` is 0 and a missing ``type`` is ``""``. Like Go's ``json.Unmarshal``,
  keys match ASCII-case-insensitively (upstream's own tests write ``"ID"``, ``"Count"``) and unknown
  keys (``devicepairscore`` of older releases, other vendors' extras) are ignored. Unlike Go, a
  ``null``, a float, a bool where a number belongs, a negative number or one past the Go type's range
  is an error, never a silent zero.

- Legacy (HAMi <= 2.7, upstream's ``DecodeNodeDevices``/``EncodeNodeDevices``): devices each ended
  by ``:``, fields by ``,``: ``UUID,count,devmem,devcore,type,numa,health`` or, with two more fields,
  ``...,health,index,mode``. ``health`` takes Go's ``strconv.ParseBool`` spellings; numbers are
  plain decimal digits (``index`` and ``numa`` within int64, as upstream's ``Atoi``). Upstream
  skips empty entries anywhere; here only the last device's ``:`` may be left out, and a doubled
  ``::`` is an error (no upstream writer produces one).

A missing or empty ``mode`` means ``hami-core``: upstream's legacy decoder defaults it so, and the
NVIDIA plugin registers ``hami-core`` unless MIG or MPS is configured. An empty value is an error
in both forms, as upstream's decoders also refuse it (a node without GPUs registers ``[]``), and so
is a value over ``MAX_VALUE_BYTES``.

``encode_node_devices`` writes the JSON form byte for byte as Go would: struct key order,
``omitempty``, no blanks, Go's escaping of ``<``, ``>``, ``&``, U+2028 and U+2029 as ``\\u003c`` and
so on, and ``[]`` for no devices (upstream marshals a non-nil empty slice).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Final, NoReturn

import msgspec

from hamipy.protocol import keys
from hamipy.protocol.devices import DEVICE_MODES, DeviceInfo, MigPlacement, MigProfile
from hamipy.protocol.errors import ProtocolError

__all__ = [
    "DEFAULT_MODE",
    "MAX_VALUE_BYTES",
    "check_go_int",
    "check_mig_placement",
    "check_utf8",
    "check_value",
    "decode_mig_placement",
    "decode_node_devices",
    "device_type",
    "encode_mig_placement",
    "encode_node_devices",
    "fold_keys",
    "go_json",
    "go_string",
    "parse_json",
]

# Kubernetes refuses objects whose annotations total more than 256 KiB, so no larger value is real;
# the bound keeps a hostile value from costing a parse.
MAX_VALUE_BYTES: Final = 256 * 1024
DEFAULT_MODE: Final = "hami-core"

_KEY: Final = keys.NODE_REGISTER
_INT32_MAX: Final = 2**31 - 1
_INT64_MAX: Final = 2**63 - 1
_UINT32_MAX: Final = 2**32 - 1
_UINT64_MAX: Final = 2**64 - 1

# The integer fields and the largest value each one's Go type holds.
_INT_FIELDS: Final = {
    "index": _UINT64_MAX,
    "count": _INT32_MAX,
    "devmem": _INT32_MAX,
    "devcore": _INT32_MAX,
    "numa": _INT64_MAX,
}
# The fields we decode, in the Go struct's order, and those we accept and ignore.
_FIELDS: Final = ("id", "index", "count", "devmem", "devcore", "type", "numa", "mode", "health")
_IGNORED: Final = ("migtemplate", "devicevendor", "custominfo", "devicepairscore")
_KNOWN: Final = frozenset((*_FIELDS, "migProfiles", *_IGNORED))
_FOLDED: Final = {name.lower(): name for name in _KNOWN}
_MODES: Final = frozenset(DEVICE_MODES)
_MODES_OR_EMPTY: Final = frozenset((*DEVICE_MODES, ""))

# An id ends up in pod device lists (``UUID,NVIDIA,mem,cores:``), so their separators and blanks
# are refused where the id enters.
_BAD_ID_CHAR: Final = re.compile(r"[\s,:;]").search

# DeviceInfo is a frozen slots dataclass whose __init__ sets each field through object.__setattr__:
# that doubles the decoder's cost. Its __init__ does nothing else (checked here, so that a future
# __post_init__ or default is never skipped), so the decoder sets the slots directly.
_SLOTS: Final = (*_FIELDS, "mig_profiles")
_SETTERS: Final = tuple(DeviceInfo.__dict__[name].__set__ for name in _SLOTS)
_DIRECT: Final = (
    tuple(f.name for f in dataclasses.fields(DeviceInfo)) == _SLOTS
    and not hasattr(DeviceInfo, "__post_init__")
    and hasattr(DeviceInfo, "__slots__")
)

# Go's strconv.ParseBool, which upstream's legacy decoder uses for health.
_GO_BOOL: Final = dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True) | dict.fromkeys(
    ("0", "f", "F", "FALSE", "false", "False"), False
)

# encoding/json escapes these even inside strings; Python's json does not.
_GO_ESCAPES: Final = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def device_type(nvml_name: str) -> str:
    """The register annotation's ``type`` for an NVML device name: ``NVIDIA-<model>``, a name that
    already starts with NVIDIA kept as is (upstream's rule), so the scheduler's and the monitor's
    series join on it."""
    return nvml_name if nvml_name.upper().startswith("NVIDIA") else f"NVIDIA-{nvml_name}"


def decode_node_devices(value: str) -> list[DeviceInfo]:
    """Decode a ``hami.io/node-nvidia-register`` value, JSON or legacy form, strictly.

    Raises ``ProtocolError`` naming the device and field (``hami.io/node-nvidia-register[2].devmem``).
    """
    check_value(_KEY, value)
    # '{' too, so that a lone object gets a JSON error rather than a legacy one.
    if value.lstrip()[:1] in ("[", "{"):
        return _decode_json(value)
    return _decode_legacy(value)


def encode_node_devices(devices: Sequence[DeviceInfo]) -> str:
    """The JSON form of ``devices``, exactly as upstream's ``MarshalNodeDevices`` writes it.

    Refuses (``ProtocolError``) a device that the decoder would refuse, so nothing written here is
    unreadable.
    """
    parts: list[str] = []
    for i, dev in enumerate(devices):
        _check_encodable(i, dev)
        out = ['{"id":', go_string(dev.id)]
        if dev.index:
            out.append(f',"index":{dev.index}')
        if dev.count:
            out.append(f',"count":{dev.count}')
        if dev.devmem:
            out.append(f',"devmem":{dev.devmem}')
        if dev.devcore:
            out.append(f',"devcore":{dev.devcore}')
        if dev.type:
            out.append(',"type":')
            out.append(go_string(dev.type))
        if dev.numa:
            out.append(f',"numa":{dev.numa}')
        out.append(',"mode":')
        out.append(go_string(dev.mode))
        if dev.mig_profiles:
            out.append(',"migProfiles":')
            out.append(_encode_profiles(dev.mig_profiles))
        if dev.health:
            out.append(',"health":true')
        out.append("}")
        parts.append("".join(out))
    _check_ids([dev.id for dev in devices])
    encoded = "[" + ",".join(parts) + "]"
    check_value(_KEY, encoded)
    return encoded


# -- JSON form ---------------------------------------------------------------------------------------


# msgspec does not check a default against its bounds: the keys whose zero value is refused are
# required here, so that their absence takes the exact decoder, which explains it.
class _FastPlacement(msgspec.Struct, forbid_unknown_fields=True):
    size: Annotated[int, msgspec.Meta(ge=1, le=_UINT32_MAX)]
    start: Annotated[int, msgspec.Meta(ge=0, le=_UINT32_MAX)] = 0


class _FastProfile(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    memoryMB: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)] = 0
    core: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)] = 0
    sliceCount: Annotated[int, msgspec.Meta(ge=0, le=_UINT32_MAX)] = 0
    placements: list[_FastPlacement] | None = None


class _FastDevice(msgspec.Struct, forbid_unknown_fields=True):
    """The exact-key, in-range shape upstream writes, for msgspec's typed decoder (about 4x faster
    than ``json.loads`` alone). Anything else (other key spellings, unknown keys, wrong types, out
    of range) fails here and goes to the exact decoder, which folds keys as Go does and explains
    the error."""

    id: str = ""
    # msgspec bounds stop at int64: a larger index (still valid) takes the exact path.
    index: Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)] = 0
    count: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)] = 0
    devmem: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)] = 0
    devcore: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)] = 0
    type: str = ""
    numa: Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)] = 0
    mode: str = ""
    health: bool = False
    migProfiles: list[_FastProfile] | None = None
    migtemplate: msgspec.Raw = msgspec.Raw(b"null")
    devicevendor: msgspec.Raw = msgspec.Raw(b"null")
    custominfo: msgspec.Raw = msgspec.Raw(b"null")
    devicepairscore: msgspec.Raw = msgspec.Raw(b"null")


_FAST_CHECK: Final = msgspec.json.Decoder(list[_FastDevice])


def _decode_json(value: str) -> list[DeviceInfo]:
    # One C pass when the value has upstream's exact shape checks keys, types and ranges into
    # Structs; the records are then built by setting their slots. The exact decoder alone would
    # miss the decode target (docs/benchmarks.md#protocol-codecs), and so would msgspec building
    # the dataclass itself: it pays about 0.25 us per key left out, on every device.
    try:
        checked = _FAST_CHECK.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_json_exact(value)
    modes = _MODES_OR_EMPTY
    devices: list[DeviceInfo] = []
    append = devices.append
    new = object.__new__
    s_id, s_index, s_count, s_devmem, s_devcore, s_type, s_numa, s_mode, s_health, s_mig = _SETTERS
    for dev in checked:
        if not dev.id or dev.mode not in modes:
            return _decode_json_exact(value)  # refused there, with the reason
        profiles = _fast_profiles(dev.migProfiles) if dev.migProfiles else ()
        if _DIRECT:
            info = new(DeviceInfo)
            s_id(info, dev.id)
            s_index(info, dev.index)
            s_count(info, dev.count)
            s_devmem(info, dev.devmem)
            s_devcore(info, dev.devcore)
            s_type(info, dev.type)
            s_numa(info, dev.numa)
            s_mode(info, dev.mode or DEFAULT_MODE)
            s_health(info, dev.health)
            s_mig(info, profiles)
        else:  # pragma: no cover (only if DeviceInfo grows more than its fields)
            info = DeviceInfo(
                dev.id, dev.index, dev.count, dev.devmem, dev.devcore, dev.type, dev.numa,
                dev.mode or DEFAULT_MODE, dev.health, profiles,
            )  # fmt: skip
        append(info)
    _check_ids([dev.id for dev in devices])
    return devices


def _fast_profiles(profiles: list[_FastProfile]) -> tuple[MigProfile, ...]:
    return tuple(
        MigProfile(
            p.name,
            p.memoryMB,
            p.core,
            p.sliceCount,
            tuple(MigPlacement(x.start, x.size) for x in p.placements or ()),
        )
        for p in profiles
    )


def _decode_json_exact(value: str) -> list[DeviceInfo]:
    raw = parse_json(_KEY, value)
    if type(raw) is not list:
        raise ProtocolError(_KEY, raw, "expected a JSON array of devices")

    devices: list[DeviceInfo] = []
    append = devices.append
    ids: list[str] = []
    known = _KNOWN.issuperset
    modes = _MODES_OR_EMPTY
    u64, i64, i32 = _UINT64_MAX, _INT64_MAX, _INT32_MAX
    new = object.__new__
    s_id, s_index, s_count, s_devmem, s_devcore, s_type, s_numa, s_mode, s_health, s_mig = _SETTERS
    # The hot path: one combined check per device; _explain_json pinpoints a failure.
    for i, obj in enumerate(raw):
        if type(obj) is not dict:
            raise ProtocolError(f"{_KEY}[{i}]", obj, "expected a JSON object")
        if not known(obj):
            obj = fold_keys(obj)
        get = obj.get
        id_ = get("id", "")
        index = get("index", 0)
        count = get("count", 0)
        devmem = get("devmem", 0)
        devcore = get("devcore", 0)
        type_ = get("type", "")
        numa = get("numa", 0)
        mode = get("mode", "")
        health = get("health", False)
        if not (
            type(id_) is str
            and id_
            and type(index) is int
            and type(count) is int
            and type(devmem) is int
            and type(devcore) is int
            and type(type_) is str
            and type(numa) is int
            and type(mode) is str
            and type(health) is bool
            and 0 <= index <= u64
            and 0 <= count <= i32
            and 0 <= devmem <= i32
            and 0 <= devcore <= i32
            and 0 <= numa <= i64
            and mode in modes
        ):
            _explain_json(i, obj)
        mig = get("migProfiles")
        profiles = () if mig is None else _decode_profiles(f"{_KEY}[{i}].migProfiles", mig)
        ids.append(id_)
        if _DIRECT:
            dev = new(DeviceInfo)
            s_id(dev, id_)
            s_index(dev, index)
            s_count(dev, count)
            s_devmem(dev, devmem)
            s_devcore(dev, devcore)
            s_type(dev, type_)
            s_numa(dev, numa)
            s_mode(dev, mode or DEFAULT_MODE)
            s_health(dev, health)
            s_mig(dev, profiles)
        else:  # pragma: no cover (only if DeviceInfo grows more than its fields)
            dev = DeviceInfo(
                id_, index, count, devmem, devcore, type_, numa, mode or DEFAULT_MODE, health, profiles
            )
        append(dev)
    _check_ids(ids)
    return devices


def fold_keys(
    obj: dict[str, Any], known: frozenset[str] = _KNOWN, folded_names: dict[str, str] = _FOLDED
) -> dict[str, Any]:
    """Go's json.Unmarshal matching: exact key, else case-insensitive; later keys win; unknown ignored."""
    folded: dict[str, Any] = {}
    for key, val in obj.items():
        name = key if key in known else folded_names.get(key.lower())
        if name is not None:
            folded[name] = val
    return folded


# A MigProfile's keys and a MigPlacement's (Go's struct order), and the range of each integer.
_PROFILE_INTS: Final = {"memoryMB": _INT32_MAX, "core": _INT32_MAX, "sliceCount": _UINT32_MAX}
_PROFILE_KEYS: Final = frozenset(("name", *_PROFILE_INTS, "placements"))
_PROFILE_FOLDED: Final = {name.lower(): name for name in _PROFILE_KEYS}
_PLACEMENT_KEYS: Final = frozenset(("start", "size"))
_PLACEMENT_FOLDED: Final = {name: name for name in _PLACEMENT_KEYS}


def _decode_profiles(field: str, raw: object) -> tuple[MigProfile, ...]:
    """A device's ``migProfiles`` (not null), strictly; errors name the profile and key."""
    if type(raw) is not list:
        raise ProtocolError(field, raw, "expected a JSON array of MIG profiles")
    profiles: list[MigProfile] = []
    for j, obj in enumerate(raw):
        at = f"{field}[{j}]"
        if type(obj) is not dict:
            raise ProtocolError(at, obj, "expected a JSON object")
        obj = fold_keys(obj, _PROFILE_KEYS, _PROFILE_FOLDED)
        name = obj.get("name", "")
        if type(name) is not str:
            raise ProtocolError(f"{at}.name", name, "expected a JSON string")
        if not name:
            raise ProtocolError(f"{at}.name", name, "MIG profile name missing or empty")
        for key, maximum in _PROFILE_INTS.items():
            check_go_int(f"{at}.{key}", obj.get(key, 0), maximum)
        raw_placements = obj.get("placements")
        placements: tuple[MigPlacement, ...] = ()
        if raw_placements is not None:
            placements = _decode_placements(f"{at}.placements", raw_placements)
        profiles.append(
            MigProfile(name, obj.get("memoryMB", 0), obj.get("core", 0), obj.get("sliceCount", 0), placements)
        )
    return tuple(profiles)


def decode_mig_placement(field: str, obj: object) -> MigPlacement:
    """A ``{"start":..,"size":..}`` object (Go's ``MigPlacement``), strictly: uint32 each, size >= 1."""
    if type(obj) is not dict:
        raise ProtocolError(field, obj, "expected a JSON object")
    obj = fold_keys(obj, _PLACEMENT_KEYS, _PLACEMENT_FOLDED)
    start, size = obj.get("start", 0), obj.get("size", 0)
    check_go_int(f"{field}.start", start, _UINT32_MAX)
    check_go_int(f"{field}.size", size, _UINT32_MAX)
    if size == 0:
        raise ProtocolError(f"{field}.size", size, "a MIG placement holds at least one slice")
    return MigPlacement(start, size)


def _decode_placements(field: str, raw: object) -> tuple[MigPlacement, ...]:
    if type(raw) is not list:
        raise ProtocolError(field, raw, "expected a JSON array of placements")
    return tuple(decode_mig_placement(f"{field}[{k}]", obj) for k, obj in enumerate(raw))


def _explain_json(i: int, obj: dict[str, Any]) -> NoReturn:
    """Raise the ProtocolError for the first bad field of device ``i``."""
    for name in _FIELDS:
        if name not in obj:
            continue
        val = obj[name]
        field = f"{_KEY}[{i}].{name}"
        if name in _INT_FIELDS:
            check_go_int(field, val, _INT_FIELDS[name])
        elif name == "health":
            if type(val) is not bool:
                raise ProtocolError(field, val, "expected a JSON boolean")
        elif type(val) is not str:
            raise ProtocolError(field, val, "expected a JSON string")
        elif name == "id" and not val:
            raise ProtocolError(field, val, "device id is empty")
        elif name == "mode" and val not in _MODES_OR_EMPTY:
            raise ProtocolError(field, val, f"unknown mode; expected one of {', '.join(DEVICE_MODES)}")
    if "id" not in obj:
        raise ProtocolError(f"{_KEY}[{i}].id", obj, "device id missing")
    raise AssertionError("unreachable: device passed every check")  # pragma: no cover


def check_go_int(field: str, val: object, maximum: int) -> None:
    """Refuse (``ProtocolError`` on ``field``) anything but an int in ``0 .. maximum``: a bool, float,
    string or null too, which Go would take as a zero or an error."""
    if type(val) is not int:
        kind = {bool: "boolean", float: "fraction", str: "string"}.get(type(val), type(val).__name__)
        raise ProtocolError(field, val, f"expected an integer, got a {kind}")
    if val < 0:
        raise ProtocolError(field, val, "must not be negative")
    if val > maximum:
        raise ProtocolError(field, val, f"out of range (at most {maximum})")


def _check_ids(ids: list[str]) -> None:
    """Bad characters and duplicates, checked over all ids at once; only a hit pays for finding which."""
    joined = "".join(ids)
    # UUIDs are letters, digits and dashes: str.isalnum settles that in C, far faster than the
    # regex, which runs only for other ids.
    if not joined.replace("-", "").isalnum() and _BAD_ID_CHAR(joined):
        for i, id_ in enumerate(ids):
            _check_id(i, id_)
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for i, id_ in enumerate(ids):
            if id_ in seen:
                raise ProtocolError(f"{_KEY}[{i}].id", id_, "device id registered twice")
            seen.add(id_)


def _check_id(i: int, id_: str) -> None:
    if not id_:
        raise ProtocolError(f"{_KEY}[{i}].id", id_, "device id missing or empty")
    if _BAD_ID_CHAR(id_):
        raise ProtocolError(f"{_KEY}[{i}].id", id_, "device id holds a blank, ',', ':' or ';'")


# -- legacy form -------------------------------------------------------------------------------------


def _decode_legacy(value: str) -> list[DeviceInfo]:
    entries = value.split(":")
    if entries[-1] == "":
        entries.pop()  # the terminator of the last device
    if not entries:
        raise ProtocolError(_KEY, value, "no device in the value")
    devices: list[DeviceInfo] = []
    for i, entry in enumerate(entries):
        items = entry.split(",")
        if len(items) not in (7, 9):
            what = "empty device entry (doubled ':')" if not entry else f"{len(items)} fields"
            raise ProtocolError(f"{_KEY}[{i}]", entry, f"{what}; expected 7 or 9 fields")
        _check_id(i, items[0])
        health = _GO_BOOL.get(items[6])
        if health is None:
            raise ProtocolError(f"{_KEY}[{i}].health", items[6], "expected true or false")
        index, mode = 0, DEFAULT_MODE
        if len(items) == 9:
            index = _legacy_int(i, "index", items[7], _INT64_MAX)
            mode = items[8] or DEFAULT_MODE
            if mode not in _MODES:
                raise ProtocolError(
                    f"{_KEY}[{i}].mode", mode, f"unknown mode; expected one of {', '.join(DEVICE_MODES)}"
                )
        devices.append(
            DeviceInfo(
                id=items[0],
                index=index,
                count=_legacy_int(i, "count", items[1], _INT32_MAX),
                devmem=_legacy_int(i, "devmem", items[2], _INT32_MAX),
                devcore=_legacy_int(i, "devcore", items[3], _INT32_MAX),
                type=items[4],
                numa=_legacy_int(i, "numa", items[5], _INT64_MAX),
                mode=mode,
                health=health,
            )
        )
    _check_ids([dev.id for dev in devices])
    return devices


def _legacy_int(i: int, name: str, text: str, maximum: int) -> int:
    # isascii+isdigit: int() alone would take blanks, '_', signs and non-ASCII digits.
    if not (text.isascii() and text.isdigit()):
        reason = "must not be negative" if text[:1] == "-" and text[1:].isdigit() else "not a decimal integer"
        raise ProtocolError(f"{_KEY}[{i}].{name}", text, reason)
    val = int(text)
    if val > maximum:
        raise ProtocolError(f"{_KEY}[{i}].{name}", text, f"out of range (at most {maximum})")
    return val


# -- shared ------------------------------------------------------------------------------------------


def check_value(field: str, value: str) -> None:
    """Refuse (``ProtocolError`` on ``field``) an annotation value over ``MAX_VALUE_BYTES``."""
    # Characters never outnumber UTF-8 bytes, so the byte count is only needed for non-ASCII text.
    if len(value) > MAX_VALUE_BYTES or (not value.isascii() and len(value.encode()) > MAX_VALUE_BYTES):
        raise ProtocolError(field, value, f"value longer than {MAX_VALUE_BYTES} bytes")


def parse_json(field: str, value: str) -> Any:
    """``json.loads`` of an annotation value, its failure a ``ProtocolError`` on ``field`` saying where."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ProtocolError(field, value, f"not valid JSON: {exc.msg} at offset {exc.pos}") from exc
    except RecursionError as exc:
        raise ProtocolError(field, value, "JSON nested too deeply") from exc


def _check_encodable(i: int, dev: DeviceInfo) -> None:
    if type(dev.id) is not str:
        raise ProtocolError(f"{_KEY}[{i}].id", dev.id, "expected a string")
    _check_id(i, dev.id)
    check_utf8(f"{_KEY}[{i}].id", dev.id)
    for name, maximum in _INT_FIELDS.items():
        check_go_int(f"{_KEY}[{i}].{name}", getattr(dev, name), maximum)
    if type(dev.type) is not str:
        raise ProtocolError(f"{_KEY}[{i}].type", dev.type, "expected a string")
    if dev.mode not in _MODES:
        raise ProtocolError(
            f"{_KEY}[{i}].mode", dev.mode, f"unknown mode; expected one of {', '.join(DEVICE_MODES)}"
        )
    if type(dev.health) is not bool:
        raise ProtocolError(f"{_KEY}[{i}].health", dev.health, "expected a boolean")
    check_utf8(f"{_KEY}[{i}].type", dev.type)
    for j, profile in enumerate(dev.mig_profiles):
        at = f"{_KEY}[{i}].migProfiles[{j}]"
        if type(profile.name) is not str or not profile.name:
            raise ProtocolError(f"{at}.name", profile.name, "expected a non-empty string")
        check_utf8(f"{at}.name", profile.name)
        check_go_int(f"{at}.memoryMB", profile.memory_mb, _INT32_MAX)
        check_go_int(f"{at}.core", profile.core, _INT32_MAX)
        check_go_int(f"{at}.sliceCount", profile.slice_count, _UINT32_MAX)
        for k, placement in enumerate(profile.placements):
            check_mig_placement(f"{at}.placements[{k}]", placement)


def check_mig_placement(field: str, placement: MigPlacement) -> None:
    """Refuse (``ProtocolError``) a placement ``decode_mig_placement`` would refuse."""
    check_go_int(f"{field}.start", placement.start, _UINT32_MAX)
    check_go_int(f"{field}.size", placement.size, _UINT32_MAX)
    if placement.size == 0:
        raise ProtocolError(f"{field}.size", placement.size, "a MIG placement holds at least one slice")


def encode_mig_placement(placement: MigPlacement) -> str:
    """Go's ``json.Marshal`` of a ``MigPlacement`` (no omitempty)."""
    return f'{{"start":{placement.start},"size":{placement.size}}}'


def _encode_profiles(profiles: tuple[MigProfile, ...]) -> str:
    # Go's MigProfile has no omitempty; a nil Placements slice is null (the plugin appends to nil).
    return (
        "["
        + ",".join(
            f'{{"name":{go_string(p.name)},"memoryMB":{p.memory_mb},"core":{p.core},'
            f'"sliceCount":{p.slice_count},"placements":'
            + ("[" + ",".join(map(encode_mig_placement, p.placements)) + "]" if p.placements else "null")
            + "}"
            for p in profiles
        )
        + "]"
    )


def check_utf8(field: str, text: str) -> None:
    """Refuse (``ProtocolError``) text UTF-8 cannot hold: a lone surrogate, which Go would
    silently write as U+FFFD."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ProtocolError(field, text, "not encodable as UTF-8") from exc


def go_string(text: str) -> str:
    """A JSON string as Go's ``json.Marshal`` writes it."""
    return json.dumps(text, ensure_ascii=False).translate(_GO_ESCAPES)


def go_json(value: object) -> str:
    """``value`` as Go's ``json.Marshal`` writes it: no blanks, UTF-8 as is, ``<``, ``>``, ``&``,
    U+2028 and U+2029 escaped; keys in the order given (Go sorts a map's, a struct's are fixed)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).translate(_GO_ESCAPES)
