"""The service end to end: a real ``sandman serve`` process on loopback, serving a
LocalProvider pool of the test session's Ray cluster, and clients without Ray
(``sandman_ray.connect``, raw HTTP, and client processes the test SIGKILLs). Tenants
see and touch only their own leases; keys, limits and garbage are refused with a
status and a typed error; a retried acquire gets the same lease; a client that dies
leaves nothing after its keepalive."""

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import LOCAL_CACHE, LOCAL_STATE, shared_ray, unique_pool, wait_until
from sandman_ray.errors import AuthError, LeaseNotHeld, ServiceLimit
from sandman_ray.remote import connect
from sandman_ray.remote.channel import connect_lease
from sandman_ray.service.tenants import KeyStore


@contextlib.contextmanager
def serving(where, *serve_args, warm=None, **config):
    """A pool of this session's Ray (``warm``: its warm config, default a builtin:debian;
    ``config``: more of its PoolConfig), three tenants with a key each (carol may hold
    one sandbox) in a key store under ``where``, and ``sandman serve`` of the pool with
    ``serve_args``: its URLs, the pool, the store, the process and the keys."""
    import ray
    import sandman_ray as sandman
    from sandman_ray.providers.local import LocalProvider
    shared_ray()
    pool = unique_pool(LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE), "svc",
                       warm=warm or {"builtin:debian": 1}, **config)
    keys = where / "keys" / "keys.db"
    store = KeyStore(keys)
    tenants = {name: store.create_key(name) for name in ("alice", "bob", "carol")}
    store.set_tenant("carol", max_sandboxes=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandman_ray.cli", "--address",
         ray.get_runtime_context().gcs_address, "serve", "--pool", pool, "--port", "0",
         "--data-port", "0", "--keys", str(keys)] + list(serve_args),
        stdout=subprocess.PIPE, text=True)
    try:
        urls = json.loads(proc.stdout.readline())
        yield dict(urls, pool=pool, store=store, proc=proc, **tenants)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        sandman.shutdown_pool(pool)
        store.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("service")) as running:
        yield running


def http_call(service, method, path, body=None, key=None, raw=None, source="127.0.0.1"):
    """(status, headers, body bytes) of one request to the control plane, sent from
    the loopback address ``source``."""
    host, port = service["url"].rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=90, source_address=(source, 0))
    headers = {"Authorization": "Bearer " + key} if key else {}
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    conn.request(method, path, body=data, headers=headers)
    answer = conn.getresponse()
    out = answer.status, dict(answer.getheaders()), answer.read()
    conn.close()
    return out


def pool_leases(service) -> int:
    """The pool's leased sandboxes, by its own status."""
    import ray
    import sandman_ray as sandman
    return ray.get(sandman.get_pool(service["pool"]).status.remote())["states"].get("leased", 0)


def test_a_tenant_acquires_runs_and_releases_without_ray(service):
    pool = connect(service["url"], service["alice"])
    with pool.sandbox("builtin:debian", timeout=60) as sb:
        assert sb.exec("echo hi").stdout == b"hi\n"
        sb.write_file("/tmp/f", b"data")
        assert sb.read_file("/tmp/f") == b"data"
        assert [lease["lease_id"] for lease in pool.leases()] == [sb.lease_id]
        assert "token" not in json.dumps(pool.leases()) and "address" not in pool.leases()[0]
        assert pool.status()["leases"] == 1
    assert pool.leases() == []
    wait_until(lambda: pool_leases(service) == 0, timeout=10, what="the lease to end")


def test_another_tenants_lease_is_the_same_404_as_none(service):
    alice, bob = connect(service["url"], service["alice"]), connect(service["url"], service["bob"])
    with alice.sandbox("builtin:debian") as sb:
        fake = "L-" + "0" * (len(sb.lease_id) - 2)
        for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/keepalive")):
            theirs = http_call(service, method, "/v1/leases/%s%s" % (sb.lease_id, suffix),
                               key=service["bob"])
            none = http_call(service, method, "/v1/leases/%s%s" % (fake, suffix),
                             key=service["bob"])
            assert theirs[0] == none[0] == 404
            assert theirs[2].replace(sb.lease_id.encode(), fake.encode()) == none[2]
        assert bob.leases() == []
        with pytest.raises(LeaseNotHeld):
            connect_lease(sb.lease["data_url"], service["bob"], sb.lease_id)
        assert sb.exec("true").exit_code == 0  # untouched


