"""``hami.io/mutex.lock`` values (docs/wire-format.md#node-lock; upstream ``pkg/util/nodelock``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import node_lock
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_lock import (
    NODE_LOCK_TIMEOUT,
    NodeLock,
    format_node_lock,
    lock_expired,
    owned_by,
    parse_node_lock,
)

KEY = "hami.io/mutex.lock"
TAKEN = datetime(2025, 6, 18, 9, 6, 27, tzinfo=UTC)
# The example of docs/wire-format.md#node-lock.
WIRE_EXAMPLE = "2025-06-18T09:06:27Z,default,ubuntu-684fc95568-2jh7s"
WIRE_LOCK = NodeLock(TAKEN, "default", "ubuntu-684fc95568-2jh7s")
SHANGHAI = timezone(timedelta(hours=8))


def test_public_api_is_complete() -> None:
    assert set(node_lock.__all__) == {
        "NODE_LOCK_TIMEOUT",
        "NodeLock",
        "format_node_lock",
        "lock_expired",
        "owned_by",
        "parse_node_lock",
    }


# -- parsing ------------------------------------------------------------------------------------------


def test_wire_example_parses() -> None:
    assert parse_node_lock(WIRE_EXAMPLE) == WIRE_LOCK


def test_legacy_timestamp_only_has_no_owner() -> None:
    assert parse_node_lock("2025-06-18T09:06:27Z") == NodeLock(TAKEN)


def test_local_offset_as_go_writes_it() -> None:
    lock = parse_node_lock("2025-06-18T17:06:27+08:00,gpu,train-0")
    assert lock.time == TAKEN
    assert lock.time.utcoffset() == timedelta(hours=8)


def test_fraction_is_accepted_as_go_parse_does() -> None:
    assert parse_node_lock("2025-06-18T09:06:27.123456789Z").time == TAKEN.replace(microsecond=123456)


# -- formatting ---------------------------------------------------------------------------------------


def test_wire_example_formats() -> None:
    assert format_node_lock(WIRE_LOCK) == WIRE_EXAMPLE


def test_legacy_formats_time_only() -> None:
    assert format_node_lock(NodeLock(TAKEN)) == "2025-06-18T09:06:27Z"


@pytest.mark.parametrize(
    ("tz", "expected"),
    [(SHANGHAI, "2025-06-18T17:06:27+08:00"), (timezone(timedelta(hours=-3, minutes=-30)),
     "2025-06-18T05:36:27-03:30")],
    ids=["east", "west-half-hour"],
)  # fmt: skip
def test_offset_formats_like_go_rfc3339(tz: timezone, expected: str) -> None:
    assert format_node_lock(NodeLock(TAKEN.astimezone(tz))) == expected


# Go's zone := offset / 60 truncates toward zero and takes the sign after: seconds of an offset are
# dropped, and an offset of less than a minute is "+00:00" whichever its sign.
SUB_MINUTE_OFFSETS = {
    "plus-30s": (timedelta(seconds=30), "+00:00"),
    "minus-30s": (timedelta(seconds=-30), "+00:00"),
    "minus-one-minute": (timedelta(minutes=-1), "-00:01"),
    "dublin-mean-time": (-timedelta(minutes=25, seconds=21), "-00:25"),
    "india-with-seconds": (timedelta(hours=5, minutes=30, seconds=59), "+05:30"),
}


@pytest.mark.parametrize(("offset", "expected"), SUB_MINUTE_OFFSETS.values(), ids=SUB_MINUTE_OFFSETS.keys())
def test_offset_seconds_are_truncated_as_go_does(offset: timedelta, expected: str) -> None:
    stamp = format_node_lock(NodeLock(TAKEN.astimezone(timezone(offset))))
    assert stamp.endswith(expected)
    assert stamp[:19] == TAKEN.astimezone(timezone(offset)).strftime("%Y-%m-%dT%H:%M:%S")


def test_format_drops_sub_seconds() -> None:
    assert format_node_lock(NodeLock(TAKEN.replace(microsecond=5))) == "2025-06-18T09:06:27Z"


def test_format_refuses_naive_time() -> None:
    with pytest.raises(ProtocolError, match="timezone-aware"):
        format_node_lock(NodeLock(datetime(2025, 6, 18, 9, 6, 27)))


@pytest.mark.parametrize(("namespace", "name"), [("", "p"), ("ns", ""), ("a,b", "p"), ("ns", "p q")],
                         ids=["empty-namespace", "empty-name", "comma", "blank"])  # fmt: skip
def test_format_refuses_unreadable_owner(namespace: str, name: str) -> None:
    with pytest.raises(ProtocolError):
        format_node_lock(NodeLock(TAKEN, namespace, name))


@pytest.mark.parametrize("offset", ["+23:59", "-23:59", "+05:59"])
def test_largest_offsets_parse(offset: str) -> None:
    hours, minutes = int(offset[1:3]), int(offset[4:])
    expected = timedelta(hours=hours, minutes=minutes) * (-1 if offset[0] == "-" else 1)
    assert parse_node_lock(f"2025-06-18T09:06:27{offset}").time.utcoffset() == expected


def test_longest_value_is_512_characters() -> None:
    head = "2025-06-18T09:06:27Z,default,"
    longest = head + "p" * (512 - len(head))
    assert parse_node_lock(longest).name == longest[len(head) :]
    with pytest.raises(ProtocolError, match="longer than 512 characters"):
        parse_node_lock(longest + "p")


def test_owner_needs_both_parts() -> None:
    with pytest.raises(ValueError, match="both namespace and name"):
        NodeLock(TAKEN, "default", None)


_names = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
_times = st.datetimes(
    min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30),
    timezones=st.sampled_from([UTC, SHANGHAI, timezone(timedelta(hours=-9, minutes=-30))]),
).map(lambda t: t.replace(microsecond=0))  # fmt: skip


@given(_times, st.one_of(st.none(), st.tuples(_names, _names)))
def test_parse_inverts_format(when: datetime, owner: tuple[str, str] | None) -> None:
    lock = NodeLock(when, *owner) if owner else NodeLock(when)
    parsed = parse_node_lock(format_node_lock(lock))
    assert parsed == lock
    assert parsed.time.utcoffset() == when.utcoffset()


# -- expiry and ownership -----------------------------------------------------------------------------

EXPIRY = {
    "fresh": (TAKEN + timedelta(minutes=1), False),
    "exactly-five-minutes": (TAKEN + NODE_LOCK_TIMEOUT, False),
    "just-past-five-minutes": (TAKEN + NODE_LOCK_TIMEOUT + timedelta(microseconds=1), True),
    "an-hour": (TAKEN + timedelta(hours=1), True),
    "clock-behind": (TAKEN - timedelta(minutes=10), False),
}


@pytest.mark.parametrize(("now", "expired"), EXPIRY.values(), ids=EXPIRY.keys())
def test_lock_expires_strictly_after_five_minutes(now: datetime, expired: bool) -> None:
    assert lock_expired(WIRE_LOCK, now=now) is expired


def test_expiry_compares_instants_across_offsets() -> None:
    lock = parse_node_lock("2025-06-18T17:06:27+08:00,ns,p")
    assert not lock_expired(lock, now=TAKEN + timedelta(minutes=4))
    assert lock_expired(lock, now=TAKEN + timedelta(minutes=6))


def test_timeout_is_upstreams_five_minutes() -> None:
    assert not lock_expired(WIRE_LOCK, now=TAKEN + timedelta(minutes=5))
    assert lock_expired(WIRE_LOCK, now=TAKEN + timedelta(minutes=5, microseconds=1))


def test_expiry_timeout_is_configurable() -> None:
    assert lock_expired(WIRE_LOCK, now=TAKEN + timedelta(seconds=31), timeout=timedelta(seconds=30))


def test_owned_by_compares_namespace_and_name() -> None:
    assert owned_by(WIRE_LOCK, namespace="default", name="ubuntu-684fc95568-2jh7s")
    assert not owned_by(WIRE_LOCK, namespace="other", name="ubuntu-684fc95568-2jh7s")
    assert not owned_by(WIRE_LOCK, namespace="default", name="ubuntu")
    assert not owned_by(NodeLock(TAKEN), namespace="default", name="ubuntu-684fc95568-2jh7s")


# -- malformed input ----------------------------------------------------------------------------------

BAD = {
    "empty": ("", ".time"),
    "two-parts": ("2025-06-18T09:06:27Z,default", ""),
    "four-parts": ("2025-06-18T09:06:27Z,default,pod,extra", ""),
    "empty-namespace": ("2025-06-18T09:06:27Z,,pod", ".namespace"),
    "empty-name": ("2025-06-18T09:06:27Z,default,", ".name"),
    "blank-in-name": ("2025-06-18T09:06:27Z,default,my pod", ".name"),
    "not-a-time": ("yesterday,default,pod", ".time"),
    "no-zone": ("2025-06-18T09:06:27,default,pod", ".time"),
    "space-separator": ("2025-06-18 09:06:27Z,default,pod", ".time"),
    "lowercase-t": ("2025-06-18t09:06:27Z", ".time"),
    "offset-without-colon": ("2025-06-18T09:06:27+0800", ".time"),
    "date-only": ("2025-06-18", ".time"),
    "impossible-date": ("2025-02-30T09:06:27Z", ".time"),
    "hour-24": ("2025-06-18T24:00:00Z", ".time"),
    "offset-out-of-range": ("2025-06-18T09:06:27+24:00", ".time"),
    "offset-minute-60": ("2025-06-18T09:06:27+05:60", ".time"),
    "unix-seconds": ("1750237587", ".time"),
    "huge": ("2025-06-18T09:06:27Z,default," + "p" * 10_000, ""),
}


@pytest.mark.parametrize(("value", "field"), BAD.values(), ids=BAD.keys())
def test_malformed_lock_is_refused_naming_the_field(value: str, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_node_lock(value)
    assert info.value.field == KEY + field
