"""The replica's role on its own pod (``hamipy.extender.role_label``): what a Service selecting the
leader reads. Written once per change, never while unchanged, and again after a failed write."""

from __future__ import annotations

import dataclasses
import io

import pytest
from builders import gpu_pod
from fake_kube import FakeKube

from hamipy.extender import cli
from hamipy.extender.role_label import RoleLabel
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.errors import KubeError
from hamipy.kube.resources import pod_path
from hamipy.protocol import keys

PATH = pod_path("ns", "extender-0")


def labelled(kube: FakeKube) -> str | None:
    labels = kube.pod("ns", "extender-0")["metadata"].get("labels") or {}
    return labels.get(keys.EXTENDER_ROLE)


def patches(kube: FakeKube) -> int:
    return kube.calls.count(("PATCH", PATH))


def role_label(kube: FakeKube, deciding: list[bool]) -> RoleLabel:
    return RoleLabel(
        api=kube,
        namespace="ns",
        name="extender-0",
        deciding=lambda: deciding[0],
        telemetry=Telemetry.create(stream=io.StringIO()),
        interval_s=1.0,
        timeout_s=1.0,
    )


async def test_the_label_follows_the_role_with_one_write_per_change() -> None:
    kube = FakeKube()
    kube.add(gpu_pod("extender-0"))
    deciding = [False]
    label = role_label(kube, deciding)
    await label.sync()
    assert labelled(kube) == "follower"
    await label.sync()
    assert patches(kube) == 1
    deciding[0] = True
    await label.sync()
    assert labelled(kube) == "leader"
    deciding[0] = False
    await label.sync()
    await label.sync()
    assert labelled(kube) == "follower"
    assert patches(kube) == 3
    metric = label.telemetry.metrics.registry.get_sample_value
    assert metric("hamipy_extender_role_labels_total", {"result": "leader"}) == 1
    assert metric("hamipy_extender_role_labels_total", {"result": "follower"}) == 2


async def test_a_failed_write_is_tried_again_at_the_next_check() -> None:
    kube = FakeKube()
    kube.add(gpu_pod("extender-0"))
    deciding = [True]
    label = role_label(kube, deciding)
    kube.fail(KubeError("PATCH: the API server is down"), "PATCH", PATH)
    await label.sync()
    assert labelled(kube) is None
    assert label.applied is None
    kube.heal()
    await label.sync()
    assert labelled(kube) == "leader"
    metric = label.telemetry.metrics.registry.get_sample_value
    assert metric("hamipy_extender_role_labels_total", {"result": "failed"}) == 1


@pytest.mark.parametrize("own_pod", ["extender-0", "/extender-0", "ns/", "ns/a/b"])
def test_own_pod_must_be_namespace_slash_name(own_pod: str) -> None:
    settings = ExtenderSettings(leader_election=True, advertise_url="http://10.0.0.1:8888", own_pod=own_pod)
    with pytest.raises(ValueError, match="--own-pod must be NAMESPACE/NAME"):
        cli.peer_tls(settings, None, None, None)
    cli.peer_tls(dataclasses.replace(settings, own_pod="ns/extender-0"), None, None, None)
