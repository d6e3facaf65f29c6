"""``hami.io/node-handshake`` stamps and the upstream liveness rule (docs/wire-format.md#handshake)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone, tzinfo
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import keys, node_handshake
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_handshake import (
    LAYOUT_DASH,
    LAYOUT_DOT,
    Handshake,
    HandshakeKind,
    Layout,
    format_handshake,
    needs_request,
    node_is_dead,
    parse_handshake,
    plugin_report,
    reported_by_us,
    requesting,
)

KEY = "hami.io/node-handshake"
STAMP = datetime(2025, 6, 18, 9, 6, 27, tzinfo=UTC)
SHANGHAI = timezone(timedelta(hours=8))


def test_public_api_is_complete() -> None:
    assert set(node_handshake.__all__) == {
        "HANDSHAKE_TIMEOUT",
        "LAYOUT_DASH",
        "LAYOUT_DOT",
        "Handshake",
        "HandshakeKind",
        "Layout",
        "format_handshake",
        "needs_request",
        "node_is_dead",
        "parse_handshake",
        "plugin_report",
        "reported_by_us",
        "requesting",
    }


# -- parsing every form seen upstream -----------------------------------------------------------------

FORMS = {
    "requesting-dash": ("Requesting_2025-06-18 09:06:27", Handshake("Requesting", STAMP)),
    "requesting-dot": ("Requesting_2025.06.18 09:06:27", Handshake("Requesting", STAMP)),
    "deleted-dash": ("Deleted_2025-06-18 09:06:27", Handshake("Deleted", STAMP)),
    "deleted-dot": ("Deleted_2025.06.18 09:06:27", Handshake("Deleted", STAMP)),
    "reported-underscore-dot": ("Reported_2025.06.18 09:06:27", Handshake("Reported", STAMP)),
    "reported-space-dash": ("Reported 2025-06-18 09:06:27", Handshake("Reported", STAMP)),
    # The NVIDIA plugin's "Reported " + time.Now().String(): fraction, offset, zone, monotonic clock.
    "reported-go-time-string": (
        "Reported 2025-06-18 17:06:27.123456789 +0800 CST m=+12.345678901",
        Handshake("Reported", datetime(2025, 6, 18, 9, 6, 27, 123456, tzinfo=UTC)),
    ),
    "reported-go-time-string-utc": (
        "Reported 2025-06-18 09:06:27 +0000 UTC",
        Handshake("Reported", STAMP),
    ),
    "reported-go-time-string-largest-offset": (
        "Reported 2025-06-19 09:05:27 +2359 X",
        Handshake("Reported", STAMP),
    ),
    "reported-go-time-string-west": (
        "Reported 2025-06-17 23:06:27 -1000 HST",
        Handshake("Reported", STAMP),
    ),
}


@pytest.mark.parametrize(("value", "expected"), FORMS.values(), ids=FORMS.keys())
def test_upstream_forms_parse(value: str, expected: Handshake) -> None:
    assert parse_handshake(value) == expected


def test_times_without_offset_are_read_in_the_given_zone() -> None:
    parsed = parse_handshake("Requesting_2025-06-18 17:06:27", tz=SHANGHAI)
    assert parsed.time == STAMP
    assert parsed.time.utcoffset() == timedelta(hours=8)


def test_default_zone_is_utc() -> None:
    assert parse_handshake("Requesting_2025-06-18 09:06:27").time.tzinfo is UTC


def test_dst_zone_is_accepted() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    assert parse_handshake("Requesting_2025-06-18 11:06:27", tz=berlin).time == STAMP


# -- formatting ---------------------------------------------------------------------------------------


def test_requesting_is_what_current_upstream_writes() -> None:
    assert requesting(STAMP) == "Requesting_2025-06-18 09:06:27"


def test_requesting_in_local_zone_of_the_cluster() -> None:
    assert requesting(STAMP, tz=SHANGHAI) == "Requesting_2025-06-18 17:06:27"


def test_format_drops_sub_seconds() -> None:
    assert requesting(STAMP.replace(microsecond=999_999)) == "Requesting_2025-06-18 09:06:27"


@pytest.mark.parametrize(
    ("kind", "layout", "expected"),
    [("Deleted", LAYOUT_DOT, "Deleted_2025.06.18 09:06:27"),
     ("Reported", LAYOUT_DASH, "Reported_2025-06-18 09:06:27"),
     ("Requesting", LAYOUT_DOT, "Requesting_2025.06.18 09:06:27")],
    ids=["deleted-dot", "reported-dash", "requesting-dot"],
)  # fmt: skip
def test_format_each_kind_and_layout(kind: HandshakeKind, layout: Layout, expected: str) -> None:
    assert format_handshake(Handshake(kind, STAMP), layout=layout) == expected


class _NoOffset(tzinfo):
    """A zone that knows no offset: Python counts its times as naive."""

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str | None:
        return None


@pytest.mark.parametrize("zone", [None, _NoOffset()], ids=["no-tzinfo", "tzinfo-without-offset"])
def test_format_refuses_naive_time(zone: tzinfo | None) -> None:
    with pytest.raises(ProtocolError, match="timezone-aware"):
        format_handshake(Handshake("Requesting", datetime(2025, 6, 18, 9, 6, 27, tzinfo=zone)))


_times = st.datetimes(
    min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)
).map(lambda t: t.replace(microsecond=0))


@given(
    st.sampled_from(["Requesting", "Reported", "Deleted"]),
    _times,
    st.sampled_from([LAYOUT_DASH, LAYOUT_DOT]),
    st.sampled_from([UTC, SHANGHAI, timezone(timedelta(hours=-5))]),
)
def test_parse_inverts_format(kind: HandshakeKind, when: datetime, layout: Layout, tz: timezone) -> None:
    handshake = Handshake(kind, when)
    assert parse_handshake(format_handshake(handshake, tz=tz, layout=layout), tz=tz) == handshake


# -- the liveness rule --------------------------------------------------------------------------------

REQUESTED = Handshake("Requesting", STAMP)
LIVENESS = {
    "fresh-request": (REQUESTED, 0, STAMP + timedelta(seconds=59), False),
    "request-exactly-60s-old": (REQUESTED, 0, STAMP + timedelta(seconds=60), True),
    "stale-request-no-gpus": (REQUESTED, 0, STAMP + timedelta(minutes=10), True),
    "stale-request-gpus-still-allocatable": (REQUESTED, 8, STAMP + timedelta(minutes=10), False),
    "stale-request-one-gpu-allocatable": (REQUESTED, 1, STAMP + timedelta(minutes=10), False),
    "reported": (Handshake("Reported", STAMP), 0, STAMP + timedelta(hours=1), False),
    "deleted": (Handshake("Deleted", STAMP), 0, STAMP + timedelta(hours=1), False),
    "no-annotation": (None, 0, STAMP + timedelta(hours=1), False),
}


@pytest.mark.parametrize(("handshake", "gpus", "now", "dead"), LIVENESS.values(), ids=LIVENESS.keys())
def test_node_is_dead_follows_upstream(
    handshake: Handshake | None, gpus: int, now: datetime, dead: bool
) -> None:
    assert node_is_dead(handshake, allocatable_gpus=gpus, now=now) is dead


def test_timeout_is_configurable() -> None:
    now = STAMP + timedelta(seconds=30)
    assert node_is_dead(REQUESTED, allocatable_gpus=0, now=now, timeout=timedelta(seconds=30))


@pytest.mark.parametrize(
    ("handshake", "expected"),
    [(None, True), (Handshake("Reported", STAMP), True), (Handshake("Deleted", STAMP), True),
     (REQUESTED, False)],
    ids=["absent", "reported", "deleted", "requesting"],
)  # fmt: skip
def test_scheduler_stamps_a_request_unless_one_is_pending(
    handshake: Handshake | None, expected: bool
) -> None:
    assert needs_request(handshake) is expected


# -- malformed input ----------------------------------------------------------------------------------

BAD = [
    "",
    "Requesting",
    "Requesting_",
    "Requesting_2025-06-18",
    "Requesting_2025-06-18 09:06",
    "Requesting 2025-06-18 09:06:27",
    "Requesting_2025-06-18T09:06:27",
    "Requesting_2025-06.18 09:06:27",
    "Requesting_2025-13-18 09:06:27",
    "Requesting_2025-02-30 09:06:27",
    "Requesting_2025-06-18 24:00:00",
    "Requesting_2025-06-18 09:06:27.5",
    "Requesting_2025-06-18 09:06:27 +0000 UTC",
    "Requesting_2025-06-18 09:06:27 ",
    "requesting_2025-06-18 09:06:27",
    "Accepted_2025-06-18 09:06:27",
    "Requesting_\u0662025-06-18 09:06:27",
    "Reported 2025-06-18 09:06:27 +9900 X",
    "Reported 2025-06-18 09:06:27 +2400 X",
    "Reported 2025-06-18 09:06:27 +0060 X",
    "Reported_2025-06-18 09:06:27 +0000 UTC",
    "Reported_2025-06-18 09:06:27.5",
    "Requesting_2025-06-18 09:06:27" + "x" * 10_000,
]


@pytest.mark.parametrize("value", BAD, ids=[repr(v[:40]) for v in BAD])
def test_malformed_stamp_is_refused(value: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_handshake(value)
    assert info.value.field == KEY
    assert KEY in str(info.value)


def test_our_report_is_told_from_hamis_and_a_request_keeps_what_was_known() -> None:
    ours = plugin_report(datetime(2026, 11, 24, 10, 0, tzinfo=UTC))
    assert ours == {
        keys.NODE_HANDSHAKE: "Reported_2026-11-24 10:00:00",
        keys.DEVICE_PLUGIN_MARKER: "Reported_2026-11-24 10:00:00",
    }
    assert reported_by_us(ours) is True
    # HAMi's plugin reports later and leaves our marker as it was.
    assert reported_by_us({**ours, keys.NODE_HANDSHAKE: "Reported_2026-11-24 10:00:30"}) is False
    assert reported_by_us({keys.NODE_HANDSHAKE: "Reported 2026-11-24 10:00:30 +0000 UTC"}) is False
    # No report: a pending request, no handshake, an unreadable one.
    for written in (
        {**ours, keys.NODE_HANDSHAKE: "Requesting_2026-11-24 10:00:30"},
        {keys.DEVICE_PLUGIN_MARKER: ours[keys.DEVICE_PLUGIN_MARKER]},
        {**ours, keys.NODE_HANDSHAKE: "garbage"},
    ):
        assert reported_by_us(written) is None
