"""The service's data plane (sandman_ray/service/relay.py, sandman_ray/remote/channel.py):
a gateway process of its own relays a tenant's upgraded connection to the daemon of a
real LocalProvider sandbox, with the lease's token kept in the gateway; keys, tenants
and garbage are refused with an HTTP status and a typed body, and the gateway serves on.
The gateway here is given its leases by the test (the service's control plane, which
acquires them, comes with issue 49's later pieces)."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Sandbox, wait_until
from sandman_ray.errors import AuthError, ConnectionLost, LeaseNotHeld, SandboxLost
from sandman_ray.remote.channel import connect_lease
from sandman_ray.results import ExecResult
from sandman_ray.service.tenants import KeyStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from service_relay import GATEWAY  # noqa: E402  (bench/service_relay.py: a gateway process)


PENDING = 60  # the test gateway's cap of one address's connections before their upgrade


@pytest.fixture(scope="module")
def world(local_provider, tmp_path_factory):
    """Two tenants with a key each, a sandbox leased to alice, and a gateway process."""
    store_path = tmp_path_factory.mktemp("svc") / "keys" / "keys.db"
    store = KeyStore(store_path)
    alice, bob = store.create_key("alice"), store.create_key("bob")
    with Sandbox(local_provider, "builtin:debian") as sb:
        leases = {"L-alice": ["alice", sb.info.address, sb.info.token],
                  "L-dead": ["alice", sb.info.address + "-gone", "t"]}
        proc = subprocess.Popen([sys.executable, "-c", GATEWAY, json.dumps(
            {"keys": str(store_path), "leases": leases,
             "pending_per_address": PENDING})], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            yield {"url": "http://127.0.0.1:%d" % port, "port": port, "alice": alice,
                   "bob": bob, "store": store, "sb": sb, "proc": proc}
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
    store.close()


def raw(world, request: bytes, read_s: float = 5.0) -> bytes:
    """What the gateway answers ``request`` with, to its close."""
    with socket.create_connection(("127.0.0.1", world["port"]), timeout=read_s) as sock:
        sock.sendall(request)
        out = b""
        while True:
            data = sock.recv(65536)
            if not data:
                return out
            out += data


def upgrade(lease_id: str, key: str) -> bytes:
    return ("GET /v1/leases/%s/connect HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            "Connection: Upgrade\r\nUpgrade: sandman-daemon/2\r\n\r\n" % (lease_id, key)).encode()


def test_a_tenant_runs_commands_and_files_through_the_gateway(world):
    """The same client as a direct connection, over the upgraded socket: exec, files,
    a streamed command; the client never holds the lease's token."""
    client = connect_lease(world["url"], world["alice"], "L-alice", default_timeout=30)
    try:
        assert client.exec("echo relayed").stdout == b"relayed\n"
        client.write_file("/tmp/through", b"x" * 3_000_000)
        assert client.read_file("/tmp/through") == b"x" * 3_000_000
        stream = client.exec_stream("seq 3")
        chunks = [item for item in stream if not isinstance(item, ExecResult)]
        assert b"".join(data for kind, data in chunks if kind == "stdout") == b"1\n2\n3\n"
        assert stream.result.exit_code == 0
        assert world["sb"].info.token not in json.dumps(vars(client), default=str)
    finally:
        client.close()
    assert world["sb"].client.exec("cat /tmp/through | wc -c").stdout == b"3000000\n"


def test_another_tenants_lease_is_the_same_404_as_none_and_keys_are_checked(world):
    """Bob's key on alice's lease answers what an unknown lease answers; no key, a
    wrong key and a revoked key are 401; a dead sandbox is 410."""
    theirs = raw(world, upgrade("L-alice", world["bob"]))
    unknown = raw(world, upgrade("L-zzzzz", world["bob"]))  # an id as long
    assert theirs.startswith(b"HTTP/1.1 404 ") and \
        theirs.replace(b"L-alice", b"L-zzzzz") == unknown
    with pytest.raises(LeaseNotHeld):
        connect_lease(world["url"], world["bob"], "L-alice")
    for key in ("", "sk_sandman_000000000000_" + "A" * 43, world["alice"][:-1]):
        assert raw(world, upgrade("L-alice", key)).startswith(b"HTTP/1.1 401 ")
    spare = world["store"].create_key("alice")
    connect_lease(world["url"], spare, "L-alice").close()
    world["store"].revoke(spare)
    with pytest.raises(AuthError):
        connect_lease(world["url"], spare, "L-alice")
    with pytest.raises(SandboxLost):
        connect_lease(world["url"], world["alice"], "L-dead")


