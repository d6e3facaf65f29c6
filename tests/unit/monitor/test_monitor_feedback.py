"""The priority feedback rule, pass by pass, as the interposer sees it: who is blocked and who has
its compute limit switched on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hamipy.monitor.feedback import BLOCKED, KERNEL_MARK, FeedbackInput, FeedbackWrite, feedback

GPU_A = "GPU-A"
GPU_B = "GPU-B"
HIGH, LOW = 0, 1


class Node:
    """Regions of one node as dicts of their two fields, updated by the writes of each pass."""

    def __init__(self, **containers: tuple[int, Sequence[str]]) -> None:
        self.meta = containers
        self.fields = {name: {"recent_kernel": 0, "utilization_switch": 1} for name in containers}

    def launch(self, *names: str) -> None:
        for name in names:  # what the interposer does at a kernel launch
            self.fields[name]["recent_kernel"] = KERNEL_MARK

    def step(self) -> list[FeedbackWrite[str]]:
        inputs = [
            FeedbackInput(
                name,
                prio,
                self.fields[name]["recent_kernel"],
                self.fields[name]["utilization_switch"],
                tuple(devs),
            )
            for name, (prio, devs) in self.meta.items()
        ]
        writes = feedback(inputs)
        for w in writes:
            self.fields[w.key][w.field] = w.value
        return writes

    def blocked(self, name: str) -> bool:
        return self.fields[name]["recent_kernel"] < 0

    def limited(self, name: str) -> bool:
        return self.fields[name]["utilization_switch"] == 1

    def state(self, name: str) -> tuple[bool, bool]:
        """(blocked, compute-limited)"""
        return self.blocked(name), self.limited(name)


def test_a_lone_container_runs_without_compute_limit() -> None:
    node = Node(solo=(LOW, [GPU_A]))
    node.launch("solo")
    node.step()
    assert node.state("solo") == (False, False)


def test_higher_priority_work_blocks_lower_priority_on_the_same_gpu() -> None:
    node = Node(train=(LOW, [GPU_A]), serve=(HIGH, [GPU_A]))
    node.launch("train", "serve")
    node.step()
    assert node.state("train") == (True, True)
    assert node.state("serve") == (False, False), "high priority is alone at its level"


def test_the_lower_priority_container_is_released_once_the_higher_one_goes_idle() -> None:
    node = Node(train=(LOW, [GPU_A]), serve=(HIGH, [GPU_A]))
    node.launch("train", "serve")
    node.step()
    assert node.blocked("train")
    node.step()  # serve launched nothing since: its mark has aged out
    assert node.fields["serve"]["recent_kernel"] == 0
    assert not node.blocked("train")
    assert node.fields["train"]["recent_kernel"] == 0
    assert not node.limited("train")


def test_while_the_higher_priority_container_keeps_launching_the_lower_stays_blocked() -> None:
    node = Node(train=(LOW, [GPU_A]), serve=(HIGH, [GPU_A]))
    for _ in range(4):
        node.launch("serve")
        node.step()
        assert node.blocked("train"), "even a container that has not launched waits its turn"
    node.launch("train", "serve")  # a launch attempt of the blocked one does not release it
    node.step()
    assert node.blocked("train")
    node.step()
    assert not node.blocked("train")


def test_two_busy_containers_of_equal_priority_both_get_the_compute_limit() -> None:
    node = Node(a=(LOW, [GPU_A]), b=(LOW, [GPU_A]))
    node.launch("a", "b")
    node.step()
    assert node.state("a") == node.state("b") == (False, True)


def test_containers_on_different_gpus_do_not_affect_each_other() -> None:
    node = Node(a=(LOW, [GPU_A]), b=(HIGH, [GPU_B]))
    node.launch("a", "b")
    node.step()
    assert node.state("a") == (False, False)


def test_a_container_on_two_gpus_is_blocked_by_higher_priority_work_on_either() -> None:
    """Upstream decides by the first GPU it finds in its table; every GPU counts here."""
    node = Node(wide=(LOW, [GPU_A, GPU_B]), other=(LOW, [GPU_A]), serve=(HIGH, [GPU_B]))
    node.launch("wide", "other", "serve")
    node.step()
    assert node.blocked("wide")


def test_an_idle_container_sees_an_active_one_of_its_priority_as_not_sharing() -> None:
    node = Node(busy=(LOW, [GPU_A]), idle=(LOW, [GPU_A]))
    node.launch("busy")
    node.step()
    assert not node.limited("idle"), "one active container at its level is not contention"
    assert not node.limited("busy")


def test_only_changes_are_written_and_one_value_per_field() -> None:
    node = Node(train=(LOW, [GPU_A]), serve=(HIGH, [GPU_A]))
    node.fields["serve"]["utilization_switch"] = 0
    node.launch("train", "serve")
    writes = node.step()
    assert sorted((w.key, w.field, w.value) for w in writes) == [
        ("serve", "recent_kernel", 1),
        ("train", "recent_kernel", BLOCKED),
    ]
    assert node.step() == [
        FeedbackWrite("serve", "recent_kernel", 0),
        FeedbackWrite("train", "recent_kernel", 0),
        FeedbackWrite("train", "utilization_switch", 0),
    ]
    assert node.step() == []


@pytest.mark.parametrize(("low", "high"), [(5, 2), (1, -3)], ids=["5-vs-2", "1-vs-minus-3"])
def test_any_priority_values_order_numerically(low: int, high: int) -> None:
    node = Node(low=(low, [GPU_A]), high=(high, [GPU_A]))
    node.launch("low", "high")
    node.step()
    assert (node.blocked("low"), node.blocked("high")) == (True, False)


def test_devices_without_uuid_are_not_counted() -> None:
    node = Node(a=(LOW, ["", GPU_A]), b=(HIGH, [""]))
    node.launch("a", "b")
    node.step()
    assert not node.blocked("a")


def test_a_value_above_the_mark_ages_out_like_a_fresh_mark() -> None:
    """A torn write could leave e.g. 0x020000FF; it must not keep the GPU busy for ever."""
    node = Node(odd=(HIGH, [GPU_A]), low=(LOW, [GPU_A]))
    node.fields["odd"]["recent_kernel"] = 0x020000FF
    node.step()
    assert node.fields["odd"]["recent_kernel"] == 1
    assert node.blocked("low")
    node.step()
    assert (node.fields["odd"]["recent_kernel"], node.blocked("low")) == (0, False)


def test_any_negative_value_is_blocked_and_released_to_zero() -> None:
    node = Node(a=(LOW, [GPU_A]))
    node.fields["a"]["recent_kernel"] = -77
    node.step()
    assert node.fields["a"]["recent_kernel"] == 0
