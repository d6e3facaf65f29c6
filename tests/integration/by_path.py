"""Test helper modules of other test folders, loaded by their file path: test folders are not
packages, so one cannot import another's helpers by name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def load(relative: str) -> ModuleType:
    """``tests/<relative>`` as a module (loaded once per process)."""
    path = TESTS / relative
    name = "hamipy_tests_" + relative.removesuffix(".py").replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
