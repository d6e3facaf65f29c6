"""Fixtures of the extender's integration tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from extender_cluster import Cluster
from stack_support import start_extenders, use_extender

from hamipy.devcluster import NodePool
from hamipy.extender.server import ExtenderServer


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    """A device-plugin directory for a kubelet stand-in, short enough for unix socket paths
    (pytest's ``tmp_path`` is not); removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="hp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def cluster(kube_client: Any, namespace: str, node_pool: NodePool) -> Cluster:
    return Cluster(kube_client, namespace, node_pool)


@pytest.fixture
async def extender(kube_client: Any, hami_scheduler: Callable[..., Any]) -> AsyncIterator[ExtenderServer]:
    """One extender in this process, synced, wired into the ``hami-scheduler``."""
    (server,) = await start_extenders(kube_client)
    await use_extender(hami_scheduler, server.url)
    yield server
    await server.stop()
