"""The real kubelet's mount namespace shadows every kernel setting it would change and gives it its
own directory (the behaviour on a real kubelet is in tests/integration/devcluster/test_real_kubelet.py)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from hamipy.devcluster.real_kubelet import KUBELET_DIR, PROTECTED_SYSCTLS, RealKubelet


def test_the_namespace_shadows_the_kernel_settings_and_the_kubelet_dir(tmp_path: Path) -> None:
    cluster: Any = object()
    script = RealKubelet(cluster, "n1", tmp_path).namespace_script(Path("/bin/kubelet"), tmp_path / "kc")
    lines = script.splitlines()
    assert lines[0] == "set -e"  # a failed mount stops it before the kubelet touches anything
    mounts = [shlex.split(line)[-1] for line in lines if line.startswith("mount --bind ")]
    assert mounts == [str(KUBELET_DIR), *(f"/proc/sys/{name}" for name in PROTECTED_SYSCTLS)]
    assert {"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"} == set(PROTECTED_SYSCTLS)
    exec_line = shlex.split(lines[-1])
    assert exec_line[:2] == ["exec", "/bin/kubelet"]
    assert "--hostname-override=n1" in exec_line
