"""``ProtocolError``: names the field, the reason and the value, the value cut short when long
(hamipy.protocol.errors)."""

from __future__ import annotations

import pytest

from hamipy.protocol import errors
from hamipy.protocol.errors import ProtocolError

FIELD = "hami.io/node-nvidia-register[2].devmem"


def test_message_names_field_reason_and_value() -> None:
    error = ProtocolError(FIELD, -1, "must not be negative")
    assert str(error) == f"{FIELD}: must not be negative (got -1)"
    assert (error.field, error.value, error.reason) == (FIELD, -1, "must not be negative")


def test_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


# repr() of a str adds two quotes: a 198-character string shows as 200 characters.
SHOWN = {
    "200-chars-whole": (198, "'" + "x" * 198 + "'"),
    "201-chars-cut": (199, "'" + "x" * 199 + "... (201 chars)"),
}


@pytest.mark.parametrize(("length", "shown"), SHOWN.values(), ids=SHOWN.keys())
def test_value_is_shown_up_to_200_characters(length: int, shown: str) -> None:
    error = ProtocolError(FIELD, "x" * length, "too long")
    assert str(error) == f"{FIELD}: too long (got {shown})"
    assert error.value == "x" * length  # the attribute keeps the whole value


def test_public_api_is_complete() -> None:
    assert errors.__all__ == ["ProtocolError"]
