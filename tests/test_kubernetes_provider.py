"""KubernetesProvider against the SIMULATED Kubernetes API server in tests/k8s_sim: no
real API server can run here. The simulator speaks the pods API over real HTTP (the
official client talks to it), rate-limits with 429s, schedules and pulls with delays,
and runs a real sandmand process per pod on the pod's loopback address (no isolation:
those daemons are host processes, so these tests only run harmless commands)."""

import asyncio
import json
import signal
import time
import urllib.request
import uuid

import pytest
import ray

import sandman_ray as sandman
from sandman_ray import DaemonClient, NotSupported, ProviderError
from sandman_ray.providers.kubernetes.provider import (
    KubernetesProvider, label_value, merge, pod_name)
from sandman_ray.spec import SandboxSpec
from conftest import (
    RAY_NAMESPACE, free_port, holding_driver, restart_keeps_specs, shared_ray, unique_pool,
    wait_until)
from k8s_sim import SimConfig, start_process

IMAGE = "docker.io/library/debian:12"


class Sim:
    def __init__(self, url, proc, port):
        self.url, self.proc, self.port = url, proc, port

    def stats(self):
        return json.loads(urllib.request.urlopen(self.url + "/sim/stats").read())

    def configure(self, **settings):
        request = urllib.request.Request(self.url + "/sim/config", method="POST",
                                         data=json.dumps(settings).encode(),
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request).read())

    def pods(self, pool):
        selector = "sandman.pool=%s" % label_value(pool)
        url = self.url + "/api/v1/namespaces/default/pods?labelSelector=" + selector
        return json.loads(urllib.request.urlopen(url).read())["items"]


@pytest.fixture(scope="module")
def sim():
    port = free_port()
    url, proc = start_process(SimConfig(nodes=2, daemons="real", daemon_port=port,
                                        pull_s=0.3, start_s=0.05))
    yield Sim(url, proc, port)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


@pytest.fixture(scope="module")
def cluster(sim):
    yield shared_ray()


@pytest.fixture(autouse=True)
def default_behaviour(sim):
    yield
    sim.configure(api_qps=200.0, api_burst=400, stuck_nodes=[], bad_images=[], slow_creates=0)


def provider(sim, **kw):
    kw.setdefault("pending_timeout_s", 20.0)
    return KubernetesProvider(host=sim.url, bundle_image="sandman-test/bundle:1",
                              daemon_port=sim.port, **kw)


def make_pool(sim, provider_kw=None, **config):
    config.setdefault("reuse", "delete")
    return unique_pool(provider(sim, **(provider_kw or {})), "k", **config)


def run(coro):
    return asyncio.run(coro)


def test_names_labels_and_templates():
    assert label_value("ok-name_1.x") == "ok-name_1.x"
    long = label_value("x" * 80)
    assert len(long) <= 63 and long[0].isalnum() and long[-1].isalnum()
    assert label_value("a b") != label_value("a-b")
    name = pod_name("My Pool!", "sbx-ABC")
    assert len(name) <= 63 and name == name.lower() and name.startswith("sandman-my-pool")
    merged = merge({"spec": {"containers": [{"name": "sandbox", "env": [1]}], "x": 1}},
                   {"spec": {"containers": [{"securityContext": {"runAsNonRoot": True}}],
                             "runtimeClassName": "gvisor"}})
    assert merged["spec"]["containers"][0] == {"name": "sandbox", "env": [1],
                                               "securityContext": {"runAsNonRoot": True}}
    assert merged["spec"]["runtimeClassName"] == "gvisor" and merged["spec"]["x"] == 1
    with pytest.raises(ValueError, match="pod_template must be a dict"):
        KubernetesProvider(pod_template=["not", "a", "pod"])


