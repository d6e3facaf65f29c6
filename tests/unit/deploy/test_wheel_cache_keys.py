"""Every workspace package tells uv which files its built wheel depends on (``[tool.uv]
cache-keys``). uv keys a wheel it built from a path dependency by ``pyproject.toml`` alone unless told
otherwise, so ``uv sync --no-editable`` (how the images install) from a checkout it has built
before installed a library as it was then: the extender's image environment failed with an
ImportError of a function added to ``hamipy.protocol``."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MEMBERS = sorted(
    p.parent for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")]
)


@pytest.mark.parametrize("member", MEMBERS, ids=[str(m.relative_to(ROOT)) for m in MEMBERS])
def test_every_file_the_wheel_is_built_from_is_a_cache_key(member: Path) -> None:
    keys = tomllib.loads((member / "pyproject.toml").read_text())["tool"]["uv"]["cache-keys"]
    patterns = [k["file"] for k in keys]
    assert "pyproject.toml" in patterns
    covered = {path for pattern in patterns for path in member.glob(pattern)}
    sources = {
        p
        for p in (member / "src").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != "py.typed"
    }
    assert sources, f"{member} has no sources"
    assert sorted(str(p.relative_to(member)) for p in sources - covered) == []
