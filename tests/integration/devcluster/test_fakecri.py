"""The fake container runtime's own Go tests (``fakecri/main_test.go``), built in the same Kubernetes
wrapper module as the runtime itself: what the kubelet reads from a runtime that the upstream fake
leaves out (a container's log path) must be there, or the kubelet's clean-up goes wrong."""

from __future__ import annotations

import shutil

import pytest

from hamipy.devcluster.binaries import run_fakecri_go_tests

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("go") is None, reason="Go is not installed (the runtime is Go)"),
]


def test_the_fake_runtimes_go_tests_pass() -> None:
    run_fakecri_go_tests()  # BinaryBuildError with Go's output on a failure