def test_no_key_a_wrong_key_and_a_revoked_key_get_401(service):
    for key in (None, "", "sk_sandman_000000000000_" + "A" * 43, service["alice"] + "x"):
        status, _, body = http_call(service, "GET", "/v1/leases", key=key)
        assert status == 401 and json.loads(body)["error"]["type"] == "Unauthorized"
    spare = service["store"].create_key("alice")
    assert connect(service["url"], spare).leases() == []
    service["store"].revoke(spare)
    with pytest.raises(AuthError):
        connect(service["url"], spare).leases()
    assert http_call(service, "GET", "/v1/openapi.json")[0] == 200  # no key needed


def test_failed_keys_from_one_address_are_slowed_and_good_ones_are_not(service):
    """After five failed keys a minute from one address, each more one waits longer
    for its 401 (0.2 s, 0.4 s, 0.8 s); a valid key from there is answered at once, and
    another address's first failure is not slowed. (Each address of its own: 127.0.0.x
    are all this machine's.)"""
    waits = []
    for _ in range(8):
        started = time.monotonic()
        assert http_call(service, "GET", "/v1/leases", key="sk_sandman_nope",
                         source="127.0.0.7")[0] == 401
        waits.append(time.monotonic() - started)
    assert waits[-1] >= 0.8 and waits[-1] > waits[-2] > waits[-3] > max(waits[:5]), waits
    started = time.monotonic()
    assert http_call(service, "GET", "/v1/leases", key=service["alice"],
                     source="127.0.0.7")[0] == 200
    assert time.monotonic() - started < waits[-1]
    started = time.monotonic()
    assert http_call(service, "GET", "/v1/leases", key="sk_sandman_nope",
                     source="127.0.0.8")[0] == 401
    assert time.monotonic() - started < waits[-1]


def test_a_tenant_over_its_limit_gets_429_with_retry_after(service):
    carol = connect(service["url"], service["carol"])
    with carol.sandbox("builtin:debian"):
        status, headers, body = http_call(service, "POST", "/v1/leases",
                                          {"image": "builtin:debian"}, key=service["carol"])
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["type"] == "TenantLimit"
        with pytest.raises(ServiceLimit) as err:
            carol.acquire("builtin:debian")
        assert err.value.retry_after >= 1
    with carol.sandbox("builtin:debian") as sb:  # given back: room again
        assert sb.exec("true").exit_code == 0


def test_an_acquire_retried_with_its_request_id_gets_the_same_lease(service):
    body = {"image": "builtin:debian", "request_id": uuid.uuid4().hex}
    first = http_call(service, "POST", "/v1/leases", body, key=service["alice"])
    again = http_call(service, "POST", "/v1/leases", body, key=service["alice"])
    assert first[0] == again[0] == 201
    a, b = json.loads(first[2]), json.loads(again[2])
    assert (a["lease_id"], a["sandbox_id"]) == (b["lease_id"], b["sandbox_id"])
    other = http_call(service, "POST", "/v1/leases", body, key=service["bob"])  # bob's own
    assert json.loads(other[2])["lease_id"] != a["lease_id"]
    alice = connect(service["url"], service["alice"])
    assert [lease["lease_id"] for lease in alice.leases()] == [a["lease_id"]]
    alice.release(a["lease_id"])
    connect(service["url"], service["bob"]).release(json.loads(other[2])["lease_id"])


