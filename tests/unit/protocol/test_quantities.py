"""Kubernetes quantities read exactly as whole numbers (hamipy.protocol.quantities)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import quantities
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.quantities import MAX_QUANTITY, parse_quantity, quantity_field

RESOURCE = "nvidia.com/gpumem"
CONTAINER = "containers[0] 'cuda'"

EXACT = [
    ("0", 0),
    ("1", 1),
    ("3000", 3000),
    ("+7", 7),
    ("-0", 0),
    ("007", 7),
    ("5.", 5),
    ("1.0", 1),
    ("1.5k", 1500),
    ("2k", 2000),
    ("1M", 1_000_000),
    ("1G", 1_000_000_000),
    ("2Ki", 2048),
    ("1Mi", 1_048_576),
    ("1Gi", 1_073_741_824),
    ("0.5Ki", 512),
    (".5Ki", 512),
    ("1e3", 1000),
    ("1E3", 1000),
    ("1e+3", 1000),
    ("20e-1", 2),
    ("2000m", 2),
    ("1000000u", 1),
    ("1000000000n", 1),
    ("0m", 0),
    ("0.000e5", 0),
    # Every suffix at a value that fits: the big ones through exact binary or decimal fractions.
    ("0.00000095367431640625Ti", 1 << 20),
    ("0.000000000931322574615478515625Pi", 1 << 20),
    ("0.0000000000009094947017729282379150390625Ei", 1 << 20),
    ("0.000000001T", 1000),
    ("0.000000000001P", 1000),
    ("0.000000000000001E", 1000),
    ("0e80", 0),
    ("0" * 59 + "1.00k", 1000),  # 64 characters: the longest text read
]

NOT_WHOLE = ["0.5", "500m", "1500m", "1.5", "12e-1", "1500e-3", "0.1Ki", "1u", "1n", "1e-1"]
NEGATIVE = ["-1", "-1k", "-2Ki", "-1e3"]
GARBAGE = [
    "",
    " ",
    "abc",
    "1 ",
    " 1",
    "1.2.3",
    "1KiB",
    "1ki",
    "1e",
    "e3",
    ".",
    "+",
    "1x",
    "--1",
    "0x10",
    "1,000",
    "١٢",
]
TOO_BIG = ["2147483648", "3Gi", "1T", "1E", "1e10", "9" * 60]
NOT_A_QUANTITY_TYPE = [1.5, 1.0, True, None, [1], {"a": 1}]


@pytest.mark.parametrize(("text", "expected"), EXACT, ids=[t for t, _ in EXACT])
def test_canonical_forms_parse_exactly(text: str, expected: int) -> None:
    assert parse_quantity(text, resource=RESOURCE, container=CONTAINER) == expected


def test_plain_int_is_accepted() -> None:
    assert parse_quantity(3000, resource=RESOURCE) == 3000


def test_max_is_int32() -> None:
    assert MAX_QUANTITY == 2**31 - 1
    assert parse_quantity(str(MAX_QUANTITY), resource=RESOURCE) == MAX_QUANTITY


def test_maximum_can_be_lowered() -> None:
    assert parse_quantity("100", resource=RESOURCE, maximum=100) == 100
    with pytest.raises(ProtocolError, match="larger than 100"):
        parse_quantity("101", resource=RESOURCE, maximum=100)


@pytest.mark.parametrize("text", NOT_WHOLE)
def test_fractions_are_refused(text: str) -> None:
    with pytest.raises(ProtocolError, match="not a whole number") as info:
        parse_quantity(text, resource=RESOURCE, container=CONTAINER)
    assert info.value.field == f"{CONTAINER} {RESOURCE}"
    assert info.value.value == text


@pytest.mark.parametrize("text", NEGATIVE)
def test_negatives_are_refused(text: str) -> None:
    with pytest.raises(ProtocolError, match="negative"):
        parse_quantity(text, resource=RESOURCE, container=CONTAINER)


def test_negative_int_is_refused() -> None:
    with pytest.raises(ProtocolError, match="negative"):
        parse_quantity(-1, resource=RESOURCE)


@pytest.mark.parametrize("text", GARBAGE, ids=repr)
def test_garbage_is_refused(text: str) -> None:
    with pytest.raises(ProtocolError, match="not a Kubernetes quantity") as info:
        parse_quantity(text, resource=RESOURCE, container=CONTAINER)
    assert CONTAINER in str(info.value)
    assert RESOURCE in str(info.value)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", TOO_BIG)
def test_absurd_sizes_are_refused(text: str) -> None:
    with pytest.raises(ProtocolError, match="larger than"):
        parse_quantity(text, resource=RESOURCE)


@pytest.mark.parametrize("text", ["1e81", "1e-81", "1e999999999"])
def test_absurd_exponents_are_refused_without_computing_them(text: str) -> None:
    with pytest.raises(ProtocolError, match="absurd exponent"):
        parse_quantity(text, resource=RESOURCE)


def test_overlong_text_is_refused() -> None:
    with pytest.raises(ProtocolError, match="longer than 64"):
        parse_quantity("1" * 65 + "m", resource=RESOURCE)
    with pytest.raises(ProtocolError, match="longer than 64"):
        parse_quantity("0" * 60 + "1.00k", resource=RESOURCE)
    with pytest.raises(ProtocolError, match="longer than 64"):
        parse_quantity("0" * 65, resource=RESOURCE)


def test_exponent_80_is_read_81_is_not() -> None:
    with pytest.raises(ProtocolError, match="larger than"):
        parse_quantity("1e80", resource=RESOURCE)
    with pytest.raises(ProtocolError, match="absurd exponent"):
        parse_quantity("0e81", resource=RESOURCE)
    with pytest.raises(ProtocolError, match="not a whole number"):
        parse_quantity("1e-80", resource=RESOURCE)


@pytest.mark.parametrize("value", NOT_A_QUANTITY_TYPE, ids=repr)
def test_other_json_types_are_refused(value: object) -> None:
    with pytest.raises(ProtocolError, match="string or an integer"):
        parse_quantity(value, resource=RESOURCE)


def test_error_is_a_value_error_naming_container_and_resource() -> None:
    with pytest.raises(ValueError, match=r"containers\[0\] 'cuda' nvidia.com/gpumem: is not a whole number"):
        parse_quantity("0.5", resource=RESOURCE, container=CONTAINER)


def test_a_text_read_again_gives_the_same_answer_with_its_own_field() -> None:
    # The arithmetic is cached per text (the API server's canonical "2k" comes with every filter and
    # bind); the answer, and an error's field, stay those of each call.
    for _ in range(2):
        assert parse_quantity("2k", resource=RESOURCE) == 2000
        for resource in (RESOURCE, "nvidia.com/gpucores"):
            with pytest.raises(ProtocolError) as caught:
                parse_quantity("0.5", resource=resource, container=CONTAINER)
            assert caught.value.field == f"{CONTAINER} {resource}"
    with pytest.raises(ProtocolError, match="larger than 1999"):
        parse_quantity("2k", resource=RESOURCE, maximum=1999)  # the bound is each call's own


def test_field_without_container_is_the_resource() -> None:
    assert quantity_field(RESOURCE) == RESOURCE
    assert quantity_field(RESOURCE, "container") == f"container {RESOURCE}"


@given(st.integers(min_value=0, max_value=MAX_QUANTITY))
def test_formatted_ints_parse_back(n: int) -> None:
    assert parse_quantity(str(n), resource=RESOURCE) == n
    assert parse_quantity(f"{n}000m", resource=RESOURCE) == n
    assert parse_quantity(f"{n}.0", resource=RESOURCE) == n
    assert parse_quantity(f"{n}e0", resource=RESOURCE) == n


@given(st.integers(min_value=0, max_value=MAX_QUANTITY // 1024))
def test_binary_suffix_multiplies_by_1024(n: int) -> None:
    assert parse_quantity(f"{n}Ki", resource=RESOURCE) == n * 1024


@given(st.integers(min_value=0, max_value=MAX_QUANTITY // 1000), st.integers(min_value=1, max_value=999))
def test_millis_not_multiple_of_1000_are_refused(n: int, rest: int) -> None:
    with pytest.raises(ProtocolError):
        parse_quantity(f"{n * 1000 + rest}m", resource=RESOURCE)


def test_public_api_is_complete() -> None:
    assert sorted(quantities.__all__) == ["MAX_QUANTITY", "is_json_int", "parse_quantity", "quantity_field"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, True),
        (-3, True),
        (2**70, True),
        (True, False),
        (False, False),
        (1.0, False),
        ("1", False),
        (None, False),
    ],
)
def test_a_json_integer_is_an_int_and_never_a_bool(value: object, expected: bool) -> None:
    assert quantities.is_json_int(value) is expected
