"""The mutation operators: where a module can be changed in one small way, and the changed source.

Every mutant is one edit of the module's text: the span of one AST node is replaced by the source of
a changed copy of that node (in parentheses where it is an expression, so precedence cannot change),
and the rest of the file is kept byte for byte, so a mutant's diff is one line against the real
source. The operators are those that tell a decision apart from a neighbouring one:

====================  ==========================================================================
operator              change
====================  ==========================================================================
``compare-boundary``  ``<`` <-> ``<=``, ``>`` <-> ``>=`` (off by one)
``compare-negate``    ``<`` -> ``>=``, ``<=`` -> ``>``, ``==`` <-> ``!=``, ``is`` <-> ``is not``,
                      ``in`` <-> ``not in`` (and the reverse of the first two)
``number``            an integer constant ``n`` -> ``n + 1`` and ``n - 1``
``loop-jump``         ``continue`` <-> ``break``
``drop-not``          ``not x`` -> ``x``
``bool-op``           ``and`` <-> ``or``
``return-none``       ``return x`` -> ``return None``
``bool-constant``     ``True`` <-> ``False``
``arith``             ``+`` <-> ``-`` (also ``+=`` <-> ``-=``)
====================  ==========================================================================

Left alone: decorators (``dataclass(frozen=True, slots=True)`` is a property of the type, which
mypy checks, not a decision), annotations (except calls inside them, such as pydantic's ``Field(ge=0)``, which
validate), ``if TYPE_CHECKING:`` blocks, f-string internals (their node positions are not reliable
before Python 3.12), string concatenation (``"a" + b`` -> ``"a" - b`` only raises ``TypeError``),
and ``return None`` itself.
"""

from __future__ import annotations

import ast
import copy
import difflib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Mutant", "mutants_of"]


@dataclass(frozen=True)
class Mutant:
    """One mutant of a module: ``index`` is its place in the module's list (stable while the source
    is), ``line`` the 1-based line of the changed node, ``source`` the whole mutated module."""

    index: int
    line: int
    operator: str
    original: str
    replacement: str
    source: str

    def diff(self, original_source: str) -> str:
        """The changed lines as ``-``/``+`` lines (no context, no file header)."""
        lines = difflib.unified_diff(original_source.splitlines(), self.source.splitlines(), lineterm="", n=0)
        return "\n".join(line for line in lines if line[:1] in "+-" and line[:3] not in ("---", "+++"))


_BOUNDARY: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
}
_NEGATE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE,
    ast.LtE: ast.Gt,
    ast.Gt: ast.LtE,
    ast.GtE: ast.Lt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}


@dataclass(frozen=True)
class _Edit:
    node: ast.AST
    operator: str
    replacement: str


def _expr(node: ast.expr) -> str:
    return f"({ast.unparse(node)})"


def _is_text(node: ast.expr) -> bool:
    """A string (or bytes) literal, an f-string or a list/tuple display: ``+`` there concatenates."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str | bytes)
    return isinstance(node, ast.JoinedStr | ast.List | ast.Tuple | ast.ListComp)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Finder(ast.NodeVisitor):
    """Walks a module in source order and records every edit the operators allow."""

    def __init__(self) -> None:
        self.edits: list[_Edit] = []

    # -- what is skipped ----------------------------------------------------------------------------

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return

    def _visit_annotation(self, annotation: ast.expr | None) -> None:
        # Only calls inside an annotation act at run time (``Annotated[int, Field(ge=0)]``).
        if annotation is None:
            return
        if isinstance(annotation, ast.Call):
            self.visit(annotation)
            return
        for child in ast.iter_child_nodes(annotation):
            if isinstance(child, ast.expr):
                self._visit_annotation(child)

    def visit_arg(self, node: ast.arg) -> None:
        self._visit_annotation(node.annotation)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._visit_function(node)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.visit(node.args)
        self._visit_annotation(node.returns)
        for stmt in node.body:
            self.visit(stmt)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.bases, *node.keywords]:
            self.visit(expr)
        for stmt in node.body:
            self.visit(stmt)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._visit_annotation(node.annotation)
        if node.value is not None:
            self.visit(node.value)

    # -- the operators ------------------------------------------------------------------------------

    def visit_Compare(self, node: ast.Compare) -> None:
        for position, op in enumerate(node.ops):
            for name, table in (("compare-boundary", _BOUNDARY), ("compare-negate", _NEGATE)):
                new_op = table.get(type(op))
                if new_op is None:
                    continue
                changed = copy.deepcopy(node)
                changed.ops[position] = new_op()
                self.edits.append(_Edit(node, name, _expr(changed)))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, bool):
            self.edits.append(_Edit(node, "bool-constant", str(not node.value)))
        elif isinstance(node.value, int):
            for delta in (1, -1):
                self.edits.append(_Edit(node, "number", f"({node.value + delta})"))

    def visit_Continue(self, node: ast.Continue) -> None:
        self.edits.append(_Edit(node, "loop-jump", "break"))

    def visit_Break(self, node: ast.Break) -> None:
        self.edits.append(_Edit(node, "loop-jump", "continue"))

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self.edits.append(_Edit(node, "drop-not", _expr(node.operand)))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        changed = copy.deepcopy(node)
        changed.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.edits.append(_Edit(node, "bool-op", _expr(changed)))
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        value = node.value
        if value is not None and not (isinstance(value, ast.Constant) and value.value is None):
            self.edits.append(_Edit(node, "return-none", "return None"))
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, ast.Add | ast.Sub) and not (_is_text(node.left) or _is_text(node.right)):
            changed = copy.deepcopy(node)
            changed.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
            self.edits.append(_Edit(node, "arith", _expr(changed)))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.op, ast.Add | ast.Sub) and not _is_text(node.value):
            changed = copy.deepcopy(node)
            changed.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
            self.edits.append(_Edit(node, "arith", ast.unparse(changed)))
        self.generic_visit(node)


def _splice(source: str, node: ast.AST, replacement: str) -> tuple[str, str]:
    """Replace ``node``'s span (AST offsets count UTF-8 bytes) with ``replacement``; return the new
    source and the replaced text."""
    lines = source.encode().splitlines(keepends=True)
    lineno: int = node.lineno  # type: ignore[attr-defined]
    col_offset: int = node.col_offset  # type: ignore[attr-defined]
    end_lineno: int = node.end_lineno  # type: ignore[attr-defined]
    end_col_offset: int = node.end_col_offset  # type: ignore[attr-defined]
    start = sum(len(line) for line in lines[: lineno - 1]) + col_offset
    end = sum(len(line) for line in lines[: end_lineno - 1]) + end_col_offset
    data = source.encode()
    return (data[:start] + replacement.encode() + data[end:]).decode(), data[start:end].decode()


def mutants_of(source: str, *, filename: str = "<module>") -> Iterator[Mutant]:
    """Every mutant of ``source``, in source order; each one compiles (an edit that would not is a
    bug of the operators and raises ``SyntaxError``)."""
    finder = _Finder()
    finder.visit(ast.parse(source, filename=filename))
    edits = sorted(finder.edits, key=lambda e: (e.node.lineno, e.node.col_offset))  # type: ignore[attr-defined]
    for index, edit in enumerate(edits):
        mutated, original = _splice(source, edit.node, edit.replacement)
        compile(mutated, filename, "exec", dont_inherit=True)
        yield Mutant(
            index=index,
            line=edit.node.lineno,  # type: ignore[attr-defined]
            operator=edit.operator,
            original=original,
            replacement=edit.replacement,
            source=mutated,
        )
