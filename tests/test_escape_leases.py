"""The escape suite (see test_escape.py): leases that end cannot reach the next
tenant, and the daemon's door holds against what an unauthenticated or hostile client
sends."""

import os

import pytest

from conftest import wait_until
from escape_kit import DOCKER_IMAGE, new_docker_provider
from escape_kit import (  # noqa: F401 - fixtures: pytest finds them by name
    box, boxes, docker_box, docker_provider, engine, provider)
from sandman_ray import ProtocolError


# ---------------------------------------------------------------- leases that end
def lease_pool(provider=None, **config):
    """A pool of one sandbox, of ``provider`` (a new LocalProvider by default)."""
    import sandman_ray as sandman
    from conftest import LOCAL_CACHE, LOCAL_STATE, unique_pool
    provider = provider or sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE)
    return unique_pool(provider, "lease", max_sandboxes=1, **config)


def kept_copy(sb):
    """Another reference to the handle, as a rollout worker that was passed it keeps."""
    import cloudpickle
    return cloudpickle.loads(cloudpickle.dumps(sb))


def next_tenant_is_safe_from(old, image, pool, error=None):
    """Lend the pool's one sandbox to a new tenant, which writes a secret; the ended
    handle ``old`` can neither read it nor write beside it (each call raises
    ``error``, LeaseEnded by default)."""
    import asyncio
    import ray
    import sandman_ray as sandman
    error = error or sandman.LeaseEnded
    with sandman.sandbox(image, pool=pool, timeout=60) as new:
        ray.get(new.write_file.remote("/tmp/secret", b"tenant B"))
        for call in (lambda: old.exec.remote("cat /tmp/secret"),
                     lambda: old.write_file.remote("/tmp/from-a", b"A was here"),
                     lambda: old.read_file.remote("/tmp/secret")):
            with pytest.raises(error):
                ray.get(call())
        # and directly, from this process, blocking and with asyncio (a handle that
        # was passed on makes these through its host)
        for call in (lambda: old.exec("cat /tmp/secret"),
                     lambda: old.write_file("/tmp/from-a", b"A was here"),
                     lambda: old.read_file("/tmp/secret"),
                     lambda: asyncio.run(old.exec_async("cat /tmp/secret"))):
            with pytest.raises(error):
                call()

        async def side_by_side():  # calls that wait on one loop's connect
            return await asyncio.gather(*[old.exec_async("cat /tmp/secret")
                                          for _ in range(4)], return_exceptions=True)
        assert all(isinstance(r, error) for r in asyncio.run(side_by_side()))
        assert ray.get(new.exec.remote("ls /tmp")).stdout == b"secret\n"
        assert ray.get(new.read_file.remote("/tmp/secret")) == b"tenant B"


@pytest.mark.parametrize("kind", ("local", "docker"))
def test_a_released_lease_cannot_reach_the_next_tenant(request, provider, busybox_rootfs, kind):
    import ray
    import sandman_ray as sandman
    if kind == "docker":
        image = DOCKER_IMAGE
        pool = lease_pool(new_docker_provider(request.getfixturevalue("engine")))
    else:
        image = "dir:%s" % busybox_rootfs
        pool = lease_pool()
    try:
        sb = sandman.acquire(image, pool=pool)
        copy = kept_copy(sb)
        ray.get(copy.exec.remote("true"))
        assert sb.exec("true").exit_code == 0  # a direct connection, kept open
        sandman.release(sb)
        with pytest.raises(sandman.LeaseEnded, match="released"):
            ray.get(copy.exec.remote("true"))
        with pytest.raises(sandman.LeaseEnded, match="released"):
            sb.exec("true")
        next_tenant_is_safe_from(copy, image, pool)
        next_tenant_is_safe_from(sb, image, pool)
    finally:
        sandman.shutdown_pool(pool)


