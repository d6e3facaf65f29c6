"""What a region directory's name and a region file's decoding error mean (pure).

The device plugin gives each GPU container the host directory ``<hook>/containers/<podUID>_<container>``
(``hamipy.protocol.allocation_env.region_host_dir``), mounted where the interposer writes its region
file. The monitor reads the name back with ``parse_region_dir_name`` and checks it is exactly what
``region_host_dir`` makes of the two parts, so this module cannot drift from the protocol's format.

A file that ``hamipy.protocol.region.parse_region`` refuses is reported under a short reason, the
label of ``hamipy_monitor_region_errors_total`` and ``hamipy_monitor_region_files``:

- ``uninitialised``: empty, or the magic is still 0 (the interposer is creating it; not an error);
- ``truncated``: shorter than the region (``region.size``);
- ``foreign``: another magic: not a region file;
- ``version``: a region of another layout version;
- ``malformed``: a region whose counts or UUIDs are out of range;
- ``unreadable``: not a regular file, or the read failed (``OSError``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final, Literal

from hamipy.protocol.allocation_env import parse_region_dir_name, region_host_dir
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.region import RegionSnapshot

__all__ = [
    "ERROR_PROBLEMS",
    "PROBLEMS",
    "RegionDir",
    "RegionProblem",
    "RegionReading",
    "parse_region_dir",
    "problem_of",
]

RegionProblem = Literal["uninitialised", "truncated", "foreign", "version", "malformed", "unreadable"]
PROBLEMS: Final[tuple[RegionProblem, ...]] = (
    "uninitialised",
    "truncated",
    "foreign",
    "version",
    "malformed",
    "unreadable",
)
ERROR_PROBLEMS: Final = frozenset(PROBLEMS) - {"uninitialised"}
"""The reasons that are errors: logged as warnings and counted. ``uninitialised`` is a container
starting up."""


@dataclasses.dataclass(frozen=True, slots=True)
class RegionDir:
    """One container's region directory on the host."""

    pod_uid: str
    container: str
    path: Path


@dataclasses.dataclass(frozen=True, slots=True)
class RegionReading:
    """What one container directory held at one scan.

    ``file`` is the region file read (None when the container has none yet); ``snapshot`` its
    decoding, or None with ``problem`` saying why it could not be read.
    """

    dir: RegionDir
    file: Path | None = None
    snapshot: RegionSnapshot | None = None
    problem: RegionProblem | None = None


def parse_region_dir(hook_path: Path, name: str) -> RegionDir | None:
    """The pod UID and container of the directory ``name`` in ``<hook>/containers``, or None when
    the name is not one ``region_host_dir`` makes."""
    try:
        pod_uid, container = parse_region_dir_name(name)
        expected = region_host_dir(str(hook_path), pod_uid, container)
    except ProtocolError:
        return None
    path = Path(expected)
    if path.name != name:
        return None
    return RegionDir(pod_uid=pod_uid, container=container, path=path)


def problem_of(exc: ProtocolError) -> RegionProblem:
    """The reason label of a ``parse_region`` refusal."""
    if exc.field == "region.size":
        return "truncated"
    if exc.field == "region.initialized_flag":
        return "uninitialised" if exc.value == 0 else "foreign"
    if exc.field in ("region.major_version", "region.minor_version"):
        return "version"
    return "malformed"
