"""hamipy.protocol.reserved_mounts: which container paths a GPU container's own volumes may not cover,
in every spelling the kubelet and the container runtime clean to one of them."""

from __future__ import annotations

import posixpath
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH, LD_SO_PRELOAD, allocation_mounts
from hamipy.protocol.reserved_mounts import (
    HOOK_REASON,
    NOT_CANONICAL_REASON,
    PARENT_REASON,
    PRELOAD_REASON,
    canonical,
    reserved_mount_paths,
    reserved_mount_use,
    reserved_mount_why,
)

HOOKS = (DEFAULT_HOOK_PATH, "/opt/hami/vgpu")
RESERVED = reserved_mount_paths(HOOKS)


def _runtime_path(mount_path: str) -> str:
    """Where a ``mountPath`` lands: the kubelet makes a relative one absolute, the runtime cleans it
    (Go's ``filepath.Clean``, which keeps one leading ``/``)."""
    return "/" + posixpath.normpath("/" + mount_path).lstrip("/")


def _covers_reserved(mount_path: str) -> bool:
    """Whether the volume lands on a reserved path, under one, or on a parent of one."""
    landed = _runtime_path(mount_path)
    return any(
        landed == path or landed.startswith(path + "/") or path.startswith(landed.rstrip("/") + "/")
        for path in RESERVED
    )


def test_the_reserved_paths_are_the_device_plugins_mounts() -> None:
    """Every container path of the Allocate answer is refused, for each hook path, and so is each
    of its parents: a volume there is the pod's, and a link in it could send the device plugin's
    mount under another volume of the pod."""
    assert RESERVED == (DEFAULT_HOOK_PATH, "/opt/hami/vgpu", LD_SO_PRELOAD)
    for hook in HOOKS:
        for mount in allocation_mounts(hook_path=hook, pod_uid="uid", container_name="cuda"):
            assert reserved_mount_why(mount.container_path, RESERVED) is not None, mount
            parent = posixpath.dirname(mount.container_path)
            while parent != "/":
                assert reserved_mount_why(parent, RESERVED) is not None, parent
                parent = posixpath.dirname(parent)


def test_hook_paths_are_cleaned_and_named_once() -> None:
    assert reserved_mount_paths(["/usr/local//vgpu/", "/usr/./local/vgpu", "/usr/local/vgpu"]) == (
        "/usr/local/vgpu",
        LD_SO_PRELOAD,
    )


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/usr/local/vgpu/limits", HOOK_REASON),
        ("/usr/local/vgpu", HOOK_REASON),
        ("/usr/local/vgpu/", HOOK_REASON),
        ("/usr/local/vgpu/libvgpu.so", HOOK_REASON),
        ("/usr/local/vgpu/anything/deeper", HOOK_REASON),
        ("/opt/hami/vgpu/limits", HOOK_REASON),
        ("/etc/ld.so.preload", PRELOAD_REASON),
        ("/etc/ld.so.preload/", PRELOAD_REASON),
        ("/usr/local//vgpu/limits", NOT_CANONICAL_REASON),
        ("/usr/local//vgpu", NOT_CANONICAL_REASON),
        ("//etc/ld.so.preload", NOT_CANONICAL_REASON),
        ("/etc/./ld.so.preload", NOT_CANONICAL_REASON),
        ("/usr/x/../local/vgpu", NOT_CANONICAL_REASON),
        ("/etc/ld.so.preload/.", PRELOAD_REASON),
        ("/etc/x/..", NOT_CANONICAL_REASON),
        ("/etc/.", NOT_CANONICAL_REASON),
        ("etc/ld.so.preload", NOT_CANONICAL_REASON),
        ("usr/local/vgpu/limits", NOT_CANONICAL_REASON),
        ("/", PARENT_REASON),
        ("/etc", PARENT_REASON),
        ("/etc/", PARENT_REASON),
        ("/usr", PARENT_REASON),
        ("/usr/local", PARENT_REASON),
        ("/usr/local/", PARENT_REASON),
        ("/opt", PARENT_REASON),
        ("/opt/hami", PARENT_REASON),
        ("", PARENT_REASON),
        ("/usr//", NOT_CANONICAL_REASON),
        ("/etc2", None),
        ("/usr/local/vgpu2", None),
        ("/usr/local/vg", None),
        ("/opt/ham", None),
        ("/usr/local/vgpu.d/limits", None),
        ("/etc/ld.so.preload.d", None),
        ("/etc/ld.so.conf.d", None),
        ("/data", None),
        ("/data/..x/.y", None),
        ("/srv", None),
    ],
)
def test_reserved_non_canonical_and_free_paths(path: str, why: str | None) -> None:
    assert reserved_mount_why(path, RESERVED) == why