def test_pod_spec_is_a_valid_pod_and_carries_no_token_in_labels(sim):
    from kubernetes.client import ApiClient, V1Pod
    p = provider(sim, pod_template={"spec": {"runtimeClassName": "gvisor",
                                             "tolerations": [{"key": "sandbox",
                                                              "operator": "Exists"}]}})
    p.bind("spec-pool")
    pod = p._pod("sbx-1", SandboxSpec(image=IMAGE, cpu=0.5, memory="1Gi", user="1000",
                                      env={"A": "b"}), {"team": "rl"}, "secret-token")
    model = ApiClient()._ApiClient__deserialize(pod, V1Pod) \
        if hasattr(ApiClient, "_ApiClient__deserialize") else V1Pod.from_dict(pod)
    assert model.spec.runtime_class_name == "gvisor"
    assert model.spec.containers[0].resources.limits == {"cpu": "500m", "memory": str(2 ** 30)}
    assert "secret-token" not in json.dumps(pod["metadata"])
    assert pod["metadata"]["labels"]["sandman.pool"] == "spec-pool"
    assert pod["spec"]["initContainers"][0]["image"] == "sandman-test/bundle:1"


def test_sandbox_pod_through_the_public_api_then_deleted(cluster, sim):
    pool = make_pool(sim)
    try:
        with sandman.sandbox(IMAGE, pool=pool) as sb:
            assert ray.get(sb.exec.remote("echo from-pod")).stdout == b"from-pod\n"
            ray.get(sb.run.remote("export K=8s"))
            assert ray.get(sb.run.remote("echo $K")).stdout == b"8s\n"
            pods = sim.pods(pool)
            assert len(pods) == 1 and pods[0]["status"]["phase"] == "Running"
            assert pods[0]["metadata"]["labels"]["sandman.owner"] == "sandman-ray"
        wait_until(lambda: sim.pods(pool) == [], timeout=10, what="the released pod's deletion")
    finally:
        sandman.shutdown_pool(pool)


def test_a_restarted_pool_keeps_each_pod_s_whole_spec(cluster, sim):
    """The spec lives in the pod's annotation: the provider has no memory of its own."""
    pool = make_pool(sim)
    try:
        restart_keeps_specs(pool, sandman.SandboxSpec(image=IMAGE, cpu=1, memory="256Mi", env={"SPEC_CHECK": "kept"},
                               ttl_s=600, labels={"team": "rl"}))
    finally:
        sandman.shutdown_pool(pool)


def test_a_storm_of_429s_fails_no_acquire(cluster, sim):
    pool = make_pool(sim, max_starting=32)
    before = sim.stats().get("throttled", 0)
    sim.configure(api_qps=4.0, api_burst=4)
    try:
        async def burst():
            handles = await asyncio.gather(*[sandman.acquire_async(IMAGE, pool=pool, timeout=120)
                                             for _ in range(12)])
            results = await asyncio.gather(*[h.exec.remote("true") for h in handles])
            await asyncio.gather(*[sandman.release_async(h) for h in handles])
            return results
        results = run(burst())
        assert [r.exit_code for r in results] == [0] * 12
        assert sim.stats()["throttled"] > before  # the server did push back
        status = ray.get(sandman.get_pool(pool).status.remote())
        assert status["stats"]["create_failures"] == 0
        assert status["stats"]["throttled"] > 0  # and the pool heard it
    finally:
        sim.configure(api_qps=200.0, api_burst=400)
        sandman.shutdown_pool(pool)
    wait_until(lambda: sim.pods(pool) == [], timeout=20, what="every pod of the pool deleted")


def test_a_timed_out_create_is_not_duplicated(cluster, sim):
    p = provider(sim, request_timeout_s=1.0).bind("slow-" + uuid.uuid4().hex[:6])
    sim.configure(slow_creates=1, slow_create_s=3.0)
    conflicts = sim.stats().get("conflicts", 0)
    try:
        with pytest.raises(ProviderError) as err:
            run(p.create("sbx-1", SandboxSpec(image=IMAGE), {}))
        assert err.value.kind == "transient"
        info = run(p.create("sbx-1", SandboxSpec(image=IMAGE), {}))  # what the pool does next
        assert len(sim.pods(p.pool)) == 1
        assert sim.stats()["conflicts"] == conflicts + 1
        client = DaemonClient(info.address, info.token)
        assert client.exec("echo adopted").stdout == b"adopted\n"
        client.close()
    finally:
        assert run(p.shutdown()) == 1


