"""The real kubelet's mount namespace shadows every kernel setting it would change and gives it its
own directory (the behaviour on a real kubelet is in tests/integration/devcluster/test_real_kubelet.py);
a wait for a container that never comes says what the fake runtime recorded."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from hamipy.devcluster.errors import WaitTimeout
from hamipy.devcluster.kubelet_nodes import KubeletNode
from hamipy.devcluster.real_kubelet import KUBELET_DIR, PROTECTED_SYSCTLS, SHADOWED_DIRS, RealKubelet


def test_the_namespace_shadows_the_kernel_settings_and_the_kubelet_dirs(tmp_path: Path) -> None:
    cluster: Any = object()
    kubelet = RealKubelet(cluster, "n1", tmp_path)
    script = kubelet.namespace_script(Path("/bin/kubelet"), tmp_path / "kc")
    lines = script.splitlines()
    assert lines[0] == "set -e"  # a failed mount stops it before the kubelet touches anything
    mounts = [shlex.split(line)[-2:] for line in lines if line.startswith("mount --bind ")]
    assert [target for _, target in mounts] == [
        "/var/lib",
        "/var/log",
        *(f"/proc/sys/{name}" for name in PROTECTED_SYSCTLS),
    ]
    assert set(SHADOWED_DIRS) == {"/var/lib", "/var/log"}
    # Each shadow lies in the node's directory; the kubelet's own lies within the first.
    for source, target in mounts[:2]:
        assert Path(source) == tmp_path / "fs" / target.lstrip("/")
    assert kubelet.root_dir == Path(mounts[0][0]) / KUBELET_DIR.name
    assert kubelet.plugin_dir == kubelet.root_dir / "device-plugins"
    assert {"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"} == set(PROTECTED_SYSCTLS)
    exec_line = shlex.split(lines[-1])
    assert exec_line[:2] == ["exec", "/bin/kubelet"]
    assert "--hostname-override=n1" in exec_line


async def test_a_wait_for_a_container_that_never_comes_says_what_the_runtime_recorded(tmp_path: Path) -> None:
    cluster: Any = object()
    node = KubeletNode(cluster, None, "n1", tmp_path)
    with pytest.raises(WaitTimeout, match=r"containers\.jsonl does not exist"):
        await node.wait_container("ns", "p", "main", timeout_s=0.05)
    record: dict[str, object] = {"id": "c1", "namespace": "ns", "pod": "other", "pod_uid": "u"}
    record |= {"container": "main", "attempt": 0}
    (tmp_path / "containers.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(WaitTimeout, match=r"holds in ns: other/main#0$"):
        await node.wait_container("ns", "p", "main", timeout_s=0.05)


def test_a_record_reads_back_with_its_cdi_devices(tmp_path: Path) -> None:
    """The fake runtime records the CDI device names the kubelet passed (``cdi_devices``), in order;
    a record without them (an older runtime's) reads as none."""
    cluster: Any = object()
    kubelet = RealKubelet(cluster, "n1", tmp_path)
    base: dict[str, object] = {"id": "c1", "namespace": "ns", "pod": "p", "pod_uid": "u", "attempt": 0}
    names = ["hami.io/vgpu=u_main", "nvidia.com/gpu=GPU-a"]
    lines = [{**base, "container": "main", "cdi_devices": names}, {**base, "container": "old"}]
    (tmp_path / "containers.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    main, old = kubelet.containers()
    assert (main.cdi_devices, old.cdi_devices) == (tuple(names), ())
