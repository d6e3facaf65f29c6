"""The chart's values schema against the code (no helm here; tests/integration/deploy holds what
helm does with it): the ``config`` section takes what ``hamipy.protocol.config`` takes (its keys,
policy names and bounds, and its patterns checked against the protocol's own validators), and every
value ``values.yaml`` sets or a template reads is one the schema knows."""

from __future__ import annotations

import re
from typing import Any

import pydantic
import pytest
from chart_values import CHART, load_schema, value_paths
from hypothesis import assume, example, given
from hypothesis import strategies as st

from hamipy.protocol.allocation_env import CORE_POLICIES
from hamipy.protocol.cdi import DEVICE_LIST_STRATEGIES
from hamipy.protocol.config import Config, NvidiaConfig, checked_hook_path
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_handshake import HANDSHAKE_TIMEOUT
from hamipy.protocol.pod_preferences import GPU_POLICIES, NODE_POLICIES, parse_gpu_policy

SCHEMA = load_schema()
NVIDIA = ("config", "nvidia")
# JSON Schema keywords pydantic writes for a field's constraints; the chart's must be the same.
BOUNDS = ("enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength")


def node(*path: str) -> dict[str, Any]:
    found = SCHEMA.at(path)
    assert found is not None, f"the schema has no {'.'.join(path)}"
    return found


def accepts(pattern_of: tuple[str, ...], text: str) -> bool:
    # Go's RE2 (helm's) and Python's re read these patterns alike: no look-around, no backreferences.
    return re.fullmatch(node(*pattern_of)["pattern"], text) is not None


def test_the_schema_is_draft_07_which_helm_3_validates() -> None:
    assert SCHEMA.document["$schema"] == "http://json-schema.org/draft-07/schema#"


# -- the config section is hamipy.protocol.config ------------------------------------------------


@pytest.mark.parametrize(
    ("path", "names"),
    [
        (("config", "nodeSchedulerPolicy"), NODE_POLICIES),
        (("config", "gpuSchedulerPolicy"), GPU_POLICIES),
        ((*NVIDIA, "gpuCorePolicy"), CORE_POLICIES),
        ((*NVIDIA, "deviceListStrategy"), DEVICE_LIST_STRATEGIES),
    ],
    ids=["node", "gpu", "core", "device-list"],
)
def test_policy_names_are_the_ones_the_services_take(path: tuple[str, ...], names: tuple[str, ...]) -> None:
    found = node(*path)
    # A GPU policy chain may also be a list of names.
    enum = found["enum"] if "enum" in found else SCHEMA.resolve(found["items"])["enum"]
    assert enum == list(names)


