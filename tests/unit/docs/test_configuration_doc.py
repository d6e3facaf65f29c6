"""docs/configuration.md lists every key of the configuration schema and nothing that is not one,
and each service's settings as they are declared: flag, variables, default and meaning, the ones
users set apart from the tuning knobs."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import pytest
from pydantic import BaseModel

from hamipy.device_plugin import cli as device_plugin_cli
from hamipy.extender import cli as extender_cli
from hamipy.monitor import cli as monitor_cli
from hamipy.protocol.config import Config, FilterDevices, NodeConfig, NvidiaConfig
from hamipy.protocol.settings import Declared, Group
from hamipy.webhook import cli as webhook_cli

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


# -- each service's settings ------------------------------------------------------------------------------
# Their tables are made from the declarations (hamipy.protocol.settings):
# `.venv/bin/python tests/unit/docs/test_configuration_doc.py` writes them into the doc.


@dataclasses.dataclass(frozen=True)
class Service:
    program: str
    prefix: str
    commands: Mapping[str, tuple[Group, ...]]
    """Each command's settings; "" for a service without commands."""
    default_command: str = ""


SERVICES: Final = (
    Service(
        "hamipy-webhook",
        webhook_cli.ENV_PREFIX,
        {name: command.settings for name, command in webhook_cli.COMMANDS.items()},
        "serve",
    ),
    Service(
        "hamipy-extender",
        extender_cli.ENV_PREFIX,
        {name: command.settings for name, command in extender_cli.COMMANDS.items()},
        "serve",
    ),
    Service("hamipy-device-plugin", device_plugin_cli.ENV_PREFIX, {"": device_plugin_cli.SETTINGS}),
    Service("hamipy-monitor", monitor_cli.ENV_PREFIX, {"": monitor_cli.SETTINGS}),
)
HEADER: Final = ("| flag | variables | default | meaning |", "|---|---|---|---|")
_FLAG: Final = re.compile(r"`--([a-z0-9-]+)`")


def settings_of(service: Service) -> dict[str, tuple[Declared, tuple[str, ...]]]:
    """Every setting of ``service`` by flag, with the commands that take it."""
    found: dict[str, tuple[Declared, tuple[str, ...]]] = {}
    for command, groups in service.commands.items():
        for group in groups:
            for item in group.declared():
                first, commands = found.get(item.flag, (item, ()))
                assert first == item, f"{service.program}: two settings named --{item.flag}"
                found[item.flag] = (item, (*commands, command))
    return found


def rendered_default(item: Declared) -> str:
    value = item.default
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if item.dest.endswith("_s") or item.value_type is timedelta:
        return f"{value:g} s"
    if isinstance(value, int | float):
        return str(value)
    return f"`{value}`" if value != "" else "empty"


def tables(service: Service) -> tuple[list[str], list[str]]:
    """The rows of the user settings' table and of the tuning knobs'."""
    rows: dict[str, list[str]] = {"user": [], "tuning": []}
    for flag, (item, commands) in settings_of(service).items():
        where = "" if service.default_command in commands else f" ({', '.join(f'`{c}`' for c in commands)})"
        variables = ", ".join(f"`{name}`" for name in item.variables(service.prefix))
        rows[item.setting.kind].append(
            f"| `--{flag}`{where} | {variables} | {rendered_default(item)} | {item.setting.help} |"
        )
    return [*HEADER, *rows["user"]], [*HEADER, *rows["tuning"]]


def section(lines: list[str], program: str) -> tuple[range, range]:
    """Where the user table and the tuning table under ``### `program``` are."""
    start = lines.index(f"### `{program}`")
    found: list[range] = []
    index = start + 1
    while len(found) < 2:
        assert not lines[index].startswith("#"), f"{program}: the section has fewer than two tables"
        if lines[index].startswith("|"):
            end = index
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            found.append(range(index, end))
            index = end
        index += 1
    return found[0], found[1]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.program)
def test_the_settings_tables_are_the_declarations(service: Service) -> None:
    lines = DOC.read_text().splitlines()
    user, tuning = section(lines, service.program)
    expected_user, expected_tuning = tables(service)
    assert [lines[i] for i in user] == expected_user
    assert [lines[i] for i in tuning] == expected_tuning


def documented_flags(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(flag, default) of every row of a table with a ``flag`` and a ``default`` column."""
    columns: list[str] = []
    for line in lines:
        if not line.startswith("|"):
            columns = []
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if not columns:
            columns = cells
        elif columns[0] == "flag" and "default" in columns and (flag := _FLAG.match(cells[0])):
            yield flag.group(1), cells[columns.index("default")]


def test_every_documented_flag_is_a_setting_with_that_default() -> None:
    """Beyond the generated tables (the HTTP limits' one, say): a row naming a flag says its default."""
    declared_by: dict[str, set[str]] = {}
    for service in SERVICES:
        for flag, (item, _) in settings_of(service).items():
            declared_by.setdefault(flag, set()).add(rendered_default(item))
    rows = list(documented_flags(DOC.read_text().splitlines()))
    assert len(rows) > len(declared_by)
    for flag, default in rows:
        assert flag in declared_by, f"--{flag} is documented but no service takes it"
        assert default in declared_by[flag], (
            f"--{flag}: documented default {default}, declared {declared_by[flag]}"
        )


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    """Every option of ``parser`` and of its commands' parsers."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found |= options_of(command)
    return found


@pytest.mark.parametrize(
    ("page", "module"),
    [
        ("webhook.md", webhook_cli),
        ("extender.md", extender_cli),
        ("device-plugin.md", device_plugin_cli),
        ("monitor.md", monitor_cli),
    ],
)
def test_every_flag_a_services_page_tabulates_is_one_it_takes(page: str, module: Any) -> None:
    options = options_of(module.build_parser({}))
    named = {
        f"--{flag}"
        for line in (DOC.parent / page).read_text().splitlines()
        if line.startswith("| `--")
        for flag in re.findall(r"`--(?:no-)?([a-z0-9-]+)", line.split("|")[1])
    }
    assert named
    assert named <= options, f"{page} names flags {module.__name__} does not take"


def write_tables() -> None:
    lines = DOC.read_text().splitlines()
    for service in SERVICES:
        # The tuning table first: the user table's lines stay where they are.
        for where, rows in reversed(list(zip(section(lines, service.program), tables(service), strict=True))):
            lines[where.start : where.stop] = rows
    DOC.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_tables()