def test_an_acquire_whose_client_hangs_up_is_still_the_tenants(service):
    """A client that hangs up while its acquire waits does not stop it: the lease is
    the tenant's, listed and counted in its limits (carol may hold one: the next is a
    429), and found again by a retry with its request id; released, it is gone."""
    import socket
    host, port = service["url"].rsplit("/", 1)[1].split(":")
    body = json.dumps({"spec": {"image": "builtin:debian", "env": {"COLD": "1"}},
                       "request_id": "hung-up"}).encode()  # not warm: a create
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (service["carol"].encode(), len(body), body))
    carol = connect(service["url"], service["carol"])
    wait_until(lambda: len(carol.leases()) == 1, timeout=60, what="the lease, served")
    with pytest.raises(ServiceLimit):
        carol.acquire("builtin:debian", timeout=5)
    status, _, again = http_call(service, "POST", "/v1/leases", json.loads(body),
                                 key=service["carol"])
    assert status == 201 and json.loads(again)["lease_id"] == carol.leases()[0]["lease_id"]
    carol.release(carol.leases()[0]["lease_id"])
    assert carol.leases() == []


CLIENT = r"""
import sys
from sandman_ray.remote import connect
pool = connect(sys.argv[1], sys.argv[2], keepalive_s=5)
held = [pool.acquire("builtin:debian") for _ in range(2)]
print(" ".join(sb.lease_id for sb in held), flush=True)
sys.stdin.read()
"""


def test_a_sigkilled_client_leaves_nothing_after_its_keepalive(service):
    """Its leases are kept by its thread while it lives (past their keepalive), and
    reclaimed within keepalive + one sweep of the pool once it is SIGKILLed."""
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, service["url"], service["alice"]],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ids = proc.stdout.readline().split()
        assert len(ids) == 2
        alice = connect(service["url"], service["alice"])
        time.sleep(7)  # longer than their keepalive: the client's thread keeps them
        assert sorted(lease["lease_id"] for lease in alice.leases()) == sorted(ids)
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: alice.leases() == [], timeout=5 + 0.2 + 5,
                   what="the killed client's leases to be reclaimed")
        assert time.monotonic() - killed < 5 + 0.2 + 5
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("raw,status,kind", [
    (b"not json", 400, "ValidationError"),
    (b"[1, 2]", 400, "ValidationError"),
    (b'{"image": 7}', 400, "ValidationError"),
    (b'{"spec": {"image": "builtin:debian", "bogus": 1}}', 400, "ValidationError"),
    (b'{"spec": {"memory": "lots"}}', 400, "ValidationError"),
    (b'{"timeout_s": -1}', 400, "ValidationError"),
    (b'{"keepalive_s": 1}', 400, "ValidationError"),
    (b'{"surprise": 1}', 400, "ValidationError"),
    (b'{"image": "host"}', 403, "Forbidden"),
    (b'{"image": "dir:/"}', 403, "Forbidden"),
    (b'{"spec": {"capabilities": ["IO_URING"]}}', 403, "Forbidden"),
    (b'{"image": "x" }' + b" " * 70000, 413, "PayloadTooLarge"),
])
def test_garbage_gets_a_typed_4xx_and_nothing_is_leased(service, raw, status, kind):
    before = len(connect(service["url"], service["alice"]).leases())
    got, _, body = http_call(service, "POST", "/v1/leases", key=service["alice"], raw=raw)
    assert got == status, body
    assert json.loads(body)["error"]["type"] == kind
    assert len(connect(service["url"], service["alice"]).leases()) == before


def test_the_openapi_document_names_every_route(service):
    status, _, body = http_call(service, "GET", "/v1/openapi.json")
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.1")
    from sandman_ray.service.http import app, e2b_path
    # (E2B's routes are E2B's API, which E2B's own documents describe: docs/e2b.md)
    routes = {(r.resource.canonical, r.method.lower()) for r in app(None, None).router.routes()
              if r.method != "HEAD" and not e2b_path(r.resource.canonical)}
    assert {(path, method) for path, methods in doc["paths"].items() for method in methods} \
        == routes
    status, _, body = http_call(service, "GET", "/v1/nowhere", key=service["alice"])
    assert status == 404 and set(json.loads(body)["error"]) == {"type", "message"}


