"""Run INSIDE an image environment (``<env>/bin/python -I image_env_imports.py DIST``): standard
library only, nothing of the checkout.

For every ``hamipy-*`` distribution installed in the environment it reads each module's imports
from the source (function-level imports too, which start-up never runs; not those under
``if TYPE_CHECKING:`` nor those guarded by ``except ImportError``) and finds the installed
distribution that provides each imported module, from the wheels' RECORD files. It prints JSON:

- ``unresolved``: imports no installed distribution (nor the standard library) provides, i.e. a
  ``ModuleNotFoundError`` waiting to happen in the image;
- ``undeclared``: imports of DIST (the service) served by a distribution DIST does not name in
  its own requirements: it is there only as somebody else's dependency;
- ``import_errors``: modules of the ``hamipy-*`` distributions that fail to import.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as metadata
import json
import re
import sys
import traceback
from pathlib import PurePosixPath
from typing import Any

_SOURCE_SUFFIXES = (".py", ".so", ".pyd")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def module_of(path: str) -> str | None:
    """The dotted module a RECORD path defines, if it is a module."""
    p = PurePosixPath(path)
    if not p.name.endswith(_SOURCE_SUFFIXES) or ".." in p.parts:
        return None
    if p.parts[0].endswith((".dist-info", ".data")):
        return None
    stem = p.name.split(".", 1)[0]
    parts = list(p.parts[:-1]) + ([] if stem == "__init__" else [stem])
    return ".".join(parts) if parts and all(part.isidentifier() for part in parts) else None


def providers() -> dict[str, set[str]]:
    """Module -> the distributions whose files define it."""
    out: dict[str, set[str]] = {}
    for dist in metadata.distributions():
        name = normalize(dist.metadata["Name"])
        for file in dist.files or []:
            module = module_of(str(file))
            if module is not None:
                out.setdefault(module, set()).add(name)
    return out


def requirement_names(dist: metadata.Distribution) -> set[str]:
    names = set()
    for req in dist.requires or []:
        marker = req.partition(";")[2]
        if re.search(r"\bextra\s*==", marker):
            continue
        found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if found:
            names.add(normalize(found.group(0)))
    return names


def _guarded(handlers: list[ast.ExceptHandler]) -> bool:
    for handler in handlers:
        names = ast.unparse(handler.type) if handler.type is not None else ""
        if "ImportError" in names or "ModuleNotFoundError" in names:
            return True
    return False


def imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """``(line, module, imported names)`` of every absolute import that always runs when reached."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        if isinstance(node, ast.Try) and _guarded(node.handlers):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def provider_of(module: str, names: list[str], table: dict[str, set[str]]) -> set[str] | None:
    """Who provides ``from module import names`` (or ``import module``); None if nobody does."""
    candidates = [f"{module}.{n}" for n in names if f"{module}.{n}" in table] or [module]
    result: set[str] = set()
    for candidate in candidates:
        parts = candidate.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in table:
                result |= table[prefix]
                break
        else:
            return None
    return result


def main(service: str) -> dict[str, Any]:
    table = providers()
    ours = [d for d in metadata.distributions() if normalize(d.metadata["Name"]).startswith("hamipy-")]
    report: dict[str, Any] = {"unresolved": [], "undeclared": [], "import_errors": [], "checked": {}}
    modules: list[str] = []
    for dist in ours:
        name = normalize(dist.metadata["Name"])
        declared = requirement_names(dist)
        count = 0
        for file in dist.files or []:
            if not str(file).endswith(".py"):
                continue
            module = module_of(str(file))
            if module is not None:
                modules.append(module)
            tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
            count += 1
            for line, imported, names in imports(tree):
                top = imported.split(".")[0]
                if top in sys.stdlib_module_names or top == "__future__":
                    continue
                where = f"{file}:{line} {imported}"
                found = provider_of(imported, names, table)
                if found is None:
                    report["unresolved"].append(f"{where} (in {name})")
                elif name == normalize(service) and name not in found and not found & declared:
                    report["undeclared"].append(f"{where} -> {' or '.join(sorted(found))}")
        report["checked"][name] = count
    for module in sorted(set(modules)):
        try:
            importlib.import_module(module)
        except BaseException as exc:  # every failure is reported, none raised
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            report["import_errors"].append(f"{module}: {last}")
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=2))
