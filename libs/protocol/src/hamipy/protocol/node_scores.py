"""``hami.io/node-nvidia-score``: how well each pair of a node's GPUs talks to each other, as HAMi's
device plugin computes and publishes it (docs/wire-format.md#pair-scores) for topology-aware placement.

Wire form, what upstream's ``json.Marshal`` of ``[]DeviceScore`` writes: a JSON array in
registration order, one ``{"uuid":<uuid>,"score":{<other uuid>:<int>,...}}`` per GPU, the inner
keys sorted (a Go map), no blanks. ``decode_node_scores`` reads what HAMi's plugin writes too: keys
match ASCII-case-insensitively and unknown keys are ignored (Go's ``json.Unmarshal``), a missing
or ``null`` ``score`` is no scores; anything else malformed (not JSON, a uuid missing or given
twice, a score that is not a whole number within int64) is a ``ProtocolError`` naming the node.

Computation, from the facts NVML gives (upstream's ``calculate_score.go`` and ``links.go``), for
each ordered pair (a, b):

- a PCIe entry: the score of ``nvmlDeviceGetTopologyCommonAncestor(a, b)`` (``LEVEL_SCORES``);
  another level is an error, as upstream fails the whole computation;
- an NVLink entry when a counts links to b: its enabled links whose remote PCI bus id is b's, or,
  with none such and both GPUs on NVSwitches, the smaller of the two GPUs' switch-link counts;
  100 per link (1 to ``NVLINK_MAX_LINKS``);
- the pair's score is the sum of a's entries, unless a and b record a different number of entries
  (one sees NVLink the other does not): then it scores 0 both ways, an asymmetric pair, which the
  plugin reports as a Warning Event (``ASYMMETRIC_REASON``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

from hamipy.protocol import keys
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_devices import check_value, go_json, parse_json

__all__ = [
    "ASYMMETRIC_MESSAGE",
    "ASYMMETRIC_REASON",
    "LEVEL_SCORES",
    "NVLINK_MAX_LINKS",
    "NVLINK_SCORE",
    "GpuLinks",
    "NodeScores",
    "PairPath",
    "bus_id",
    "decode_node_scores",
    "encode_node_scores",
    "node_scores",
    "nvlink_count",
    "score_paths",
]

_KEY: Final = keys.NODE_SCORE
_INT64: Final = 2**63

LEVEL_SCORES: Final[Mapping[int, int]] = {0: 60, 10: 50, 20: 40, 30: 30, 40: 20, 50: 10}
"""NVML's P2P levels (INTERNAL, PIX, PXB, PHB, NODE, SYS) and upstream's score for each."""
NVLINK_SCORE: Final = 100
NVLINK_MAX_LINKS: Final = 18
"""Links upstream reads (go-nvml's ``NVLINK_MAX_LINKS``); a count past it is no NVLink entry."""
ASYMMETRIC_REASON: Final = "AsymmetricGPUP2PLink"
ASYMMETRIC_MESSAGE: Final = (
    "One or more GPU pairs on this node have asymmetric P2P link data; "
    "affected pairs scored 0 (possible NVLink hardware or driver issue)"
)

NodeScores = dict[str, dict[str, int]]
"""Per GPU UUID (registration order) the score to each other GPU."""


@dataclasses.dataclass(frozen=True, slots=True)
class GpuLinks:
    """One GPU's NVLinks as NVML reports them."""

    uuid: str
    bus_id: str
    """Its PCI bus id as NVML writes it (``00000000:3B:00.0``)."""
    remote_bus_ids: tuple[str, ...] = ()
    """The remote end's PCI bus id of each enabled link."""
    switch_links: int = 0
    """Enabled links whose remote end is an NVSwitch."""


@dataclasses.dataclass(frozen=True, slots=True)
class PairPath:
    """What upstream records for one ordered pair: a PCIe level (None: no entry) and the NVLinks
    counted from the first GPU (0: no entry)."""

    level: int | None
    nvlinks: int = 0

    @property
    def entries(self) -> int:
        return (self.level is not None) + (self.nvlinks > 0)

    @property
    def score(self) -> int:
        pcie = LEVEL_SCORES[self.level] if self.level is not None else 0
        return pcie + NVLINK_SCORE * self.nvlinks


def bus_id(raw: str) -> str:
    """Upstream's comparable form of a PCI bus id: up to a NUL, lower case, one leading ``0000``
    dropped (``00000000:2A:00.0`` -> ``0000:2a:00.0``) unless that is all there is."""
    text = raw.split("\0", 1)[0].lower()
    return text[4:] if text.startswith("0000") and text != "0000" else text


def _links(n: int) -> int:
    return n if 1 <= n <= NVLINK_MAX_LINKS else 0


def nvlink_count(src: GpuLinks, dst: GpuLinks) -> int:
    """The NVLinks upstream counts from ``src`` to ``dst`` (0: none)."""
    target = bus_id(dst.bus_id)
    direct = _links(sum(1 for remote in src.remote_bus_ids if bus_id(remote) == target))
    if direct or not src.remote_bus_ids:
        return direct
    if src.switch_links > 0 and dst.switch_links > 0:
        return _links(min(src.switch_links, dst.switch_links))
    return 0


def node_scores(
    gpus: Sequence[GpuLinks], levels: Mapping[tuple[str, str], int]
) -> tuple[NodeScores, list[tuple[str, str]]]:
    """The scores of ``gpus`` (registration order) from their links and ``levels`` (NVML's P2P
    level per ordered pair of UUIDs), and the asymmetric pairs. ``ProtocolError`` for a level that
    is not NVML's."""
    paths: dict[str, dict[str, PairPath]] = {}
    for a in gpus:
        row = paths[a.uuid] = {}
        for b in gpus:
            if b.uuid == a.uuid:
                continue
            level = levels[(a.uuid, b.uuid)]
            if level not in LEVEL_SCORES:
                raise ProtocolError(f"P2P level {a.uuid} -> {b.uuid}", level, "unknown topology level")
            row[b.uuid] = PairPath(level, nvlink_count(a, b))
    return score_paths(paths)


def score_paths(paths: Mapping[str, Mapping[str, PairPath]]) -> tuple[NodeScores, list[tuple[str, str]]]:
    """Upstream's ``calculateGPUScore``: each ordered pair's score from its paths both ways, and the
    asymmetric pairs (each once, in order)."""
    scores: NodeScores = {}
    asymmetric: list[tuple[str, str]] = []
    for a, row in paths.items():
        scores[a] = {}
        for b, forward in row.items():
            back = paths.get(b, {}).get(a, PairPath(None))
            if forward.entries != back.entries:
                scores[a][b] = 0
                if (b, a) not in asymmetric:
                    asymmetric.append((a, b))
            else:
                scores[a][b] = forward.score
    return scores, asymmetric


def encode_node_scores(scores: Mapping[str, Mapping[str, int]]) -> str:
    """The annotation value, byte for byte as upstream's plugin writes it."""
    return go_json([{"uuid": uuid, "score": dict(sorted(row.items()))} for uuid, row in scores.items()])


def decode_node_scores(value: str, *, node: str) -> NodeScores:
    """Read ``hami.io/node-nvidia-score`` of ``node`` (ours or HAMi's plugin's)."""
    where = f"node {node}: {_KEY}"
    check_value(where, value)
    raw = parse_json(where, value)
    if raw is None:  # Go reads null as no entries
        return {}
    if type(raw) is not list:
        raise ProtocolError(where, raw, "expected a JSON array")
    scores: NodeScores = {}
    for i, entry in enumerate(raw):
        if type(entry) is not dict:
            raise ProtocolError(f"{where}[{i}]", entry, "expected a JSON object")
        fields = _fold(entry)
        uuid = fields.get("uuid")
        if type(uuid) is not str or not uuid:
            raise ProtocolError(f"{where}[{i}].uuid", uuid, "expected a non-empty string")
        if uuid in scores:
            raise ProtocolError(f"{where}[{i}].uuid", uuid, "given twice")
        scores[uuid] = _row(fields.get("score"), f"{where}[{i}].score")
    return scores


def _fold(entry: Mapping[str, Any]) -> dict[str, Any]:
    """Go's key matching: exact first, else ASCII-case-insensitive; other keys dropped."""
    fields: dict[str, Any] = {}
    for key, item in entry.items():
        name = key.lower()
        if name in ("uuid", "score") and (name not in fields or key == name):
            fields[name] = item
    return fields


def _row(raw: Any, where: str) -> dict[str, int]:
    if raw is None:
        return {}
    if type(raw) is not dict:
        raise ProtocolError(where, raw, "expected a JSON object of scores")
    row: dict[str, int] = {}
    for other, score in raw.items():
        if type(score) is not int or not -_INT64 <= score < _INT64:
            raise ProtocolError(f"{where}[{other!r}]", score, "expected a whole number within int64")
        row[other] = score
    return row