def test_a_body_its_encoding_does_not_unpack_gets_a_400(service):
    host, port = service["url"].rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/leases", body=b"not gzip at all",
                 headers={"Authorization": "Bearer " + service["alice"],
                          "Content-Encoding": "gzip"})
    answer = conn.getresponse()
    assert answer.status == 400
    assert json.loads(answer.read())["error"]["type"] == "ValidationError"
    conn.close()


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_server_runs_at_the_normal_priority_not_a_ray_workers(service):
    """Ray starts its workers at nice 15; the server relays every tenant's calls, so a
    busy process anywhere on the node (a tenant's commands, a client) would hold up
    every tenant's calls. Each of its threads runs at nice 0, as a Ray worker does not."""
    import ray

    @ray.remote(num_cpus=0)
    def niceness():
        return os.getpriority(os.PRIO_PROCESS, 0)
    assert ray.get(niceness.remote()) > 0  # what the server would run at
    threads = os.listdir("/proc/%d/task" % service["pid"])
    assert [os.getpriority(os.PRIO_PROCESS, int(t)) for t in threads] == [0] * len(threads)


def test_the_service_started_again_serves_the_leases_it_held(tmp_path):
    """The server dies (its actor killed) under a held lease whose client keeps it
    alive: a call in flight then raises ConnectionLost; ``sandman serve`` again on the
    same ports adopts the lease from the pool, the same key works, and the client's next
    call reaches the same sandbox, files and all."""
    import ray
    from sandman_ray.errors import ConnectionLost
    from sandman_ray.pool.cluster import NAMESPACE
    from sandman_ray.service.host import service_name
    ports = ["--port", str(free_port()), "--data-port", str(free_port())]
    with serving(tmp_path, *ports) as svc:
        pool = connect(svc["url"], svc["alice"], keepalive_s=30)
        sb = pool.acquire("builtin:debian")
        sb.write_file("/tmp/kept", b"before")
        svc["proc"].kill()
        svc["proc"].wait()
        actor = ray.get_actor(service_name(svc["pool"]), namespace=NAMESPACE)
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(actor)

        def gone():
            try:
                ray.get_actor(service_name(svc["pool"]), namespace=NAMESPACE)
            except ValueError:
                return not os.path.exists("/proc/%d" % pid)
            return False
        wait_until(gone, timeout=30, what="the killed service's process and name to go")
        with pytest.raises(ConnectionLost):
            sb.exec("true")
        again = subprocess.Popen(
            [sys.executable, "-m", "sandman_ray.cli", "--address",
             ray.get_runtime_context().gcs_address, "serve", "--pool", svc["pool"],
             "--keys", str(tmp_path / "keys" / "keys.db")] + ports,
            stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(again.stdout.readline())["url"] == svc["url"]
            assert sb.read_file("/tmp/kept") == b"before"
            assert [lease["lease_id"] for lease in pool.leases()] == [sb.lease_id]
            sb.release()
            assert pool.leases() == []
        finally:
            again.send_signal(signal.SIGTERM)
            again.wait(timeout=60)


def test_tls_with_a_certificate_the_test_made_and_loopback_unless_told(tmp_path):
    """With --tls-cert/--tls-key both planes speak TLS: a client that trusts the
    certificate acquires and runs commands, one that does not is refused before any
    key is sent. Beyond loopback without TLS, sandman serve refuses to start."""
    import ssl
    from sandman_ray.errors import ConnectionLost
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with serving(tmp_path / "svc", "--tls-cert", str(cert), "--tls-key", str(key)) as svc:
        assert svc["url"].startswith("https://") and svc["data_url"].startswith("https://")
        trusting = connect(svc["url"], svc["alice"],
                           context=ssl.create_default_context(cafile=str(cert)))
        with trusting.sandbox("builtin:debian") as sb:
            assert sb.exec("echo secret").stdout == b"secret\n"
        with pytest.raises(ConnectionLost, match="CERTIFICATE_VERIFY_FAILED"):
            connect(svc["url"], svc["alice"]).leases()
    refused = subprocess.run([sys.executable, "-m", "sandman_ray.cli", "serve", "--pool", "p",
                              "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--tls-cert" in refused.stderr
