"""The hook table, the exported symbols and the lookup paths agree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from native_support import NATIVE, ContainerFactory, expect_ok

pytestmark = pytest.mark.native

HOOKS_DEF = NATIVE / "include" / "hamipy" / "hooks.def"


def hooked_names() -> set[str]:
    return set(re.findall(r"^HOOK_(?:CU|NVML)\((\w+)", HOOKS_DEF.read_text(), flags=re.MULTILINE))


def test_every_hook_resolves_through_every_path(make_container: ContainerFactory) -> None:
    container = make_container()
    out = expect_ok(container.run("hook_table_consistency"))
    assert out.strip() == f"ok {len(hooked_names())} hooks"


def test_libvgpu_exports_exactly_the_hooks_and_dlsym(native_build: Path) -> None:
    lib = native_build / "libvgpu.so"
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert exported == hooked_names() | {"dlsym"}
