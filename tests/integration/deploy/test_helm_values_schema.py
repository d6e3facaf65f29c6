"""The chart's values schema as the pinned helm applies it (no cluster: ``helm template`` validates
the values as ``helm install`` and ``helm upgrade`` do, before anything reaches the API server). A
bad value is refused with its path named, instead of a pod that crash-loops on it; the defaults and
every setting the docs show pass; a value the schema does not require may be left out, and one it
requires is refused when left out. tests/unit/deploy/test_values_schema.py holds the schema against
the code."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from chart_values import helm_lint, helm_template, load_schema, pointer, value_paths

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = load_schema()
REFUSED = "values don't meet the specifications of the schema(s)"


def assert_refused(proc: subprocess.CompletedProcess[str], path: str, reason: str) -> None:
    assert proc.returncode != 0, f"rendered: {proc.stdout[:500]}"
    assert REFUSED in proc.stderr, proc.stderr
    assert f"at '{path}'" in proc.stderr, proc.stderr
    assert reason in proc.stderr, proc.stderr


# -- bad values are refused, naming the value -----------------------------------------------------


# id -> (helm's arguments, the value's path as helm names it, what it says)
REFUSALS: dict[str, tuple[list[str], str, str]] = {
    "unknown-node-policy": (
        ["--set", "config.nodeSchedulerPolicy=fastest"],
        "/config/nodeSchedulerPolicy",
        "value must be one of 'binpack', 'spread'",
    ),
    "unknown-gpu-policy-in-a-chain": (
        ["--set-string", r"config.gpuSchedulerPolicy=binpack\,fastest"],
        "/config/gpuSchedulerPolicy",
        "'binpack,fastest' does not match pattern",
    ),
    "unknown-gpu-policy-in-a-list": (
        ["--set-json", 'config.gpuSchedulerPolicy=["binpack", "fastest"]'],
        "/config/gpuSchedulerPolicy/1",
        "value must be one of 'binpack', 'spread', 'topology-aware', 'mutex', 'numa'",
    ),
    "unknown-core-policy": (
        ["--set", "config.nvidia.gpuCorePolicy=sometimes"],
        "/config/nvidia/gpuCorePolicy",
        "value must be one of 'default', 'force', 'disable'",
    ),
    "unknown-device-list-strategy": (
        ["--set", "config.nvidia.deviceListStrategy=cdi"],
        "/config/nvidia/deviceListStrategy",
        "value must be one of 'envvar', 'cdi-cri'",
    ),
    "negative-replicas": (["--set", "webhook.replicas=-1"], "/webhook/replicas", "minimum: got -1, want 1"),
    "no-extender": (["--set", "extender.replicas=0"], "/extender/replicas", "minimum: got 0, want 1"),
    "replicas-in-words": (
        ["--set-string", "scheduler.replicas=two"],
        "/scheduler/replicas",
        "got string, want integer",
    ),
    "two-schedulers-without-election": (
        ["--set", "scheduler.leaderElect=false", "--set", "scheduler.replicas=2"],
        "/scheduler/replicas",
        "maximum: got 2, want 1",
    ),
    "port": (["--set", "extender.port=70000"], "/extender/port", "maximum: got 70,000, want 65,535"),
    "percentage": (
        ["--set", "config.nvidia.defaultCores=101"],
        "/config/nvidia/defaultCores",
        "maximum: got 101, want 100",
    ),
    "split-count": (
        ["--set", "config.nvidia.deviceSplitCount=0"],
        "/config/nvidia/deviceSplitCount",
        "minimum: got 0, want 1",
    ),
    "webhook-timeout": (
        ["--set", "webhook.timeoutSeconds=31"],
        "/webhook/timeoutSeconds",
        "maximum: got 31, want 30",
    ),
    "register-interval-past-the-handshake-timeout": (
        ["--set", "devicePlugin.registerIntervalSeconds=60"],
        "/devicePlugin/registerIntervalSeconds",
        "exclusiveMaximum: got 60, want 60",
    ),
    "switch-in-words": (
        ["--set-string", "extender.preemption=yes"],
        "/extender/preemption",
        "got string, want boolean",
    ),
    "empty-image-registry": (["--set", "image.registry="], "/image/registry", "minLength: got 0, want 1"),
    "no-image-registry": (["--set", "image.registry=null"], "/image", "missing property 'registry'"),
    "no-scheduler-repository": (
        ["--set", "scheduler.image.repository=null"],
        "/scheduler/image",
        "missing property 'repository'",
    ),
    "unknown-certificate-mode": (
        ["--set", "webhook.certificates.mode=manual"],
        "/webhook/certificates/mode",
        "value must be one of 'selfSigned', 'certManager'",
    ),
    "no-certificate-mode": (
        ["--set", "webhook.certificates.mode=null"],
        "/webhook/certificates",
        "missing property 'mode'",
    ),
    "issuer-without-a-name": (
        [
            "--set",
            "webhook.certificates.mode=certManager",
            "--set",
            "webhook.certificates.certManager.issuerRef.kind=ClusterIssuer",
        ],
        "/webhook/certificates/certManager/issuerRef",
        "properties 'name' required, if 'kind' exists",
    ),
    "invalid-secret-name": (
        [
            "--set",
            "extender.tls.serverSecret=Extender_TLS",
            "--set",
            "extender.tls.clientSecret=scheduler-tls",
        ],
        "/extender/tls/serverSecret",
        "'Extender_TLS' does not match pattern",
    ),
    "cdi-without-its-directory": (
        ["--set", "config.nvidia.deviceListStrategy=cdi-cri", "--set", "config.nvidia.cdiSpecDir=null"],
        "/config/nvidia",
        "missing property 'cdiSpecDir'",
    ),
    "hook-path-climbing-out": (
        ["--set", "config.nvidia.hookPath=/usr/local/../lib"],
        "/config/nvidia/hookPath",
        "'/usr/local/../lib' does not match pattern",
    ),
    "resource-name-without-a-domain": (
        ["--set", "config.nvidia.resourceCountName=gpu"],
        "/config/nvidia/resourceCountName",
        "'gpu' does not match pattern",
    ),
    "unknown-top-level-key": (["--set", "replicas=3"], "", "additional properties 'replicas' not allowed"),
    "misspelt-key": (
        ["--set", "webhook.replica=3"],
        "/webhook",
        "additional properties 'replica' not allowed",
    ),
    "misspelt-config-key": (
        ["--set", "config.nvidia.deviceSplitCont=4"],
        "/config/nvidia",
        "additional properties 'deviceSplitCont' not allowed",
    ),
    "a-value-no-template-reads": (
        ["--set", "devicePlugin.affinity.nodeAffinity.x=1"],
        "/devicePlugin",
        "additional properties 'affinity' not allowed",
    ),
}


@pytest.mark.parametrize(("args", "path", "reason"), REFUSALS.values(), ids=REFUSALS.keys())
def test_a_bad_value_is_refused_naming_it(args: list[str], path: str, reason: str) -> None:
    assert_refused(helm_template(*args), path, reason)


def test_lint_refuses_what_template_refuses() -> None:
    proc = helm_lint("--set", "webhook.replicas=-1")
    assert proc.returncode != 0
    assert "at '/webhook/replicas': minimum: got -1, want 1" in proc.stdout


def test_the_templates_own_refusals_stand_without_the_schema() -> None:
    """``--skip-schema-validation`` skips the schema; the templates still refuse what they cannot
    render, naming the same value."""
    proc = helm_template("--skip-schema-validation", "--set", "webhook.certificates.mode=manual")
    assert proc.returncode != 0
    assert "webhook.certificates.mode must be selfSigned or certManager" in proc.stderr


def test_the_refusal_install_md_shows_is_the_one_helm_prints() -> None:
    text = (ROOT / "docs" / "install.md").read_text()
    shown = re.search(r"```\n(Error: values don't meet.*?)```", text, re.DOTALL)
    assert shown is not None
    proc = helm_template("--set", "webhook.replicas=0", "--set", "webhok.port=8443")
    for line in shown.group(1).splitlines():
        assert line in proc.stderr.splitlines(), proc.stderr


# -- good values pass ------------------------------------------------------------------------------


def _documented_settings() -> list[tuple[str, str]]:
    """(page, path=value) for every value setting the docs show: ``--set path=value`` and
    `` `path=value` `` whose path starts with a top-level value (``<service>``: each service that
    has it; ``<new>``: a tag)."""
    top = "|".join(sorted(SCHEMA.document["properties"])) + "|<service>"
    setting = re.compile(rf"(?:--set |`)((?:{top})(?:\.\w+)+=[^\s`]+)")
    services = ["webhook", "extender", "scheduler", "devicePlugin", "monitor"]
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in setting.finditer(page.read_text()):
            text = match.group(1).replace("<new>", "0.2.0")
            if text.startswith("<service>."):
                rest = text.removeprefix("<service>.")
                key = tuple(rest.split("=", 1)[0].split("."))
                found += [(page.name, f"{s}.{rest}") for s in services if SCHEMA.at((s, *key)) is not None]
            else:
                found.append((page.name, text))
    return list(dict.fromkeys(found))


DOCUMENTED = _documented_settings()


def test_the_docs_show_settings() -> None:
    assert {"image.registry=registry.example.com/hami-py", "webhook.certificates.mode=certManager"} <= {
        setting for _, setting in DOCUMENTED
    }


def test_the_default_values_pass() -> None:
    proc = helm_template()
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("page", "setting"), DOCUMENTED, ids=[f"{p}:{s}" for p, s in DOCUMENTED])
def test_every_documented_setting_passes(page: str, setting: str) -> None:
    proc = helm_template("--set", setting)
    assert proc.returncode == 0, proc.stderr


# -- required values ------------------------------------------------------------------------------


def test_a_value_may_be_left_out_unless_the_schema_requires_it() -> None:
    """Each value of values.yaml left out (``--set <path>=null``): refused naming it where the
    schema requires it; otherwise the chart renders without it. A value whose absence would break
    the templates is thus required."""
    paths = value_paths(SCHEMA)
    assert len(paths) > 50
    broken = []
    for path in paths:
        proc = helm_template("--set", f"{'.'.join(path)}=null")
        if SCHEMA.required(path):
            if f"at '{pointer(path[:-1])}': missing property '{path[-1]}'" not in proc.stderr:
                broken.append(f"{'.'.join(path)} is required but was not refused: {proc.stderr}")
        elif proc.returncode != 0:
            broken.append(f"{'.'.join(path)} is optional but the chart fails without it: {proc.stderr}")
    assert broken == []
