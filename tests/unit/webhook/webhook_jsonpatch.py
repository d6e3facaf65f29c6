"""A minimal RFC 6902 applier (add/replace) for checking the webhook's patches in unit tests.

It is strict where the apiserver is: a missing parent, an array index out of range or a replace of
an absent member is an error, so a patch that works here works there.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

Doc = TypeVar("Doc")


def _tokens(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"pointer {path!r} does not start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def apply_patch(doc: Doc, ops: list[dict[str, Any]]) -> Doc:
    """``doc`` with ``ops`` applied (``doc`` itself is left as it is)."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _tokens(op["path"])
        target: Any = out
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        value = copy.deepcopy(op["value"])
        if op["op"] == "add":
            if isinstance(target, list):
                if last == "-":
                    target.append(value)
                else:
                    index = int(last)
                    if not 0 <= index <= len(target):
                        raise IndexError(op["path"])
                    target.insert(index, value)
            elif isinstance(target, dict):
                target[last] = value
            else:
                raise TypeError(f"cannot add into {type(target).__name__} at {op['path']}")
        elif op["op"] == "replace":
            if isinstance(target, list):
                target[int(last)] = value
            elif isinstance(target, dict):
                if last not in target:
                    raise KeyError(f"replace of absent member {op['path']}")
                target[last] = value
            else:
                raise TypeError(op["path"])
        else:
            raise ValueError(f"unexpected op {op['op']!r}")
    return out
