"""Fixtures of the extender's integration tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    """A device-plugin directory for a kubelet stand-in, short enough for unix socket paths
    (pytest's ``tmp_path`` is not); removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="hp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