def test_snapshots_and_pauses_are_refused_saying_what_they_would_need(sim):
    p = provider(sim).bind("nosnap-" + uuid.uuid4().hex[:6])
    assert p.supports_snapshots is False
    try:
        info = run(p.create("sbx-1", SandboxSpec(image=IMAGE), {}))
        refusals = [(p.snapshot("sbx-1", "before"), r"snapshot 'before' of sandbox sbx-1.*"
                     r"container-image build.*registry the cluster pulls from.*VolumeSnapshots"),
                    (p.delete_snapshot("before"), r"no snapshots"),
                    (p.pause("sbx-1"), r"pause sandbox sbx-1.*kubelet to freeze the pod's cgroup"),
                    (p.resume("sbx-1"), r"resume sandbox sbx-1")]
        for call, reason in refusals:
            with pytest.raises(NotSupported, match=reason) as err:
                run(call)
            assert err.value.kind == "fatal"
        assert run(p.snapshots()) == []
        with DaemonClient(info.address, info.token) as client:  # the pod is untouched
            assert client.exec("echo still-here").stdout == b"still-here\n"
    finally:
        assert run(p.shutdown()) == 1


def test_stuck_pods_are_replaced_and_bad_images_fail_with_the_reason(cluster, sim):
    sim.configure(stuck_nodes=["sim-node-0"], bad_images=["docker.io/sandman/missing:1"])
    pool = make_pool(sim, provider_kw={"pending_timeout_s": 2.0})
    try:
        deletes = sim.stats().get("deletes", 0)
        handles = [sandman.acquire(IMAGE, pool=pool, timeout=60) for _ in range(2)]
        assert [ray.get(h.exec.remote("true")).exit_code for h in handles] == [0, 0]
        assert all(p["spec"]["nodeName"] == "sim-node-1" for p in sim.pods(pool))
        assert sim.stats()["deletes"] > deletes  # a pod stuck on node 0 was replaced
        started = time.monotonic()
        with pytest.raises(ProviderError, match="ErrImagePull|ImagePullBackOff"):
            sandman.acquire("docker.io/sandman/missing:1", pool=pool, timeout=60)
        assert time.monotonic() - started < 30
        for h in handles:
            sandman.release(h)
    finally:
        sandman.shutdown_pool(pool)


def test_stuck_policy_fail_fails_the_acquire_with_the_reason(cluster, sim):
    sim.configure(stuck_nodes=["sim-node-0", "sim-node-1"])
    pool = make_pool(sim, provider_kw={"pending_timeout_s": 1.0, "stuck_policy": "fail"})
    try:
        with pytest.raises(ProviderError, match="ContainerCreating.*deleted$"):
            sandman.acquire(IMAGE, pool=pool, timeout=60)
        wait_until(lambda: sim.pods(pool) == [], timeout=10, what="the stuck pod's deletion")
    finally:
        sandman.shutdown_pool(pool)


def test_sigkilled_client_leaves_no_pod(cluster, sim):
    pool = make_pool(sim)
    try:
        proc = holding_driver(cluster, RAY_NAMESPACE, pool, IMAGE, 3)
        assert len(sim.pods(pool)) == 3
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: ray.get(sandman.get_pool(pool).status.remote())["states"]["leased"] == 0,
                   timeout=10, what="the watchdog to reclaim the dead client's leases")
        wait_until(lambda: sim.pods(pool) == [], timeout=5,
                   what="every pod of the dead client deleted")
    finally:
        sandman.shutdown_pool(pool)
