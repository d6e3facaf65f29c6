"""``GaugeText`` writes what prometheus_client's ``generate_latest`` writes for the same samples:
label values that need escaping (they may come from annotations), and every kind of value."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from hamipy.telemetry.exposition import GaugeText, label_text

LABELS = ("node", "device_uuid", "pod")
ROWS = [
    (("n1", "GPU-0", "p"), 34359738368),
    (("n1", "GPU-1", 'say "hi"'), 30),
    (("back\\slash", "new\nline", "ünïcode ✓"), 0.25),
    (("n2", "GPU-2", ""), 0),
    (("n2", "GPU-3", "p"), 1234567.0),
    (("n2", "GPU-4", "p"), math.inf),
    (("n2", "GPU-5", "p"), -1.5),
    (("n2", "GPU-6", "p"), 30),  # a value seen before: the memo's text
]


class _Family(Collector):
    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily("hami_test_bytes", "Bytes of a \\ test\nacross lines", labels=list(LABELS))
        for values, value in ROWS:
            family.add_metric(list(values), value)
        return [family]


def test_the_text_is_prometheus_clients_byte_for_byte() -> None:
    registry = CollectorRegistry()
    registry.register(_Family())
    ours = GaugeText("hami_test_bytes", "Bytes of a \\ test\nacross lines")
    for values, value in ROWS:
        ours.add(label_text(zip(LABELS, values, strict=True)), value)
    assert ours.text().encode() == generate_latest(registry)


@pytest.mark.parametrize("lines", [1, 2, 3, 100])
def test_the_pieces_are_the_text_cut_at_line_ends(lines: int) -> None:
    ours = GaugeText("hami_test_bytes", "Bytes")
    for values, value in ROWS:
        ours.add(label_text(zip(LABELS, values, strict=True)), value)
    pieces = list(ours.pieces(lines))
    assert "".join(pieces) == ours.text()
    assert len(pieces) == -(-(len(ROWS) + 1) // lines)  # the header, then a line per sample
    assert all(piece.endswith("\n") for piece in pieces)


def test_a_nan_is_written_as_prometheus_reads_it() -> None:
    ours = GaugeText("hami_test_ratio", "A ratio")
    ours.add(label_text([("node", "n")]), math.nan)
    ours.add(label_text([("node", "m")]), math.nan)
    (family,) = text_string_to_metric_families(ours.text())
    assert [math.isnan(s.value) for s in family.samples] == [True, True]


@pytest.mark.parametrize("value", ['a"b', "a\\b", "a\nb", 'end\\"'])
def test_a_hostile_label_value_stays_inside_its_quotes(value: str) -> None:
    ours = GaugeText("hami_test", "t")
    ours.add(label_text([("pod", value), ("node", "n")]), 1)
    (family,) = text_string_to_metric_families(ours.text())
    (sample,) = family.samples
    assert sample.labels == {"pod": value, "node": "n"}
