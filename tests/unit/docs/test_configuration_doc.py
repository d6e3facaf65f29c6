"""docs/configuration.md lists every key of the configuration schema and nothing that is not one."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from hamipy.protocol.config import Config, FilterDevices, NodeConfig, NvidiaConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
SECTIONS: dict[str, type[BaseModel]] = {
    "": Config,
    "nvidia.": NvidiaConfig,
    "nodeConfigs[].": NodeConfig,
    "nodeConfigs[].filterDevices.": FilterDevices,
}


def schema_keys() -> set[str]:
    keys = set()
    for prefix, model in SECTIONS.items():
        for name, field in model.model_fields.items():
            if name != "nvidia":
                keys.add(prefix + (field.alias or name))
    return keys


def documented_keys() -> set[str]:
    return set(re.findall(r"^\| `([A-Za-z.\[\]]+)` \| `", DOC.read_text(), re.MULTILINE))


def test_every_schema_key_is_documented() -> None:
    assert schema_keys() - documented_keys() == set()


def test_no_documented_key_is_missing_from_the_schema() -> None:
    assert documented_keys() - schema_keys() == set()
