"""What a Dockerfile and its build context say, read as Docker reads them: the instructions, the
build arguments it declares, ``.dockerignore``, and the files its ``COPY`` lines take from the
context (the inputs an image built from it depends on)."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import stat
from collections.abc import Iterator
from pathlib import Path

from hamipy.devcluster.errors import ImageBuildError

__all__ = ["DockerIgnore", "context_digest", "context_files", "copy_sources", "declared_args", "instructions"]


def instructions(text: str) -> Iterator[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction, as Docker reads it
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            keyword, _, rest = whole.partition(" ")
            yield keyword.upper(), rest.strip()
    if pending.strip():
        keyword, _, rest = pending.strip().partition(" ")
        yield keyword.upper(), rest.strip()


def declared_args(text: str) -> frozenset[str]:
    """The names of the build arguments the Dockerfile declares (``ARG NAME[=default]``)."""
    declared = (args for keyword, args in instructions(text) if keyword == "ARG")
    return frozenset(args.split("=", 1)[0].strip() for args in declared)


def copy_sources(text: str) -> tuple[str, ...]:
    """The build-context paths the Dockerfile's ``COPY`` lines take, every stage's (a ``COPY
    --from`` takes from another stage, not from the context)."""
    sources: list[str] = []
    for keyword, args in instructions(text):
        if keyword == "ADD":
            raise ImageBuildError(f"ADD {args}: only COPY is read here")
        if keyword != "COPY":
            continue
        words = shlex.split(args)
        if any(word.startswith("--from") for word in words):
            continue
        paths = [word for word in words if not word.startswith("--")]
        if any(ch in source for source in paths[:-1] for ch in "*?["):
            raise ImageBuildError(f"COPY {args}: wildcards are not read here")
        sources += paths[:-1]
    return tuple(dict.fromkeys(sources))


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A ``.dockerignore`` pattern (Go ``filepath.Match`` plus ``**``) as a regex on a relative path."""
    out = ""
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "[":
            end = pattern.find("]", i)
            if end < 0:
                out += re.escape(ch)
            else:
                body = pattern[i + 1 : end]
                out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
                i = end
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + r"\Z")


class DockerIgnore:
    """``.dockerignore`` as Docker applies it: the last matching pattern wins, ``!`` re-includes, and
    a pattern matching a directory matches everything below it."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[re.Pattern[str], bool]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:].strip() if negate else line
            cleaned = os.path.normpath(line).lstrip("/")
            if cleaned in ("", "."):
                continue
            self.rules.append((_pattern_regex(cleaned), negate))

    @classmethod
    def of(cls, root: Path) -> DockerIgnore:
        """The build context `root`'s ``.dockerignore`` (none: nothing is ignored)."""
        path = root / ".dockerignore"
        return cls(path.read_text() if path.is_file() else "")

    @property
    def reincludes(self) -> bool:
        return any(negate for _, negate in self.rules)

    def excluded(self, relative: str) -> bool:
        parts = relative.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for regex, negate in self.rules:
            if any(regex.match(p) for p in prefixes):
                result = not negate
        return result


def context_files(sources: tuple[str, ...], root: Path) -> list[str]:
    """Every file and link (paths relative to `root`, sorted) that copying `sources` from the build
    context `root` takes, ``.dockerignore`` applied."""
    ignore = DockerIgnore.of(root)
    found: set[str] = set()
    for source in sources:
        top = Path(os.path.normpath(root / source))
        if not top.is_relative_to(root):
            raise ImageBuildError(f"COPY {source} leaves the build context {root}")
        if not top.exists():
            raise ImageBuildError(f"COPY {source}: no such file in {root}")
        if not top.is_dir():
            relative = top.relative_to(root).as_posix()
            if not ignore.excluded(relative):
                found.add(relative)
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            here = Path(dirpath)
            # An ignored directory is not walked unless a later `!` rule may take something back.
            dirnames[:] = [
                d
                for d in dirnames
                if ignore.reincludes or not ignore.excluded((here / d).relative_to(root).as_posix())
            ]
            for name in [*filenames, *(d for d in dirnames if (here / d).is_symlink())]:
                relative = (here / name).relative_to(root).as_posix()
                if not ignore.excluded(relative):
                    found.add(relative)
    return sorted(found)


def context_digest(sources: tuple[str, ...], root: Path) -> str:
    """A hash of what copying `sources` from `root` puts in an image: each file's path, executable
    bit and content, each link's target."""
    digest = hashlib.sha256()
    for relative in context_files(sources, root):
        path = root / relative
        info = path.lstat()
        digest.update(relative.encode() + b"\0")
        if stat.S_ISLNK(info.st_mode):
            digest.update(b"link\0" + os.readlink(path).encode())
        else:
            digest.update(b"x\0" if info.st_mode & stat.S_IXUSR else b"-\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        digest.update(b"\0")
    return digest.hexdigest()
