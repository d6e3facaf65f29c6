"""The layers are held by import-linter (``make lint``, contracts in pyproject.toml): the tree as it
is keeps them, and a service importing another, or a pure module importing I/O, breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint(overlay: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if overlay is not None:  # first on the path: its packages shadow the installed ones
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), env.get("PYTHONPATH")]))
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def overlay_with(tmp_path: Path, package: str, source: Path, planted: str) -> Path:
    """A copy of ``package`` (``hamipy.<name>``) with one more module, ``planted.py``."""
    target = tmp_path / "hamipy" / package
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    (target / "planted.py").write_text(planted)
    return tmp_path


def test_the_tree_keeps_every_layer_contract() -> None:
    done = lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("package", "source", "planted", "contract"),
    [
        pytest.param(
            "webhook",
            "services/webhook/src/hamipy/webhook",
            "from hamipy.extender import scoring\n",
            "Services never import each other",
            id="service-imports-service",
        ),
        pytest.param(
            "protocol",
            "libs/protocol/src/hamipy/protocol",
            "import aiohttp\n",
            "hamipy.protocol is pure",
            id="protocol-imports-io",
        ),
    ],
)
def test_a_broken_layer_fails_the_lint(
    tmp_path: Path, package: str, source: str, planted: str, contract: str
) -> None:
    done = lint(overlay_with(tmp_path, package, ROOT / source, planted))
    assert done.returncode != 0
    assert f"{contract}" in done.stdout
    assert "BROKEN" in done.stdout
    assert "planted" in done.stdout


@pytest.mark.parametrize(
    ("module", "planted", "refusal"),
    [
        pytest.param(
            "fitting",
            "from hamipy.kube import client as _client",
            "hamipy.extender.fitting is not allowed to import hamipy.kube.client",
            id="pure-module-imports-io",
        ),
        pytest.param(
            "scoring",
            "from hamipy.extender import routes as _routes",
            "hamipy.extender.scoring is not allowed to import hamipy.extender.routes",
            id="decision-imports-a-layer-above",
        ),
    ],
)
def test_an_extender_module_importing_what_its_layer_may_not_fails_the_lint(
    tmp_path: Path, module: str, planted: str, refusal: str
) -> None:
    """A pure module importing I/O, and inside the service a module importing a layer above it."""
    overlay = overlay_with(tmp_path, "extender", ROOT / "services/extender/src/hamipy/extender", "")
    source = overlay / "hamipy" / "extender" / f"{module}.py"
    source.write_text(source.read_text() + f"\n{planted}  # planted\n")
    done = lint(overlay)
    assert done.returncode != 0
    assert refusal in done.stdout
