"""Settings declared once (``hamipy.protocol.settings``): the flags and variables made from a
dataclass's declarations, read strictly, and the dataclass built back from them."""

from __future__ import annotations

import argparse
import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest

from hamipy.protocol.settings import (
    OWN,
    BadEnvironment,
    Group,
    add_settings,
    declare,
    declared,
    settings_from,
    tuning,
    user,
)

PREFIX = "HAMIPY_X_"


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    max_items: int = tuning(8, "items at once")
    idle_timeout_s: float = tuning(75.0, "seconds idle")

    def __post_init__(self) -> None:
        if self.max_items < 1:
            raise ValueError(f"--max-items must be at least 1 (got {self.max_items})")


@dataclasses.dataclass(frozen=True, slots=True)
class Example:
    node_name: str = dataclasses.field(metadata=declare("this node", kind="user", env=(OWN, "NODE_NAME")))
    cold: bool = user(False, "start cold")
    hot: bool = user(True, "start hot")
    port: int = user(8888, "listen port")
    metrics_port: int | None = user(None, "metrics port")
    bind_timeout_s: float = user(20.0, "seconds a bind waits")
    lock_expiry: timedelta = tuning(timedelta(minutes=5), "seconds a lock lives")
    config: Path | None = user(None, "configuration file", env=("HAMIPY_CONFIG", OWN))
    identity: str = user("", "name in the Lease", env=(OWN, "POD_NAME"))
    log_level: str = user("info", "log level", choices=("debug", "info"))
    leader_election: bool = user(False, "elect a leader", flag="leader-elect")
    limits: Limits = Limits()
    internal_s: float = 1.0
    """Not a setting: no flag."""


