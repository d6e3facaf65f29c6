"""How long the cyclic garbage collector holds the process, by generation, as a Prometheus histogram.

A collection runs inside whatever allocation triggered it and holds the GIL throughout: on an
asyncio service every request waiting on the loop waits for it too. In the extender under a burst
of binds, middle and full collections hold the loop for milliseconds to tens of milliseconds:
pauses that a client's ``/filter`` meets whenever it arrives during one
(docs/extender.md#what-a-filter-waits-behind). prometheus_client's own
``python_gc_collections_total`` counts collections but not their time.

``GcPauses`` times each collection from ``gc.callbacks`` (the interpreter calls them at the start
and the end of every collection) and serves the histogram as a collector. The callback does plain
arithmetic on lists it alone writes, with no lock: a callback runs inside an allocation, possibly
one made while another lock is held, so it must not take one. Use it as a context manager, which
adds the callback and removes it again (the callbacks are the interpreter's, shared by the whole
process).
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Final, Self

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from hamipy.telemetry.exposition import value_text

__all__ = ["GC_PAUSE_BUCKETS", "GcPauses"]

GC_PAUSE_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds in seconds: young collections fall in the first, full ones of a large heap near
the top."""

_GENERATIONS: Final = 3


class GcPauses(Collector):
    """``<prefix>_gc_pause_seconds{generation}``: each collection's time while entered."""

    def __init__(
        self,
        prefix: str,
        *,
        buckets: Sequence[float] = GC_PAUSE_BUCKETS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name = f"{prefix}_gc_pause_seconds"
        self.bounds = tuple(buckets)
        self.clock = clock
        # Per generation: the count in each bucket (the last is +Inf), and the seconds in all.
        self._counts = [[0] * (len(self.bounds) + 1) for _ in range(_GENERATIONS)]
        self._sums = [0.0] * _GENERATIONS
        self._started = 0.0

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        """The ``gc.callbacks`` hook."""
        if phase == "start":
            self._started = self.clock()
            return
        generation = info["generation"]
        elapsed = self.clock() - self._started
        self._counts[generation][bisect.bisect_left(self.bounds, elapsed)] += 1
        self._sums[generation] += elapsed

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            self.name,
            "Time the cyclic garbage collector held the process, per collection, by generation "
            "(0 youngest, 2 full).",
            labels=["generation"],
        )
        for generation in range(_GENERATIONS):
            cumulative, buckets = 0, []
            counts = list(self._counts[generation])  # a copy: a collection may land meanwhile
            for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((value_text(bound), cumulative))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family

    def __enter__(self) -> Self:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