_SEGMENT = st.sampled_from(
    ["", ".", "..", "usr", "local", "vgpu", "opt", "hami", "etc", "ld.so.preload", "limits", "x", "..x"]
)


@given(st.booleans(), st.lists(_SEGMENT, max_size=8))
def test_every_path_that_lands_on_a_reserved_one_is_refused(absolute: bool, segments: list[str]) -> None:
    path = ("/" if absolute else "") + "/".join(segments)
    if path and _covers_reserved(path):
        assert reserved_mount_why(path, RESERVED) is not None


@st.composite
def _respelled(draw: st.DrawFn) -> str:
    """A reserved path, one under it or a parent of it, written another way: doubled or ``.``
    segments, a detour through ``..``, relative, or with a trailing ``/``, ``/.``."""
    base = draw(st.sampled_from(RESERVED)).split("/")[1:]
    cut = draw(st.integers(0, len(base)))
    if cut < len(base):
        base = base[:cut]
    else:
        base += draw(st.lists(st.sampled_from(["limits", "a", "libvgpu.so"]), max_size=2))
    out: list[str] = []
    for segment in base:
        out += draw(st.lists(st.sampled_from(["", ".", "detour"]), max_size=2))
        out.append(segment)
    spelled = "/".join("x/.." if s == "detour" else s for s in out)
    lead = draw(st.sampled_from(["/", "", "//"]))
    tail = draw(st.sampled_from(["", "/", "/.", "/x/.."]))
    return lead + spelled + tail


@given(_respelled())
def test_every_other_spelling_of_a_reserved_path_is_refused(path: str) -> None:
    assert _covers_reserved(path)
    assert reserved_mount_why(path, RESERVED) is not None


_NAME = st.text(st.sampled_from("abcehlopsu.-_019"), min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)


@given(st.lists(_NAME, max_size=6), st.booleans())
def test_canonical_paths_elsewhere_are_admitted(segments: list[str], trailing: bool) -> None:
    path = "/" + "/".join(segments) + ("/" if trailing and segments else "")
    assert canonical(path)
    if not _covers_reserved(path):
        assert reserved_mount_why(path, RESERVED) is None


def test_the_refusal_names_the_container_the_volume_and_the_path() -> None:
    container: dict[str, Any] = {
        "name": "cuda",
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "mine", "mountPath": "/usr/local/vgpu/limits", "subPath": "limits"},
            {"name": "also", "mountPath": LD_SO_PRELOAD},
        ],
    }
    problem = reserved_mount_use(container, reserved=RESERVED, label="containers[0] 'cuda'")
    assert problem == (
        f"container containers[0] 'cuda' mounts volume 'mine' at '/usr/local/vgpu/limits': {HOOK_REASON}"
    )
    assert "'" not in HOOK_REASON + PRELOAD_REASON + NOT_CANONICAL_REASON  # they go into CEL strings


@pytest.mark.parametrize(
    "mounts",
    [None, [], "nonsense", [None, 3, {"name": "x"}, {"name": "y", "mountPath": 7}], [{"mountPath": "/data"}]],
)
def test_what_mounts_nothing_reserved_is_no_refusal(mounts: Any) -> None:
    assert reserved_mount_use({"volumeMounts": mounts}, reserved=RESERVED, label="c") is None
