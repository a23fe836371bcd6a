"""Two Ray nodes on this machine (ray.cluster_utils.Cluster): sandboxes spread over
both nodes' agents, and each handle runs on its sandbox's node, talking to the daemon
over its unix socket there; the service (``sandman serve``) serves the leases of both
nodes, at its front and at each node's gateway."""

import os
import time
import uuid

import pytest
import ray
from ray.cluster_utils import Cluster

import sandman_ray as sandman
from conftest import ROOT, own_ray, require_bwrap

CACHE = str(ROOT / ".cache" / "provider")


@pytest.fixture(scope="module")
def cluster():
    require_bwrap()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    own_ray(address=c.address, namespace="sandman-cluster-tests")  # two nodes of its own
    yield c
    ray.shutdown()
    c.shutdown()


def test_sandboxes_spread_and_handles_follow_them(cluster, busybox_rootfs):
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    pool = "two-nodes-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=sandman.LocalProvider(
        state_root="/tmp/sandman-ray-test/cluster-state", cache_root=CACHE))
    try:
        handles = [sandman.acquire("dir:%s" % busybox_rootfs, pool=pool, timeout=120,
                                   node=sandman.ANYWHERE) for _ in range(6)]
        leased = ray.get(sandman.get_pool(pool).list_sandboxes.remote())
        sandbox_node = {s["sandbox_id"]: s["node_id"] for s in leased}
        used = set()
        for h in handles:
            node = sandbox_node[ray.get(h.sandbox_id.remote())]
            assert ray.get(h.node_id.remote()) == node  # the handle sits with its sandbox
            assert ray.get(h.exec.remote("echo ok")).stdout == b"ok\n"
            used.add(node)
        assert used == nodes
        for h in handles:
            sandman.release(h)
    finally:
        sandman.shutdown_pool(pool)


def test_an_acquire_prefers_its_own_node_and_may_ask_for_another(cluster, busybox_rootfs):
    """By default a sandbox is made (or found) on the caller's node, so that its direct
    calls take the unix socket; ``node=<id>`` places it on that node, whose host then
    serves its calls; a node that is not alive is refused by name."""
    here = ray.get_runtime_context().get_node_id()
    there = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    pool = "locality-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=sandman.LocalProvider(
        state_root="/tmp/sandman-ray-test/cluster-state", cache_root=CACHE))
    image = "dir:%s" % busybox_rootfs
    try:
        local = [sandman.acquire(image, pool=pool, timeout=120) for _ in range(3)]
        assert {h.node_id() for h in local} == {here}
        assert all(h._direct is not None and h.exec("echo ok").stdout == b"ok\n"
                   for h in local)
        remote = sandman.acquire(image, pool=pool, timeout=120, node=there)
        assert remote.node_id() == there and remote._direct is None
        assert remote.exec("echo far").stdout == b"far\n"  # through the host there
        with pytest.raises(ValueError, match="not an alive Ray node"):
            sandman.acquire(image, pool=pool, timeout=10, node="f" * 56)
        for h in local + [remote]:
            sandman.release(h)
    finally:
        sandman.shutdown_pool(pool)


def test_a_snapshot_is_brought_to_the_node_a_sandbox_of_it_is_asked_on(cluster):
    """A snapshot taken on this node; a sandbox of it asked on the other node is
    started there once that node's agent brought the layer from this node's agent (the
    files, a whiteout and an opaque directory intact, its base first when the snapshot
    stacks on another); the pool's shutdown leaves no copy on either node."""
    from pathlib import Path
    from sandman_ray.providers.local import leftovers
    from sandman_ray.providers.local.provider import DEFAULT_SNAPSHOT_ROOT
    here = ray.get_runtime_context().get_node_id()
    there = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    state = "/tmp/sandman-ray-test/cluster-state"
    pool = "carry-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=sandman.LocalProvider(state_root=state, cache_root=CACHE))
    try:
        with sandman.sandbox(pool=pool, timeout=120, node=here) as sb:
            sb.exec(["sh", "-c", "mkdir -p /work && echo base > /work/f && rm /etc/hostname"])
            base = sandman.snapshot(sb, "base")
        with sandman.sandbox(base, pool=pool, timeout=120, node=here) as sb:
            sb.exec(["sh", "-c", "echo top > /work/g && rm -r /etc/default && "
                                 "mkdir /etc/default && echo new > /etc/default/x"])
            top = sandman.snapshot(sb, "top")
        with sandman.sandbox(top, pool=pool, timeout=120, node=there) as far:
            assert ray.get(far.node_id.remote()) == there
            r = ray.get(far.exec.remote(["sh", "-c", "cat /work/f /work/g; ls /etc/default; "
                                                     "test -e /etc/hostname || echo gone"]))
            assert r.stdout == b"base\ntop\nx\ngone\n", r
        stores = {p.parent.parent.name for p in Path(DEFAULT_SNAPSHOT_ROOT).glob(
            "*/%s/top" % pool)}
        assert stores == {here[:16], there[:16]}
    finally:
        sandman.shutdown_pool(pool)
    assert leftovers(pool, state)["directories"] == []


