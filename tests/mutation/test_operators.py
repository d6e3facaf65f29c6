"""The mutation operators of ``make mutate`` (tests/mutation/operators.py): each makes the one change
it names, leaves the rest of the file alone, and every mutant of the measured modules compiles."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from operators import Mutant, mutants_of

TARGETS = Path(__file__).resolve().parent / "targets.toml"

CASES = {
    "lt-boundary": ("x = a < b\n", "compare-boundary", "x = (a <= b)\n"),
    "lt-negate": ("x = a < b\n", "compare-negate", "x = (a >= b)\n"),
    "ge-boundary": ("x = a >= b\n", "compare-boundary", "x = (a > b)\n"),
    "eq-negate": ("x = a == b\n", "compare-negate", "x = (a != b)\n"),
    "is-negate": ("x = a is None\n", "compare-negate", "x = (a is not None)\n"),
    "in-negate": ("x = a in b\n", "compare-negate", "x = (a not in b)\n"),
    "not-in-negate": ("x = a not in b\n", "compare-negate", "x = (a in b)\n"),
    "bool-op": ("x = a and b\n", "bool-op", "x = (a or b)\n"),
    "drop-not": ("x = not a\n", "drop-not", "x = (a)\n"),
    "true": ("x = True\n", "bool-constant", "x = False\n"),
    "return-none": ("def f():\n    return 1 + a\n", "return-none", "def f():\n    return None\n"),
    "continue": ("for a in b:\n    continue\n", "loop-jump", "for a in b:\n    break\n"),
    "break": ("for a in b:\n    break\n", "loop-jump", "for a in b:\n    continue\n"),
    "plus": ("x = a + b\n", "arith", "x = (a - b)\n"),
    "minus-assign": ("x -= a\n", "arith", "x += a\n"),
}


def _only(source: str, operator: str) -> list[Mutant]:
    return [m for m in mutants_of(source) if m.operator == operator]


@pytest.mark.parametrize(("source", "operator", "expected"), CASES.values(), ids=CASES.keys())
def test_operator_makes_its_one_change(source: str, operator: str, expected: str) -> None:
    assert [m.source for m in _only(source, operator)] == [expected]


def test_integer_goes_one_up_and_one_down() -> None:
    assert [m.source for m in mutants_of("x = 5\n")] == ["x = (6)\n", "x = (4)\n"]


def test_replacement_keeps_precedence() -> None:
    # Without the parentheses "not (a or b)" -> "a or b" would change what surrounds it.
    (dropped,) = _only("x = c and not (a or b)\n", "drop-not")
    assert dropped.source == "x = c and (a or b)\n"


def test_chained_comparison_mutates_each_operator() -> None:
    sources = [m.source for m in _only("x = 0 <= a < n\n", "compare-boundary")]
    assert sources == ["x = (0 < a < n)\n", "x = (0 <= a <= n)\n"]


def test_rest_of_file_is_kept_byte_for_byte() -> None:
    source = '"""Doc."""\n\n# a comment\ndef f(a):  # trailing\n    return a  # é\n'
    (mutant,) = mutants_of(source)
    assert mutant.source == '"""Doc."""\n\n# a comment\ndef f(a):  # trailing\n    return None  # é\n'
    assert mutant.line == 5
    assert mutant.diff(source) == "-    return a  # é\n+    return None  # é"


def test_offsets_count_utf8_bytes() -> None:
    (mutant,) = _only('x = ("é" == a)\n', "compare-negate")
    assert mutant.source == "x = (('é' != a))\n"


LEFT_ALONE = {
    "annotation": "def f(a: Literal[1]) -> Literal[True]:\n    pass\n",
    "variable-annotation": "x: Literal[1]\n",
    "decorator": "@dataclass(frozen=True)\nclass A:\n    pass\n",
    "type-checking": "if TYPE_CHECKING:\n    X = 1\n",
    "f-string": "x = f'{a + 1}'\n",
    "string-concatenation": "x = 'a' + b\n",
    "return-none": "def f():\n    return None\n",
    "docstring": '"""1 < 2"""\n',
}


@pytest.mark.parametrize("source", LEFT_ALONE.values(), ids=LEFT_ALONE.keys())
def test_what_is_not_a_decision_is_left_alone(source: str) -> None:
    assert list(mutants_of(source)) == []


def test_calls_in_annotations_are_mutated() -> None:
    # pydantic validates Field(ge=0) at run time.
    sources = [m.source for m in mutants_of("x: Annotated[int, Strict(), Field(ge=0)] = 1\n")]
    assert "x: Annotated[int, Strict(), Field(ge=(1))] = 1\n" in sources


def test_indices_follow_the_source() -> None:
    mutants = list(mutants_of("a = 1\nb = c < d\n"))
    assert [m.index for m in mutants] == list(range(len(mutants)))
    assert [m.line for m in mutants] == sorted(m.line for m in mutants)


def _target_modules() -> list[str]:
    with TARGETS.open("rb") as file:
        return list(tomllib.load(file)["modules"])


@pytest.mark.parametrize("module", _target_modules())
def test_every_mutant_of_a_measured_module_compiles(module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert spec.origin is not None
    source = Path(spec.origin).read_text()
    # mutants_of compiles each mutant and raises SyntaxError where an operator broke the code.
    for mutant in mutants_of(source, filename=spec.origin):
        assert mutant.source != source