def parse(
    env: dict[str, str], *argv: str, groups: tuple[Group, ...] = (Group(Example),)
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hamipy-x", exit_on_error=False)
    add_settings(parser, *groups, env=env, prefix=PREFIX)
    return parser.parse_args(list(argv))


def example(env: dict[str, str], *argv: str) -> Example:
    return settings_from(Example, parse({"NODE_NAME": "n1", **env}, *argv))


def test_flags_are_the_field_names_without_their_unit_and_nested_groups_give_theirs() -> None:
    flags = {item.dest: item.flag for item in declared(Example)}
    assert flags == {
        "node_name": "node-name",
        "cold": "cold",
        "hot": "hot",
        "port": "port",
        "metrics_port": "metrics-port",
        "bind_timeout_s": "bind-timeout",
        "lock_expiry": "lock-expiry",
        "config": "config",
        "identity": "identity",
        "log_level": "log-level",
        "leader_election": "leader-elect",
        "limits.max_items": "max-items",
        "limits.idle_timeout_s": "idle-timeout",
    }
    assert {item.flag: item.variables(PREFIX) for item in declared(Example)}["config"] == (
        "HAMIPY_CONFIG",
        "HAMIPY_X_CONFIG",
    )


def test_the_defaults_are_the_declared_ones() -> None:
    assert example({}) == Example(node_name="n1")


def test_every_kind_of_setting_from_its_variable() -> None:
    env = {
        "HAMIPY_X_COLD": "yes",
        "HAMIPY_X_HOT": "Off",
        "HAMIPY_X_PORT": "9443",
        "HAMIPY_X_METRICS_PORT": "9090",
        "HAMIPY_X_BIND_TIMEOUT": "2.5",
        "HAMIPY_X_LOCK_EXPIRY": "30",
        "HAMIPY_X_CONFIG": "/etc/c.yaml",
        "HAMIPY_X_LOG_LEVEL": "debug",
        "HAMIPY_X_LEADER_ELECT": "1",
        "HAMIPY_X_MAX_ITEMS": "3",
        "HAMIPY_X_IDLE_TIMEOUT": "5",
    }
    assert example(env) == Example(
        node_name="n1",
        cold=True,
        hot=False,
        port=9443,
        metrics_port=9090,
        bind_timeout_s=2.5,
        lock_expiry=timedelta(seconds=30),
        config=Path("/etc/c.yaml"),
        log_level="debug",
        leader_election=True,
        limits=Limits(max_items=3, idle_timeout_s=5.0),
    )


def test_a_flag_beats_its_variable_and_either_switch_spelling_does() -> None:
    env = {"HAMIPY_X_COLD": "true", "HAMIPY_X_PORT": "9443", "HAMIPY_X_MAX_ITEMS": "3"}
    got = example(env, "--no-cold", "--no-hot", "--port", "1", "--max-items", "2", "--lock-expiry", "1.5")
    assert (got.cold, got.hot, got.port, got.limits.max_items) == (False, False, 1, 2)
    assert got.lock_expiry == timedelta(seconds=1.5)


@pytest.mark.parametrize(
    ("env", "identity", "config"),
    [
        pytest.param({"POD_NAME": "pod-a"}, "pod-a", None, id="shared-only"),
        pytest.param({"POD_NAME": "pod-a", "HAMIPY_X_IDENTITY": "mine"}, "mine", None, id="own-first"),
        pytest.param(
            {"HAMIPY_CONFIG": "/shared.yaml", "HAMIPY_X_CONFIG": "/own.yaml"},
            "",
            "/shared.yaml",
            id="shared-first",
        ),
        pytest.param({"HAMIPY_X_CONFIG": "/own.yaml"}, "", "/own.yaml", id="own-only"),
        pytest.param(
            {"HAMIPY_CONFIG": "", "HAMIPY_X_CONFIG": "/own.yaml"}, "", "/own.yaml", id="empty-is-unset"
        ),
    ],
)
def test_the_first_variable_set_wins_in_the_declared_order(
    env: dict[str, str], identity: str, config: str | None
) -> None:
    got = example(env)
    assert (got.identity, got.config) == (identity, None if config is None else Path(config))


def test_an_empty_variable_is_unset_for_every_kind_of_setting() -> None:
    """A chart renders an unset value as "": it means the default, not an error."""
    names = ("COLD", "PORT", "METRICS_PORT", "BIND_TIMEOUT", "LOCK_EXPIRY", "LOG_LEVEL", "MAX_ITEMS")
    env = {PREFIX + name: "" for name in names}
    assert example({**env, "HAMIPY_X_IDENTITY": " "}) == Example(node_name="n1")


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        pytest.param("HAMIPY_X_COLD", "maybe", "true or false", id="boolean"),
        pytest.param("HAMIPY_X_COLD", "2", "true or false", id="boolean-number"),
        pytest.param("HAMIPY_X_PORT", "https", "a whole number", id="integer"),
        pytest.param("HAMIPY_X_METRICS_PORT", "9x", "a whole number", id="optional-integer"),
        pytest.param("HAMIPY_X_BIND_TIMEOUT", "soon", "a number", id="number"),
        pytest.param("HAMIPY_X_LOCK_EXPIRY", "5m", "seconds", id="seconds"),
        pytest.param("HAMIPY_X_LOG_LEVEL", "loud", "one of debug, info", id="choice"),
        pytest.param("HAMIPY_X_MAX_ITEMS", "all", "a whole number", id="nested"),
    ],
)
def test_a_variable_its_setting_cannot_take_is_refused_naming_it(
    variable: str, value: str, expected: str
) -> None:
    with pytest.raises(BadEnvironment, match=expected) as info:
        parse({"NODE_NAME": "n1", variable: value})
    assert f"{variable}={value!r}" in str(info.value)


@pytest.mark.parametrize(
    ("text", "value"), [("1", True), ("TRUE", True), (" on", True), ("no", False), ("Off", False)]
)
def test_booleans_in_every_spelling(text: str, value: bool) -> None:
    assert example({"HAMIPY_X_COLD": text}).cold is value


def test_a_required_setting_comes_from_a_flag_or_a_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_from(Example, parse({"HAMIPY_X_NODE_NAME": "own"})).node_name == "own"
    assert settings_from(Example, parse({}, "--node-name", "flag")).node_name == "flag"
    parser = argparse.ArgumentParser(prog="hamipy-x")
    add_settings(parser, Group(Example), env={}, prefix=PREFIX)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "--node-name" in capsys.readouterr().err


def test_a_value_the_settings_refuse_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="--max-items must be at least 1"):
        example({}, "--max-items", "0")


def test_a_group_may_take_some_fields_only_and_the_rest_keep_their_defaults() -> None:
    args = parse({}, "--port", "1", groups=(Group(Example, only=("port", "limits")),))
    assert not hasattr(args, "cold")
    got = settings_from(Example, args, node_name="given")
    assert got == Example(node_name="given", port=1)


def test_the_help_names_each_variable() -> None:
    parser = argparse.ArgumentParser(prog="hamipy-x")
    add_settings(parser, Group(Example), env={}, prefix=PREFIX)
    text = " ".join(parser.format_help().split())
    assert "[env HAMIPY_X_NODE_NAME, NODE_NAME]" in text
    assert "[env HAMIPY_CONFIG, HAMIPY_X_CONFIG]" in text
