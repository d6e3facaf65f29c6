"""The garbage collector's pauses as a histogram: each collection lands in its generation and its
bucket, the exposition is a valid cumulative histogram, and the process-wide callback is there only
while entered."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hamipy.telemetry.gc_pauses import GcPauses


def samples(pauses: GcPauses) -> dict[tuple[str, str, str], float]:
    """(sample name, generation, le) -> value, read back through prometheus_client's parser."""
    registry = CollectorRegistry()
    registry.register(pauses)
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, s.labels["generation"], s.labels.get("le", ""))] = s.value
    return out


def test_a_pause_lands_in_its_generation_and_the_first_bucket_that_holds_it() -> None:
    clock = iter((10.0, 10.003, 20.0, 20.0002))
    pauses = GcPauses("svc", clock=lambda: next(clock))
    pauses("start", {"generation": 1})
    pauses("stop", {"generation": 1, "collected": 0, "uncollectable": 0})
    pauses("start", {"generation": 0})
    pauses("stop", {"generation": 0, "collected": 0, "uncollectable": 0})

    got = samples(pauses)
    assert got[("svc_gc_pause_seconds_bucket", "1", "0.0025")] == 0
    assert got[("svc_gc_pause_seconds_bucket", "1", "0.005")] == 1
    assert got[("svc_gc_pause_seconds_bucket", "1", "+Inf")] == 1
    assert got[("svc_gc_pause_seconds_count", "1", "")] == 1
    assert got[("svc_gc_pause_seconds_sum", "1", "")] == pytest.approx(0.003)
    assert got[("svc_gc_pause_seconds_bucket", "0", "0.0005")] == 1
    assert got[("svc_gc_pause_seconds_count", "2", "")] == 0


def test_real_collections_are_timed_only_while_entered() -> None:
    pauses = GcPauses("svc")
    with pauses:
        assert pauses in gc.callbacks
        gc.collect(2)
        gc.collect(2)
    assert pauses not in gc.callbacks
    gc.collect(2)

    got = samples(pauses)
    assert got[("svc_gc_pause_seconds_count", "2", "")] == 2
    assert got[("svc_gc_pause_seconds_sum", "2", "")] > 0
    buckets = [v for (name, gen, _), v in got.items() if name.endswith("_bucket") and gen == "2"]
    assert buckets == sorted(buckets)  # cumulative
    assert got[("svc_gc_pause_seconds_bucket", "2", "+Inf")] == 2


def test_entering_twice_adds_one_callback() -> None:
    pauses = GcPauses("svc")
    with pauses, pauses:
        assert gc.callbacks.count(pauses) == 1
    assert pauses not in gc.callbacks