def test_the_next_tenant_gets_nothing_of_the_last_ones_commands_or_terminals(provider,
                                                                           busybox_rootfs):
    """Command ids, their kept answers, terminals and background processes belong to a
    lease: the next tenant of the same sandbox who sends tenant A's command id runs
    its own command (it is not handed A's output), and finds none of A's terminals."""
    import sandman_ray as sandman
    image = "dir:%s" % busybox_rootfs
    pool = lease_pool()
    cmd = "cat /tmp/mark 2>/dev/null; echo end"
    try:
        with sandman.sandbox(image, pool=pool) as a:
            a.write_file("/tmp/mark", b"secret of A\n")
            assert a.exec(cmd, command_id="job-1").stdout == b"secret of A\nend\n"
            term = a.pty_open(["sh"], stdin=b"echo typed by A\n")
            a.spawn("sleep 1000", command_id="bg-1")
            first = a.sandbox_id()
        with sandman.sandbox(image, pool=pool) as b:
            assert b.sandbox_id() == first  # the same sandbox, renewed
            assert b.exec(cmd, command_id="job-1").stdout == b"end\n"
            assert b.pty_list() == []
            assert b.proc_list() == []
            with pytest.raises(sandman.DaemonError) as err:
                b.pty_read(term["pty"])
            assert err.value.type == "TerminalNotFound"
    finally:
        sandman.shutdown_pool(pool)


@pytest.mark.parametrize("limit", [{"ttl_s": 1.0}, {"idle_timeout_s": 5.0}])
def test_a_lease_ended_by_ttl_or_idleness_cannot_reach_the_next_tenant(provider, busybox_rootfs,
                                                                       limit):
    import ray
    import sandman_ray as sandman
    from conftest import wait_until
    from sandman_ray.spec import SandboxSpec
    spec = SandboxSpec(image="dir:%s" % busybox_rootfs, **limit)
    pool = lease_pool()
    try:
        sb = sandman.acquire(spec, pool=pool)
        ray.get(sb.exec.remote("true"))
        assert sb.exec("true").exit_code == 0  # a direct connection, kept open
        leased = lambda: ray.get(sandman.get_pool(pool).status.remote())["states"]["leased"]
        wait_until(lambda: leased() == 0, timeout=30, what="the pool to end the lease")

        def refused() -> bool:  # the pool's word reaches the host within moments
            try:
                ray.get(sb.exec.remote("true"))  # before it, the sandbox is still unlent
                return False
            except sandman.LeaseEnded as exc:
                assert ("TTL" if "ttl_s" in limit else "idle") in str(exc)
                return True
        wait_until(refused, timeout=10, what="the handle to learn that its lease ended")

        def refused_directly() -> bool:  # once the sandbox is reset for the next tenant
            try:
                sb.exec("true")  # before it, the sandbox is still unlent
                return False
            except sandman.LeaseEnded as exc:
                assert ("TTL" if "ttl_s" in limit else "idle") in str(exc)
                return True
        wait_until(refused_directly, timeout=30, what="direct calls to be refused")
        next_tenant_is_safe_from(sb, spec.image, pool)  # a tenant whose lease lasts
    finally:
        sandman.shutdown_pool(pool)


