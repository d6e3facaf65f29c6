"""Frees always reach the driver, including of memory allocated before the interposer saw it,
and never drive the region's counters below zero."""

from __future__ import annotations

import pytest
from native_support import ContainerFactory, expect_ok

pytestmark = pytest.mark.native


def test_free_of_unseen_pointer_reaches_driver(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"})
    expect_ok(container.run("free_of_unseen_pointer_reaches_driver"))