def _model_field(schema: dict[str, Any], defs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A pydantic field's schema without its ``null`` branch, its $ref followed; and whether it
    takes null."""
    nullable = False
    if "anyOf" in schema:
        branches = [b for b in schema["anyOf"] if b.get("type") != "null"]
        nullable = len(branches) < len(schema["anyOf"])
        (schema,) = branches
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    return schema, nullable


def _same(model: dict[str, Any], chart: dict[str, Any], defs: dict[str, Any], where: str) -> None:
    model, nullable = _model_field(model, defs)
    chart = SCHEMA.resolve(chart)
    types = chart["type"] if isinstance(chart["type"], list) else [chart["type"]]
    assert model["type"] in types, where
    assert ("null" in types) == nullable, where
    for keyword in BOUNDS:
        if keyword in model:
            assert chart.get(keyword) == model[keyword], f"{where}: {keyword}"
    if model["type"] == "object":
        assert chart.get("additionalProperties") is False, where
        assert set(chart["properties"]) == set(model["properties"]), where
        assert set(model.get("required", [])) <= set(chart.get("required", [])), where
        for key, field in model["properties"].items():
            _same(field, chart["properties"][key], defs, f"{where}.{key}")
    if model["type"] == "array":
        _same(model["items"], chart["items"], defs, f"{where}[]")


def test_the_config_section_has_the_protocols_keys_types_and_bounds() -> None:
    """Every key of the configuration, none other, each with the type, policy names and range the
    services check at start: a value they would refuse (and crash-loop on) is refused at install."""
    model = Config.model_json_schema(by_alias=True)
    _same(model, node("config"), model["$defs"], "config")


ASCII_WHITESPACE = st.sampled_from(["", " ", "\t"])


@given(
    st.lists(
        st.tuples(
            ASCII_WHITESPACE, st.sampled_from([*GPU_POLICIES, "", "fastest", "Spread"]), ASCII_WHITESPACE
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_gpu_policy_chain_is_taken_as_the_config_takes_it(items: list[tuple[str, str, str]]) -> None:
    text = ",".join("".join(item) for item in items)
    try:
        parse_gpu_policy(text)
        taken = True
    except ProtocolError:
        taken = False
    assert accepts(("config", "gpuSchedulerPolicy"), text) == taken, text


def _nvidia_takes(**fields: object) -> bool:
    try:
        NvidiaConfig.model_validate(fields)
    except pydantic.ValidationError:
        return False
    return True


PATH_TEXT = st.text(alphabet="/a.'\\\x00", max_size=10)


@given(PATH_TEXT)
@example("/opt/hami//vgpu/")
@example("/a/..")
@example("/a/../b")
@example("/a/.../..b")
@example("/a/./b")
@example("a/b")
@example("/a'b")
@example("/a\\b")
def test_the_hook_path_is_taken_as_the_config_takes_it(text: str) -> None:
    try:
        checked_hook_path(text)
        taken = True
    except ValueError:
        taken = False
    assert accepts((*NVIDIA, "hookPath"), text) == taken, text


@given(PATH_TEXT)
@example("/run/cdi/")
@example("/a/..")
@example("/a'b")
def test_the_cdi_spec_dir_is_taken_as_the_config_takes_it(text: str) -> None:
    assert accepts((*NVIDIA, "cdiSpecDir"), text) == _nvidia_takes(cdiSpecDir=text), text


@given(st.lists(st.text(alphabet="aZ0.-_", max_size=4), min_size=1, max_size=3).map("/".join))
@example("example.com/vgpu-mem_1.0")
@example("a./b")
@example("a/b.")
@example("Example.com/b")
@example("a/b/c")
def test_a_resource_name_is_taken_as_the_config_takes_it(text: str) -> None:
    # The five names must also differ: keep to names none of the other defaults has.
    assume(text not in {NvidiaConfig().resource_memory_name, NvidiaConfig().resource_core_name})
    taken = _nvidia_takes(resourceCountName=text)
    assert accepts((*NVIDIA, "resourceCountName"), text) == taken, text


@given(st.text(alphabet="0145 x-", max_size=4))
@example(" 004 ")
@example("5")
@example("")
def test_a_log_level_string_is_taken_as_the_config_takes_it(text: str) -> None:
    assert accepts((*NVIDIA, "libCudaLogLevel"), text) == _nvidia_takes(libCudaLogLevel=text), text


def test_the_register_interval_stays_under_the_handshake_timeout() -> None:
    assert (
        node("devicePlugin", "registerIntervalSeconds")["exclusiveMaximum"]
        == HANDSHAKE_TIMEOUT.total_seconds()
    )


# -- the chart's own values ----------------------------------------------------------------------


def test_every_value_of_values_yaml_is_one_the_schema_knows() -> None:
    paths = value_paths(SCHEMA)
    assert ("webhook", "certificates", "mode") in paths
    assert [".".join(p) for p in paths if SCHEMA.at(p) is None] == []


def _template_reads() -> set[tuple[str, ...]]:
    """The value paths the templates read: ``.Values.a.b``, and ``$x.c`` where ``$x := .Values.a.b``
    in the same file."""
    reads = set()
    for template in (CHART / "templates").iterdir():
        text = template.read_text()
        for match in re.finditer(r"\.Values((?:\.\w+)+)", text):
            reads.add(tuple(match.group(1).split(".")[1:]))
        for alias, base in re.findall(r"(\$\w+) := \.Values((?:\.\w+)+)", text):
            for rest in re.findall(re.escape(alias) + r"((?:\.\w+)+)", text):
                reads.add(tuple(f"{base}{rest}".split(".")[1:]))
    return reads


def test_every_value_a_template_reads_is_one_the_schema_knows() -> None:
    reads = _template_reads()
    assert ("config", "nvidia", "hookPath") in reads  # read through an alias
    assert sorted(".".join(p) for p in reads if SCHEMA.at(p) is None) == []


def test_the_certificate_modes_are_the_ones_the_template_renders() -> None:
    template = (CHART / "templates" / "webhook-certificates.yaml").read_text()
    rendered = re.findall(r'eq \.Values\.webhook\.certificates\.mode "(\w+)"', template)
    assert node("webhook", "certificates", "mode")["enum"] == rendered


@given(st.text(alphabet="1g.b", max_size=6))
@example("1g.5gb")
@example("1g.")
@example("g.5gb")
@example("12g.x.y")
def test_a_mig_profile_name_is_taken_as_the_config_takes_it(text: str) -> None:
    taken = _nvidia_takes(migProfileAllowlist=[{"models": ["A100"], "profiles": [text]}])
    pattern = SCHEMA.resolve(node(*NVIDIA, "migProfileAllowlist"))["items"]["properties"]["profiles"]
    assert (re.fullmatch(pattern["items"]["pattern"], text) is not None) == taken, text