def test_a_lease_ended_by_a_pool_restart_cannot_reach_the_next_tenant(provider, busybox_rootfs):
    """The pool dies with a lease that no host holds yet (as when it dies right after
    lending, before the client's host took it): the restarted pool, which learns of its
    leases from the live hosts, starts that sandbox afresh before lending it, so the
    lease's connections and token are worthless to whoever kept them."""
    import ray
    import sandman_ray as sandman
    from conftest import wait_until
    from sandman_ray import DaemonClient
    image = "dir:%s" % busybox_rootfs
    pool = lease_pool()
    try:
        # lent by the pool itself to no host: the client holds the token alone
        lease = ray.get(sandman.get_pool(pool).lease.remote(
            sandman.SandboxSpec(image=image), "attacker", 60))
        kept = DaemonClient(lease.address, lease.token)
        assert kept.exec("true").exit_code == 0
        ray.kill(sandman.get_pool(pool), no_restart=False)
        wait_until(lambda: _settled(pool), timeout=60,
                   what="the restarted pool to start its sandbox afresh or delete it")
        with pytest.raises(sandman.ConnectionLost):  # its daemon is gone
            kept.exec("true")
        with sandman.sandbox(image, pool=pool, timeout=60) as new:
            ray.get(new.write_file.remote("/tmp/secret", b"tenant B"))
            with pytest.raises((sandman.AuthError, sandman.ConnectionLost)):
                DaemonClient(lease.address, lease.token).exec("cat /tmp/secret")
            assert ray.get(new.exec.remote("ls /tmp")).stdout == b"secret\n"
    finally:
        sandman.shutdown_pool(pool)


def _settled(pool) -> bool:
    """Whether the pool answers and each of its sandboxes is READY (started afresh)
    or deleted: none is still as the old pool left it."""
    import ray
    import sandman_ray as sandman
    try:
        ray.get(sandman.get_pool(pool).status.remote(), timeout=5)  # recovered by then
        listing = ray.get(sandman.get_pool(pool).list_sandboxes.remote(), timeout=5)
    except (ray.exceptions.RayError, TimeoutError):
        return False
    return all(entry["state"] == "ready" for entry in listing)


def test_a_release_by_a_caller_that_does_not_hold_the_lease_is_refused(provider,
                                                                        busybox_rootfs):
    """Whoever reads the pool's listing learns no lease id, and even with one, only
    the handle host that holds a lease may release it."""
    import ray
    import sandman_ray as sandman
    pool = lease_pool()
    try:
        sb = sandman.acquire("dir:%s" % busybox_rootfs, pool=pool)
        listing = ray.get(sandman.get_pool(pool).list_sandboxes.remote())
        assert sb.lease_id not in repr(listing)
        with pytest.raises(sandman.LeaseNotHeld):
            ray.get(sandman.get_pool(pool).release.remote(sb.lease_id))
        with pytest.raises(sandman.LeaseNotHeld):
            ray.get(sandman.get_pool(pool).release.remote(sb.lease_id, "sandman:sbx:thief"))
        assert ray.get(sb.exec.remote("echo still mine")).stdout == b"still mine\n"
        sandman.release(sb)
    finally:
        sandman.shutdown_pool(pool)


# ---------------------------------------------------------------- the daemon's door
def rss_kb(pid: int) -> int:
    with open("/proc/%d/status" % pid) as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def test_unauthenticated_frames_cannot_grow_the_daemon(daemon):
    """Thirty clients that never say hello each announce an 8 MiB frame and send it:
    the daemon refuses each at its header, stays under 1 MB more per connection, and
    answers an authenticated ping at once."""
    import struct
    from test_daemon_protocol import raw_socket, read_frame
    before = rss_kb(daemon.pid)
    body = b"\x81\xa2op\xa4ping" + b"\0" * (8 * 2 ** 20)
    socks = []
    for _ in range(30):
        sock = raw_socket(daemon, hello=False)
        try:
            sock.sendall(struct.pack(">I", len(body)) + body)
        except OSError:  # closed by the daemon while we sent: as it should
            pass
        socks.append(sock)
    for sock in socks:
        reply = read_frame(sock)
        assert reply is None or (reply["error"]["type"] == "ProtocolError"
                                 and "exceeds" in reply["error"]["message"])
        sock.close()
    assert rss_kb(daemon.pid) - before < 30 * 1024
    with daemon.client() as c:
        assert c.ping() is None


