"""Templates end to end (server + agent + runc + a registry wanting a login): a pod from a
template pulls the private image with the template's registry credentials (the agent has
none of its own) and runs with the template's entrypoint override."""

from __future__ import annotations

from gpucloud.core.spec import RegistryAuthAddRequest, TemplateCreateRequest
from gpucloud.images.testing import busybox_image
from tests.e2e.cluster import Cloud
from tests.fixtures.registry import USER, Registry


def test_pod_from_template_pulls_with_its_credentials_and_entrypoint(
    cloud: Cloud, basic_auth_registry: Registry
) -> None:
    host = basic_auth_registry.host
    busybox_image().push(host, "e2e/tpl-private:1", credentials=basic_auth_registry.credentials)
    cloud.agent("gpu-a")  # no registries.json: only the pod's login can pull this image
    cloud.client.add_registry_auth(RegistryAuthAddRequest(
        name="private", username=USER.username, password=USER.password, registry=host))
    cloud.client.create_template(TemplateCreateRequest(
        name="echoer", image=f"{host}/e2e/tpl-private:1", entrypoint=["/bin/sh", "-c"],
        command=["echo from-template"], registry_auth="private"))
    cloud.client.create_pod({"name": "from-tpl", "template": "echoer"})
    cloud.client.create_pod({"name": "override", "template": "echoer",
                             "command": ["echo $((6 * 7))"]})
    # another tag (an image already in the node's store is not pulled again): no login, 401
    cloud.client.create_pod({"name": "anonymous", "image": f"{host}/e2e/tpl-private:2",
                             "command": ["true"]})
    pod = cloud.wait_pod("from-tpl", "Succeeded", "Failed")
    assert (pod.phase, pod.template, pod.registry_auth) == ("Succeeded", "echoer", "private")
    assert cloud.wait_log("from-tpl", "from-template") == "from-template\n"
    assert cloud.wait_pod("override", "Succeeded", "Failed").phase == "Succeeded"
    assert cloud.wait_log("override", "42") == "42\n"
    refused = cloud.wait_pod("anonymous", "Failed", "Succeeded")
    assert refused.reason == "RegistryUnauthorized"