def test_the_service_serves_every_node_at_its_front_and_at_each_nodes_gateway(
        cluster, tmp_path):
    """``sandman serve`` (TLS, a certificate the test made) on one node of two: a lease
    placed on the other node names that node's gateway, and its calls are served both
    there and at the service's own data plane (which relays onward); at the gateway,
    another tenant's key gets 404, a bad key 401, and a revoked key 401 at once. A
    released lease's relays are cut there too, and stopping the service stops the
    gateways."""
    import json
    import signal
    import ssl
    import subprocess
    import sys
    from sandman_ray.errors import AuthError, ConnectionLost, LeaseNotHeld
    from sandman_ray.remote import connect
    from sandman_ray.remote.channel import connect_lease
    from sandman_ray.pool.cluster import NAMESPACE
    from sandman_ray.service.gateways import GATEWAY_PREFIX, gateway_name
    from sandman_ray.service.tenants import KeyStore
    node_ip = ray.util.get_node_ip_address()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,IP:%s" % node_ip,
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    trust = ssl.create_default_context(cafile=str(cert))
    pool = "svc-nodes-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=sandman.LocalProvider(
        state_root="/tmp/sandman-ray-test/cluster-state", cache_root=CACHE))
    store = KeyStore(tmp_path / "keys.db")
    alice, bob = store.create_key("alice"), store.create_key("bob")
    gone = store.create_key("alice")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandman_ray.cli", "--address", cluster.address, "serve",
         "--pool", pool, "--port", "0", "--data-port", "0", "--keys", str(tmp_path / "keys.db"),
         "--tls-cert", str(cert), "--tls-key", str(key)], stdout=subprocess.PIPE, text=True)
    try:
        urls = json.loads(proc.stdout.readline())
        front = connect(urls["url"], alice, context=trust)
        by_node = connect(urls["url"], alice, context=trust, route="node")
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        leases = {node: front.acquire("builtin:debian", timeout=180, node=node)
                  for node in nodes}
        (far_node,) = [n for n, sb in leases.items()
                       if sb.lease["gateway_url"] != urls["data_url"]]
        far = leases[far_node]
        assert far.node_id == far_node and far.lease["gateway_url"].startswith("https://")
        gateway = ray.get_actor(gateway_name(pool, far_node), namespace=NAMESPACE)
        pid = ray.get(gateway.__ray_call__.remote(lambda self: __import__("os").getpid()))
        assert {os.getpriority(os.PRIO_PROCESS, int(t))
                for t in os.listdir("/proc/%d/task" % pid)} == {0}  # not a Ray worker's 15
        for sb in leases.values():  # the front reaches both nodes
            assert sb.exec("cat /etc/hostname >/dev/null; echo ok").stdout == b"ok\n"
        far.write_file("/tmp/f", b"from the front")
        direct = connect_lease(far.lease["gateway_url"], alice, far.lease_id, context=trust)
        assert direct.read_file("/tmp/f") == b"from the front"
        with pytest.raises(LeaseNotHeld):
            connect_lease(far.lease["gateway_url"], bob, far.lease_id, context=trust)
        with pytest.raises(AuthError):
            connect_lease(far.lease["gateway_url"], "sk_sandman_" + "0" * 40, far.lease_id,
                          context=trust)
        connect_lease(far.lease["gateway_url"], gone, far.lease_id, context=trust).close()
        store.revoke(gone)
        with pytest.raises(AuthError):
            connect_lease(far.lease["gateway_url"], gone, far.lease_id, context=trust)
        with by_node.sandbox("builtin:debian", timeout=180, node=far_node) as sb:
            assert sb.data_url == sb.lease["gateway_url"] != urls["data_url"]
            assert sb.exec("echo one hop").stdout == b"one hop\n"
        far.release()
        deadline = time.monotonic() + 10
        with pytest.raises(ConnectionLost):  # its relay at the gateway is cut (told after)
            while time.monotonic() < deadline:
                direct.exec("true")
        with pytest.raises(LeaseNotHeld):
            connect_lease(far.lease["gateway_url"], alice, far.lease_id, context=trust)
        leases[next(n for n in nodes if n != far_node)].release()
        assert any(e["name"].startswith(GATEWAY_PREFIX)
                   for e in ray.util.list_named_actors(all_namespaces=True))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        sandman.shutdown_pool(pool)
        store.close()
    assert not [e for e in ray.util.list_named_actors(all_namespaces=True)
                if e["name"].startswith(GATEWAY_PREFIX) and e["name"].endswith(pool)]


def test_without_tls_the_service_keeps_its_leases_on_its_own_node(cluster, tmp_path):
    """A service without TLS (and not told --insecure) places no lease on another node,
    whose gateway would carry keys in the clear: one asked for there is refused by
    name, and any other lands on the service's node."""
    import json
    import signal
    import subprocess
    import sys
    from sandman_ray.remote import connect
    from sandman_ray.service.tenants import KeyStore
    pool = "svc-clear-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=sandman.LocalProvider(
        state_root="/tmp/sandman-ray-test/cluster-state", cache_root=CACHE))
    store = KeyStore(tmp_path / "keys.db")
    key = store.create_key("alice")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandman_ray.cli", "--address", cluster.address, "serve",
         "--pool", pool, "--port", "0", "--data-port", "0", "--keys", str(tmp_path / "keys.db")],
        stdout=subprocess.PIPE, text=True)
    try:
        urls = json.loads(proc.stdout.readline())
        remote = connect(urls["url"], key)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        placed = set()
        for _ in range(4):
            sb = remote.acquire("builtin:debian", timeout=180)
            assert sb.lease["gateway_url"] == urls["data_url"]
            placed.add(sb.node_id)
            sb.release()
        assert len(placed) == 1
        (far,) = nodes - placed
        with pytest.raises(ValueError, match="TLS"):
            remote.acquire("builtin:debian", timeout=30, node=far)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        sandman.shutdown_pool(pool)
        store.close()