def test_connections_that_never_say_hello_are_capped(daemon):
    from test_daemon_protocol import raw_socket, read_frame
    from sandman_ray.daemon.sandmand.wire import MAX_UNAUTHENTICATED
    waiting = [raw_socket(daemon, hello=False) for _ in range(MAX_UNAUTHENTICATED)]
    try:
        extra = raw_socket(daemon, hello=False)
        reply = read_frame(extra)
        assert reply["error"]["type"] == "LimitExceeded" and "hello" in reply["error"]["message"]
        extra.close()
        waiting.pop().close()  # one of the waiting ones leaves: a new client gets in

        def gets_in():
            try:
                with daemon.client() as c:
                    return c.ping() is None
            except ProtocolError:  # the daemon has not yet seen the close
                return False
        wait_until(gets_in, what="a client to get in once a waiting one left")
    finally:
        for sock in waiting:
            sock.close()


def test_uploads_belong_to_their_connection_and_end_with_it(daemon, tmp_path):
    """64 uploads begun on connections that then closed used to block put_archive until
    a reset and keep their spool files: now they end with their connections, and no
    other connection can write into one."""
    import io
    import tarfile
    from sandman_ray import DaemonError
    fds_before = len(os.listdir("/proc/%d/fd" % daemon.pid))
    for _ in range(70):
        with daemon.client() as c:
            upload = c._call("put_archive_begin", {"path": str(tmp_path / "up")})["upload"]
    with daemon.client() as owner, daemon.client() as other:
        upload = owner._call("put_archive_begin", {"path": str(tmp_path / "up")})["upload"]
        with pytest.raises(DaemonError, match="UploadNotFound"):
            other._call("put_archive_data", {"upload": upload, "data": b"x"})
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("f")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"ok"))
        other.put_archive(str(tmp_path / "up2"), buf.getvalue())
    assert (tmp_path / "up2" / "f").read_bytes() == b"ok"
    wait_until(lambda: len(os.listdir("/proc/%d/fd" % daemon.pid)) <= fds_before,
               what="the daemon to close the connections' spool files")


def test_a_listing_larger_than_a_frame_is_truncated_not_refused(daemon, tmp_path):
    """20,000 symlinks with 4 KiB targets made an 81 MB reply that no client takes: the
    listing now stops at what fits, and says so."""
    where = tmp_path / "links"
    where.mkdir()
    target = "t" * 4000
    for i in range(20000):
        os.symlink(target, where / ("l%05d" % i))
    with daemon.client() as c:
        listing = c.list_dir(str(where))
        assert listing.truncated and 0 < len(listing) < 20000
        assert all(e.target == target for e in listing)
        first = c.list_dir(str(where), limit=5)
        assert first.truncated and len(first) == 5


def test_names_that_are_not_utf8_come_back_as_bytes(daemon, tmp_path):
    (tmp_path / "plain").write_text("x")
    with open(os.path.join(os.fsencode(tmp_path), b"bad-\xff\xfe"), "w") as fh:
        fh.write("x")
    with daemon.client() as c:
        names = [e.name for e in c.list_dir(str(tmp_path))]
    assert "plain" in names and b"bad-\xff\xfe" in names


def test_a_sparse_terabyte_cannot_fill_the_readers_memory(daemon, tmp_path):
    """A file that costs its sandbox nothing (sparse) but would cost whoever reads it a
    terabyte: read_file and get_archive stop at max_bytes with a clear error."""
    from sandman_ray import ResultTooLarge
    huge = tmp_path / "out.txt"
    with open(huge, "wb") as fh:
        fh.truncate(1 << 40)
    with daemon.client() as c:
        with pytest.raises(ResultTooLarge, match="max_bytes"):
            c.read_file(str(huge), max_bytes=64 << 20)
        (tmp_path / "small").write_bytes(b"x" * 100)
        assert c.read_file(str(tmp_path / "small"), max_bytes=100) == b"x" * 100
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "f").write_bytes(b"y" * (3 << 20))
        with pytest.raises(ResultTooLarge, match="max_bytes"):
            c.get_archive(str(tmp_path / "d"), max_bytes=1 << 20)
