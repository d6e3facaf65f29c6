"""The Secret and the caBundle, written through a ``KubeApi`` (an in-memory API server here; the
real one in tests/integration/webhook): reuse, renewal, creation, and errors that name the object."""

from __future__ import annotations

import base64
import copy
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import pytest

from hamipy.kube.errors import Conflict, KubeError, NotFound
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


class FakeApi:
    """Objects by path; POST creates (Conflict if there), PUT replaces (Conflict on a stale
    resourceVersion), PATCH applies a JSON patch's ``add`` operations after its ``test``;
    ``fail`` maps (method, path) to an error raised instead."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.fail: dict[tuple[str, str], KubeError] = {}
        self._version = 0

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._version)
        obj["metadata"].setdefault("uid", f"uid-{self._version}")
        return obj

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "application/json",
        timeout_s: float = 10.0,
    ) -> Any:
        self.calls.append((method, path, content_type))
        if (method, path) in self.fail:
            raise self.fail[(method, path)]
        if method == "POST":
            path = f"{path}/{body['metadata']['name']}"
            if path in self.objects:
                raise Conflict(f"POST {path}: HTTP 409: exists", status=409)
            self.objects[path] = self._stamp(body)
            return self.objects[path]
        if path not in self.objects:
            raise NotFound(f"{method} {path}: HTTP 404: not found", status=404)
        current = self.objects[path]
        if method == "GET":
            return copy.deepcopy(current)
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise Conflict(f"PUT {path}: HTTP 409: modified", status=409)
            self.objects[path] = self._stamp(body)
            return self.objects[path]
        assert (method, content_type) == ("PATCH", "application/json-patch+json")
        test, *adds = body
        assert (test["op"], test["path"]) == ("test", "/metadata/resourceVersion")
        if test["value"] != current["metadata"]["resourceVersion"]:
            raise KubeError(f"PATCH {path}: HTTP 422: test failed", status=422)
        patched = copy.deepcopy(current)
        for op in adds:
            _, _, index, _, _ = op["path"].split("/")
            patched["webhooks"][int(index)]["clientConfig"]["caBundle"] = op["value"]
        self.objects[path] = self._stamp(patched)
        return self.objects[path]

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]], inactivity_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        raise AssertionError(f"certificate setup watches nothing (asked for {path})")

    def secret_bundle(self) -> Any:
        return bundle_from_secret(self.objects[SECRET_PATH]["data"])

    def ca_bundles(self) -> list[bytes]:
        hooks = self.objects[CONFIG_PATH]["webhooks"]
        return [base64.b64decode(hook["clientConfig"]["caBundle"]) for hook in hooks]


def configuration() -> dict[str, Any]:
    return webhook_configuration(service_name="hamipy-webhook", service_namespace=NAMESPACE)


async def ensure(api: FakeApi, **kwargs: Any) -> Any:
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
        api = FakeApi()
        api.objects[CONFIG_PATH] = api._stamp(
            {**configuration(), "metadata": {"name": "hamipy-webhook", "uid": "u-1"}}
        )
        await ensure(api)
        (owner,) = api.objects[SECRET_PATH]["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "name": "hamipy-webhook",
            "uid": "u-1",
        }

    async def test_a_current_secret_gains_the_owner_and_keeps_its_certificate(self) -> None:
        api = FakeApi()
        first, _ = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        api.objects[CONFIG_PATH] = api._stamp(
            {**configuration(), "metadata": {"name": "hamipy-webhook", "uid": "u-2"}}
        )
        bundle, renewed, _ = await ensure(api)
        assert (bundle, renewed) == (first, False)
        assert api.secret_bundle() == first
        assert [r["uid"] for r in api.objects[SECRET_PATH]["metadata"]["ownerReferences"]] == ["u-2"]
        writes = len([c for c in api.calls if c[0] == "PUT"])
        await ensure(api)  # owned already: nothing written
        assert len([c for c in api.calls if c[0] == "PUT"]) == writes

    async def test_without_a_configuration_the_secret_has_no_owner(self) -> None:
        api = FakeApi()
        await ensure(api, create_configuration=configuration())
        assert "ownerReferences" not in api.objects[SECRET_PATH]["metadata"]


class TestSecret:
    async def test_a_missing_secret_is_created_as_a_tls_secret(self) -> None:
        api = FakeApi()
        bundle, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        assert renewed
        secret = api.objects[SECRET_PATH]
        assert secret["type"] == "kubernetes.io/tls"
        assert api.secret_bundle() == bundle

    async def test_a_good_certificate_is_kept_and_force_replaces_the_version_read(self) -> None:
        api = FakeApi()
        first, _ = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        again, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        assert (again, renewed) == (first, False)
        fresh, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES, force=True
        )
        assert renewed
        assert fresh.ca_pem != first.ca_pem
        assert api.secret_bundle() == fresh
        assert [c[0] for c in api.calls] == ["GET", "POST", "GET", "GET", "PUT"]

    async def test_a_certificate_missing_a_name_is_renewed(self) -> None:
        api = FakeApi()
        await ensure_secret(api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES[:1])
        bundle, renewed = await ensure_secret(
            api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES
        )
        assert renewed
        assert api.secret_bundle() == bundle

    @pytest.mark.parametrize(
        ("method", "message"),
        [
            pytest.param("GET", "cannot read Secret hami-system/hamipy-webhook-tls", id="read"),
            pytest.param("POST", "cannot write Secret hami-system/hamipy-webhook-tls", id="write"),
        ],
    )
    async def test_api_errors_name_the_secret(self, method: str, message: str) -> None:
        api = FakeApi()
        path = SECRET_PATH if method == "GET" else SECRET_PATH.rsplit("/", 1)[0]
        api.fail[(method, path)] = KubeError(f"{method} {path}: HTTP 403: forbidden", status=403)
        with pytest.raises(CertificateSetupError, match=message) as info:
            await ensure_secret(api, namespace=NAMESPACE, secret_name="hamipy-webhook-tls", dns_names=NAMES)
        assert "HTTP 403: forbidden" in str(info.value)
        assert isinstance(info.value.__cause__, KubeError)


class TestCaBundle:
    async def test_a_missing_configuration_is_created_with_the_bundle(self) -> None:
        api = FakeApi()
        bundle, renewed, patched = await ensure(api, create_configuration=configuration())
        assert (renewed, patched) == (True, True)
        assert api.ca_bundles() == [bundle.ca_pem]

    async def test_a_missing_configuration_without_create_is_an_error(self) -> None:
        with pytest.raises(CertificateSetupError, match="hamipy-webhook does not exist"):
            await patch_ca_bundle(FakeApi(), configuration_name="hamipy-webhook", ca_pem=b"ca")

    async def test_only_a_different_bundle_is_patched(self) -> None:
        api = FakeApi()
        bundle, _, _ = await ensure(api, create_configuration=configuration())
        again, renewed, patched = await ensure(api, create_configuration=configuration())
        assert (again, renewed, patched) == (bundle, False, False)
        assert ("PATCH", CONFIG_PATH, "application/json-patch+json") not in api.calls

        fresh, renewed, patched = await ensure(api, force=True)
        assert (renewed, patched) == (True, True)
        assert api.ca_bundles() == [fresh.ca_pem]

    async def test_a_failed_patch_names_the_configuration(self) -> None:
        api = FakeApi()
        await ensure(api, create_configuration=configuration())
        api.fail[("PATCH", CONFIG_PATH)] = KubeError(f"PATCH {CONFIG_PATH}: HTTP 422: failed", status=422)
        other = generate_certificates(dns_names=NAMES).ca_pem
        with pytest.raises(CertificateSetupError, match="cannot patch caBundle of MutatingWebhookConfig"):
            await patch_ca_bundle(api, configuration_name="hamipy-webhook", ca_pem=other)