@pytest.mark.parametrize("request_bytes,status", [
    (b"hello there\r\n\r\n", 400),
    (b"GET /v1/leases/L-alice/connect HTTP/1.0\r\n\r\n", 400),
    (b"GET /v1/other HTTP/1.1\r\n\r\n", 404),
    (b"POST /v1/leases/L-alice/connect HTTP/1.1\r\n\r\n", 405),
    (b"GET /v1/leases/L-alice/connect HTTP/1.1\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n", 431),
    (b"GET /v1/leases/L-alice/connect HTTP/1.1\r\nbroken\r\n\r\n", 400),
    (b"GET /v1/leases/../../etc/connect HTTP/1.1\r\n\r\n", 404),
])
def test_garbage_gets_a_status_and_a_typed_error_and_the_gateway_serves_on(
        world, request_bytes, status):
    answer = raw(world, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert set(json.loads(body)["error"]) == {"type", "message"}
    without_upgrade = upgrade("L-alice", world["alice"]).replace(b"Upgrade: sandman", b"X: y")
    assert raw(world, without_upgrade).startswith(b"HTTP/1.1 426 ")
    client = connect_lease(world["url"], world["alice"], "L-alice")
    assert client.exec("true").exit_code == 0
    client.close()


def test_a_cut_lease_ends_its_relays_at_once(world):
    client = connect_lease(world["url"], world["alice"], "L-alice", default_timeout=30)
    assert client.exec("true").exit_code == 0
    world["proc"].stdin.write("L-alice\n")
    world["proc"].stdin.flush()
    assert world["proc"].stdout.readline().strip() == "1"
    with pytest.raises(ConnectionLost):
        client.exec("true")
    client.close()


def test_a_client_that_sends_its_head_slowly_or_never_costs_the_gateway_nothing(world):
    """Connections that say nothing, or half a head, are held by nothing but their
    socket; the gateway answers the next client at once."""
    idle = [socket.create_connection(("127.0.0.1", world["port"])) for _ in range(50)]
    try:
        for sock in idle[::2]:
            sock.sendall(b"GET /v1/leases/L-alice/conn")
        started = time.monotonic()
        client = connect_lease(world["url"], world["alice"], "L-alice")
        assert client.exec("true").exit_code == 0 and time.monotonic() - started < 5
        client.close()
    finally:
        for sock in idle:
            sock.close()


def test_the_remote_client_imports_no_ray():
    """A client outside Ray: connecting through the gateway loads no Ray module."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, sandman_ray.remote.channel; "
         "print(' '.join(m for m in sys.modules if m.split('.')[0] == 'ray'))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_one_address_holds_at_most_its_pending_connections_and_a_lease_its_relays(world):
    """Past its cap of connections of one address that have not upgraded (PENDING for
    this test's gateway), the next is answered 429 at once; another address is served; a closed one frees its
    room. Past RELAYS_PER_LEASE relays of one lease, the next upgrade is 429."""
    from sandman_ray.errors import ServiceLimit
    from sandman_ray.service.relay import RELAYS_PER_LEASE
    idle = [socket.create_connection(("127.0.0.1", world["port"]), source_address=("127.0.0.5", 0))
            for _ in range(PENDING)]
    try:
        def one_more() -> bytes:
            with socket.create_connection(("127.0.0.1", world["port"]), timeout=5,
                                          source_address=("127.0.0.5", 0)) as sock:
                sock.sendall(upgrade("L-alice", world["alice"]))
                return sock.recv(65536)
        wait_until(lambda: one_more().startswith(b"HTTP/1.1 429 "), timeout=10,
                   what="the gateway to have seen every idle connection")
        assert b"TooManyConnections" in one_more()
        client = connect_lease(world["url"], world["alice"], "L-alice")  # from 127.0.0.1
        assert client.exec("true").exit_code == 0
        client.close()
        idle.pop().close()
        wait_until(lambda: one_more().startswith(b"HTTP/1.1 101 "), timeout=10,
                   what="a closed connection's room to be free")
    finally:
        for sock in idle:
            sock.close()
    relays = []
    try:
        for _ in range(RELAYS_PER_LEASE):
            relays.append(connect_lease(world["url"], world["alice"], "L-alice"))
        with pytest.raises(ServiceLimit, match="TooManyConnections"):
            connect_lease(world["url"], world["alice"], "L-alice")
        assert relays[0].exec("true").exit_code == 0
    finally:
        for client in relays:
            client.close()
    # at once, too: a relay's slot is taken before its daemon is reached
    import concurrent.futures

    def attempt():
        try:
            return connect_lease(world["url"], world["alice"], "L-alice")
        except ServiceLimit:
            return None
    wait_until(lambda: connect_lease(world["url"], world["alice"], "L-alice").close() is None,
               timeout=10, what="the closed relays to be gone")
    with concurrent.futures.ThreadPoolExecutor(RELAYS_PER_LEASE + 16) as pool:
        made = list(pool.map(lambda _: attempt(), range(RELAYS_PER_LEASE + 16)))
    try:
        assert sum(client is not None for client in made) == RELAYS_PER_LEASE
    finally:
        for client in made:
            if client is not None:
                client.close()
