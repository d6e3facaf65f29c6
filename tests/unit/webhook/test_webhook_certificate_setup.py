"""The Secret and the caBundle, written through a ``KubeApi`` (an in-memory API server here; the
real one in tests/integration/webhook): reuse, renewal, creation, and errors that name the object."""

from __future__ import annotations

import base64
from typing import Any, Final

import pytest
from fake_kube import FakeKube

from hamipy.kube.errors import KubeError
from hamipy.webhook.certificate_setup import (
    CertificateSetupError,
    ensure_certificates,
    ensure_secret,
    patch_ca_bundle,
)
from hamipy.webhook.certs import bundle_from_secret, generate_certificates, service_dns_names
from hamipy.webhook.registration import webhook_configuration

NAMESPACE: Final = "hami-system"
SECRET_PATH: Final = f"/api/v1/namespaces/{NAMESPACE}/secrets/hamipy-webhook-tls"
CONFIGURATIONS: Final = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
CONFIG_PATH: Final = f"{CONFIGURATIONS}/hamipy-webhook"
NAMES: Final = service_dns_names("hamipy-webhook", NAMESPACE)


def secret_bundle(api: FakeKube) -> Any:
    return bundle_from_secret(api.get(SECRET_PATH)["data"])


def ca_bundles(api: FakeKube) -> list[bytes]:
    hooks = api.get(CONFIG_PATH)["webhooks"]
    return [base64.b64decode(hook["clientConfig"]["caBundle"]) for hook in hooks]


def configuration() -> dict[str, Any]:
    return webhook_configuration(service_name="hamipy-webhook", service_namespace=NAMESPACE)


async def ensure(api: FakeKube, **kwargs: Any) -> Any:
    return await ensure_certificates(
        api,
        namespace=NAMESPACE,
        secret_name="hamipy-webhook-tls",
        service_name="hamipy-webhook",
        configuration_name="hamipy-webhook",
        **kwargs,
    )


class TestOwner:
    """The Secret goes with the configuration that trusts its CA (``helm uninstall`` deletes that,
    garbage collection then the Secret)."""

    async def test_a_new_secret_is_owned_by_the_existing_configuration(self) -> None:
        api = FakeKube()
        api.add({**configuration(), "metadata": {"name": "hamipy-webhook", "uid": "u-1"}})
        await ensure(api)
        (owner,) = api.get(SECRET_PATH)["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "name": "hamipy-webhook",
            "uid": "u-1",
        }

    async def test_a_current_secret_gains_the_owner_and_keeps_its_certificate(self) -> None:
        api = FakeKube()
        first, _ = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        api.add({**configuration(), "metadata": {"name": "hamipy-webhook", "uid": "u-2"}})
        bundle, renewed, _ = await ensure(api)
        assert (bundle, renewed) == (first, False)
        assert secret_bundle(api) == first
        assert [r["uid"] for r in api.get(SECRET_PATH)["metadata"]["ownerReferences"]] == ["u-2"]
        writes = len([c for c in api.calls if c[0] == "PUT"])
        await ensure(api)  # owned already: nothing written
        assert len([c for c in api.calls if c[0] == "PUT"]) == writes

    async def test_without_a_configuration_the_secret_has_no_owner(self) -> None:
        api = FakeKube()
        await ensure(api, create_configuration=configuration())
        assert "ownerReferences" not in api.get(SECRET_PATH)["metadata"]


class TestSecret:
    async def test_a_missing_secret_is_created_as_a_tls_secret(self) -> None:
        api = FakeKube()
        bundle, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        assert renewed
        secret = api.get(SECRET_PATH)
        assert secret["type"] == "kubernetes.io/tls"
        assert secret_bundle(api) == bundle

    async def test_a_good_certificate_is_kept_and_force_replaces_the_version_read(self) -> None:
        api = FakeKube()
        first, _ = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        again, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        assert (again, renewed) == (first, False)
        read = api.get(SECRET_PATH)["metadata"]["resourceVersion"]
        fresh, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES, force=True
        )
        assert renewed
        assert fresh.ca_pem != first.ca_pem
        assert secret_bundle(api) == fresh
        assert [c[0] for c in api.calls] == ["GET", "POST", "GET", "GET", "PUT"]
        assert api.requests[-1].body["metadata"]["resourceVersion"] == read, "a write since is a conflict"

    async def test_a_certificate_missing_a_name_is_renewed(self) -> None:
        api = FakeKube()
        await ensure_secret(api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES[:1])
        bundle, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        assert renewed
        assert secret_bundle(api) == bundle

    @pytest.mark.parametrize(
        ("method", "message"),
        [
            pytest.param("GET", "cannot read Secret hami-system/hamipy-webhook-tls", id="read"),
            pytest.param("POST", "cannot write Secret hami-system/hamipy-webhook-tls", id="write"),
        ],
    )
    async def test_api_errors_name_the_secret(self, method: str, message: str) -> None:
        api = FakeKube()
        path = SECRET_PATH if method == "GET" else SECRET_PATH.rsplit("/", 1)[0]
        api.fail(KubeError(f"{method} {path}: HTTP 403: forbidden", status=403), method, path)
        with pytest.raises(CertificateSetupError, match=message) as info:
            await ensure_secret(api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES)
        assert "HTTP 403: forbidden" in str(info.value)
        assert isinstance(info.value.__cause__, KubeError)


class TestCaBundle:
    async def test_a_missing_configuration_is_created_with_the_bundle(self) -> None:
        api = FakeKube()
        bundle, renewed, patched = await ensure(api, create_configuration=configuration())
        assert (renewed, patched) == (True, True)
        assert ca_bundles(api) == [bundle.ca_pem]

    async def test_a_missing_configuration_without_create_is_an_error(self) -> None:
        with pytest.raises(CertificateSetupError, match="hamipy-webhook does not exist"):
            await patch_ca_bundle(FakeKube(), configuration_name="hamipy-webhook", ca_pem=b"ca")

    async def test_only_a_different_bundle_is_patched(self) -> None:
        api = FakeKube()
        bundle, _, _ = await ensure(api, create_configuration=configuration())
        again, renewed, patched = await ensure(api, create_configuration=configuration())
        assert (again, renewed, patched) == (bundle, False, False)
        assert ("PATCH", CONFIG_PATH) not in api.calls

        fresh, renewed, patched = await ensure(api, force=True)
        assert (renewed, patched) == (True, True)
        assert ca_bundles(api) == [fresh.ca_pem]

    async def test_the_patch_applies_only_to_the_version_read(self) -> None:
        api = FakeKube()
        bundle, _, _ = await ensure(api, create_configuration=configuration())
        api.race(CONFIG_PATH)  # another writer changes the configuration between the read and the patch
        other = generate_certificates(dns_names=NAMES).ca_pem
        with pytest.raises(CertificateSetupError, match=r"cannot patch caBundle .*HTTP 422"):
            await patch_ca_bundle(api, configuration_name="hamipy-webhook", ca_pem=other)
        assert ca_bundles(api) == [bundle.ca_pem]

    async def test_a_failed_patch_names_the_configuration(self) -> None:
        api = FakeKube()
        await ensure(api, create_configuration=configuration())
        api.fail(KubeError(f"PATCH {CONFIG_PATH}: HTTP 422: failed", status=422), "PATCH", CONFIG_PATH)
        other = generate_certificates(dns_names=NAMES).ca_pem
        with pytest.raises(CertificateSetupError, match="cannot patch caBundle of MutatingWebhookConfig"):
            await patch_ca_bundle(api, configuration_name="hamipy-webhook", ca_pem=other)
