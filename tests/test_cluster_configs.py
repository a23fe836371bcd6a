"""The deployment files in cluster_configs/ parse and validate: Kubernetes objects
against the official client's models (which check field types and required fields),
the KubeRay cluster's pod templates likewise, the `ray up` file against Ray's own
cluster schema."""

import json
import os
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from kubernetes import client

from sandman_ray.providers.kubernetes import KubernetesProvider
from sandman_ray.spec import SandboxSpec
from conftest import ROOT

CONFIGS = ROOT / "cluster_configs"


def documents(name):
    with open(CONFIGS / name) as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def test_every_yaml_file_parses():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert len(files) >= 5
    for path in files:
        assert documents(path.name), path


def test_rbac_grants_pods_and_nothing_more():
    sa, role, binding = documents("rbac.yaml")
    sa = client.V1ServiceAccount.from_dict(sa)
    role = client.V1Role.from_dict(role)
    binding = client.V1RoleBinding.from_dict(binding)
    assert [(r.api_groups, r.resources, sorted(r.verbs)) for r in role.rules] == [
        ([""], ["pods"], ["create", "delete", "get", "list", "watch"])]
    assert binding.role_ref.name == role.metadata.name and binding.role_ref.kind == "Role"
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", sa.metadata.name, sa.metadata.namespace)]
    assert sa.metadata.namespace == role.metadata.namespace == binding.metadata.namespace


def test_network_policy_denies_egress_and_opens_the_daemon_port():
    policy, _ = documents("networkpolicy.yaml")
    policy = client.V1NetworkPolicy.from_dict(policy)
    assert policy.spec.egress == [] and "Egress" in policy.spec.policy_types
    assert [p.port for rule in policy.spec.ingress for p in rule.ports] == [7000]


def test_sandboxes_with_network_get_out_only_where_the_local_filter_lets_them():
    """The policy for pods of SandboxSpec(network=True) refuses exactly the ranges the
    LocalProvider's filter refuses, and selects the label the provider puts on them."""
    from sandman_ray.providers.kubernetes.provider import NETWORK_LABEL
    from sandman_ray.providers.network import BLOCKED
    _, policy = documents("networkpolicy.yaml")
    policy = client.V1NetworkPolicy.from_dict(policy)
    assert policy.spec.pod_selector.match_labels == {NETWORK_LABEL: "true"}
    dns, public = policy.spec.egress
    assert sorted(p.port for p in dns.ports) == [53, 53]
    (block,) = [peer.ip_block for peer in public.to]
    assert block.cidr == "0.0.0.0/0" and sorted(block._except) == sorted(BLOCKED)
    pod = KubernetesProvider().bind("net")._pod(
        "sbx-1", SandboxSpec(image="docker.io/library/debian:12", network=True), {}, "token")
    assert pod["metadata"]["labels"][NETWORK_LABEL] == "true"
    with pytest.raises(Exception, match="NetworkPolicies"):
        KubernetesProvider().bind("net")._pod(
            "sbx-2", SandboxSpec(image="docker.io/library/debian:12", network=True,
                                 network_allow=["10.1.2.3"]), {}, "token")


def test_pod_template_makes_valid_sandbox_pods():
    (template,) = documents("sandbox-pod-template.yaml")
    provider = KubernetesProvider(pod_template=template).bind("tmpl")
    pod = provider._pod("sbx-1", SandboxSpec(image="docker.io/library/debian:12", cpu=1),
                        {}, "token")
    model = client.V1Pod.from_dict(pod)
    assert model.spec.runtime_class_name == "gvisor"
    sandbox = model.spec.containers[0]
    assert sandbox.name == "sandbox" and sandbox.command == ["/.sandman/bin/sandmand"]
    assert sandbox.security_context.allow_privilege_escalation is False
    assert model.metadata.labels["team"] == "rl" and model.metadata.labels["sandman.pool"] == "tmpl"


def test_raycluster_templates_are_valid_pods_with_the_rbac_account():
    (cluster,) = documents("raycluster.yaml")
    (sa, *_) = documents("rbac.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert cluster["spec"]["rayVersion"] == ray.__version__
    head = client.V1PodTemplateSpec.from_dict(cluster["spec"]["headGroupSpec"]["template"])
    assert head.spec.service_account_name == sa["metadata"]["name"]
    assert cluster["metadata"]["namespace"] == sa["metadata"]["namespace"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        client.V1PodTemplateSpec.from_dict(group["template"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_ray_up_file_matches_rays_cluster_schema():
    (config,) = documents("ray-up-local.yaml")
    schema_path = Path(os.path.dirname(ray.__file__)) / "autoscaler" / "ray-schema.json"
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    assert any("bubblewrap" in c for c in config["setup_commands"])


def test_a_wrong_manifest_is_caught():
    """The checks above can fail: a role whose verbs are not a list is refused."""
    _, role, _ = documents("rbac.yaml")
    role["rules"][0]["verbs"] = "get"
    with pytest.raises(Exception, match="verbs"):
        client.V1Role.from_dict(role)
