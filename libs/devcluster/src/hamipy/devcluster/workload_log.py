"""What gpu-workload (``native/workload/gpu_workload.c``, the GPU pods' program) reported, read
from its output or ``kubectl logs``: every line holding ``WORKLOAD_LOG_PREFIX`` is followed by one
JSON object whose ``event`` names the fact (``driver``, ``device``, ``alloc``, ``kernels``,
``ready``, ``exit``, ``error``; the fields are listed in the program's top comment)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final

WORKLOAD_LOG_PREFIX: Final = "HAMIPY-WORKLOAD "


@dataclasses.dataclass(frozen=True)
class WorkloadLog:
    events: tuple[dict[str, Any], ...]

    def of(self, event: str) -> list[dict[str, Any]]:
        """Every `event` fact, in the order printed."""
        return [fact for fact in self.events if fact["event"] == event]

    def one(self, event: str, *, index: int | None = None) -> dict[str, Any]:
        """The single `event` fact (of device `index`); LookupError, listing what was printed, if
        there is none or more than one."""
        found = [fact for fact in self.of(event) if index is None or fact.get("index") == index]
        if len(found) != 1:
            where = "" if index is None else f" for device {index}"
            raise LookupError(
                f"{len(found)} {event!r} events{where} in the workload's output: {list(self.events)}"
            )
        return found[0]

    @property
    def ready(self) -> bool:
        return bool(self.of("ready"))


def parse_workload_log(text: str) -> WorkloadLog:
    """The facts in `text` (any other lines are skipped); ValueError naming a line that is not a
    JSON object with an ``event``."""
    events: list[dict[str, Any]] = []
    for line in text.splitlines():
        _, prefix, body = line.partition(WORKLOAD_LOG_PREFIX)
        if not prefix:
            continue
        try:
            fact = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"workload output line is not JSON ({exc}): {line!r}") from exc
        if not isinstance(fact, dict) or not isinstance(fact.get("event"), str):
            raise ValueError(f"workload output line is not an object with an event: {line!r}")
        events.append(fact)
    return WorkloadLog(events=tuple(events))
