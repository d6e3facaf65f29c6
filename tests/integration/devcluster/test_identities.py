"""Rights granted to a dev cluster's ServiceAccounts are in force when ``grant_role`` returns: the
security tests act as those accounts at once, and a binding the authorizer has not seen yet would
refuse them (403) at random."""

from __future__ import annotations

from typing import Any

import pytest

from hamipy.devcluster.errors import WaitTimeout
from hamipy.devcluster.identities import TENANT_POD_RULES, grant_role, issue_identity, rights_in_force
from hamipy.kube.client import RawKube

pytestmark = pytest.mark.integration


async def test_a_granted_role_is_in_force_when_grant_role_returns(
    devcluster: Any, kube_client: Any, namespace: str
) -> None:
    access = devcluster.access
    tenant = await issue_identity(
        kube_client, namespace=namespace, name="tenant", server=access.server, ca_file=access.ca_file
    )
    await grant_role(kube_client, namespace=namespace, account="tenant", rules=TENANT_POD_RULES)
    async with tenant.api_client() as api:
        # Allowed at once: no retry, no wait.
        listed = await RawKube(api).request("GET", f"/api/v1/namespaces/{namespace}/pods")
    assert listed["items"] == []
    # What the role does not give is not waited for in vain: the wait says whose rights are missing.
    nodes = ({"apiGroups": [""], "resources": ["nodes"], "verbs": ["delete"]},)
    with pytest.raises(WaitTimeout, match=f"{namespace}/tenant"):
        await rights_in_force(kube_client, nodes, [(namespace, "tenant")], namespace=None, timeout_s=0.5)
