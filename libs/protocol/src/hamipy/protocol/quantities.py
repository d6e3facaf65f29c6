"""Kubernetes resource quantities, read exactly, as the whole numbers our resources are.

Every HAMi resource (vGPU count, MiB of memory, percent of memory or cores, priority) is a whole
number, but the API server hands them to us as quantity strings in any canonical form: ``"3"``,
``"3k"``, ``"2Ki"``, ``"1e3"``, ``"1500m"``. Upstream reads them with ``Quantity.AsInt64`` and quietly
drops a value that is not a whole number; here such a value is a ``ProtocolError`` that names the
container and the resource, so a pod asking for ``gpumem: 0.5`` gets told why instead of being
scheduled with no memory limit.

Grammar (``k8s.io/apimachinery/pkg/api/resource``)::

    quantity  ::= [+-] number [suffix]
    number    ::= digits | digits "." [digits] | "." digits
    suffix    ::= Ki | Mi | Gi | Ti | Pi | Ei           (powers of 1024)
                | n | u | m | k | M | G | T | P | E     (powers of 1000)
                | (e | E) [+-] digits                   (powers of 10)

Arithmetic is exact (``fractions.Fraction``): ``"0.1Ki"`` is 102.4 and refused, ``"1.5k"`` is 1500.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import Final, TypeGuard

from hamipy.protocol.errors import ProtocolError

__all__ = ["MAX_QUANTITY", "is_json_int", "parse_quantity", "quantity_field"]

# Upstream holds every one of these values in an int32; a larger one would wrap around in HAMi's
# scheduler, so it is refused here rather than read as something HAMi would read differently.
MAX_QUANTITY: Final = 2**31 - 1

# No real quantity is this long; the bound keeps hostile input from costing anything.
_MAX_TEXT: Final = 64
# Exponents beyond this cannot give an integer within MAX_QUANTITY from a <= 64-character number,
# and refusing them early avoids computing 10**999999999.
_MAX_EXPONENT: Final = 80

_BINARY: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL: Final = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

# The exponent alternative comes first so that "1E3" is 1000 while a bare "1E" is one exa.
_QUANTITY: Final = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?P<suffix>[eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?"
)


def quantity_field(resource: str, container: str | None = None) -> str:
    """The ``ProtocolError.field`` naming one resource of one container, e.g.
    ``containers[0] 'cuda' nvidia.com/gpumem`` (``container`` is the caller's label)."""
    if container is None:
        return resource
    return f"{container} {resource}"


def is_json_int(value: object) -> TypeGuard[int]:
    """``value`` (decoded JSON) is an integer: ``true`` is not, although Python's bool is an int."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_quantity(
    value: object,
    *,
    resource: str,
    container: str | None = None,
    maximum: int = MAX_QUANTITY,
) -> int:
    """Read a quantity that must be a whole number in ``0..maximum``.

    ``value`` is the JSON value from a container's ``resources.limits``/``requests`` (a string; a
    plain int is accepted too, a bool or float is not). Raises ``ProtocolError`` naming ``resource``
    and ``container`` when the text is not a quantity, is negative, is not a whole number, or is
    larger than ``maximum``.
    """
    field = quantity_field(resource, container)
    if is_json_int(value):
        number = value
    elif not isinstance(value, str):
        raise ProtocolError(field, value, "a quantity must be a string or an integer")
    # Fast path: the form the API server writes for small whole numbers.
    elif value.isascii() and value.isdigit() and len(value) <= _MAX_TEXT:
        number = int(value)
    else:
        number = _parse_text(value, field)
    if number < 0:
        raise ProtocolError(field, value, "must not be negative")
    if number > maximum:
        raise ProtocolError(field, value, f"is larger than {maximum}")
    return number


def _parse_text(text: str, field: str) -> int:
    if len(text) > _MAX_TEXT:
        raise ProtocolError(field, text, f"is longer than {_MAX_TEXT} characters")
    value = _exact(text)
    if isinstance(value, str):
        raise ProtocolError(field, text, value)
    return value


@functools.lru_cache(maxsize=256)
def _exact(text: str) -> int | str:
    """``text``'s whole number, or why it is none. Cached: the API server writes a quantity in its
    canonical form (``2000`` comes back as ``"2k"``), so every filter and bind of a pod reads the
    same few texts, and the exact arithmetic below costs far more than a lookup each time."""
    match = _QUANTITY.fullmatch(text)
    if match is None or not (match["int"] or match["frac"]):
        return "is not a Kubernetes quantity"
    digits = match["int"] + (match["frac"] or "")
    amount = Fraction(int(digits or "0"), 10 ** len(match["frac"] or ""))
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        amount *= 2 ** _BINARY[suffix]
    else:
        exponent = _DECIMAL[suffix] if suffix in _DECIMAL else int(suffix[1:])
        if abs(exponent) > _MAX_EXPONENT:
            return "has an absurd exponent"
        amount *= Fraction(10) ** exponent
    if match["sign"] == "-":
        amount = -amount
    if amount.denominator != 1:
        return "is not a whole number"
    return int(amount)
