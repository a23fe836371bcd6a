"""E2B's API on a real ``sandman serve`` (service/e2b), driven by E2B's own SDK from
PyPI (``e2b``), sync and async, unchanged: only its environment variables point it at
the service (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, and E2B_HTTP_VERSION=1.1, since
the service speaks HTTP/1.1). Every sandbox is a lease of the tenant whose key the SDK
holds; when the tests are done, none is left."""

import asyncio
import io
import json
import os
import threading

import pytest

from conftest import leased, wait_until
from test_service import http_call, serving

pytestmark = pytest.mark.timeout(600)
e2b = pytest.importorskip("e2b")


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory):
    """The test CA (and a certificate it signed for *.sandman.test), trusted by the
    SDK's TLS through SSL_CERT_FILE: set before the SDK makes its first connection, as
    its TLS reads its roots once a process."""
    ca, cert, key = _test_ca(tmp_path_factory.mktemp("ca"))
    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(ca)
    yield ca, cert, key
    if saved is None:
        os.environ.pop("SSL_CERT_FILE", None)
    else:
        os.environ["SSL_CERT_FILE"] = saved


@pytest.fixture(scope="module")
def service(tmp_path_factory, test_ca):
    with serving(tmp_path_factory.mktemp("e2b"), warm={"builtin:code": 0}) as running:
        env = {"E2B_API_URL": running["url"], "E2B_SANDBOX_URL": running["url"],
               "E2B_API_KEY": running["alice"], "E2B_HTTP_VERSION": "1.1"}
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield running
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        wait_until(lambda: leased(running["pool"]) == 0, timeout=30,
                   what="every E2B sandbox's lease to end")


@pytest.fixture(scope="module")
def sandbox(service):
    box = e2b.Sandbox.create(timeout=300, metadata={"suite": "e2b"}, envs={"TASK": "t-7"})
    yield box
    box.kill()


def test_commands_run_with_their_exit_codes_environment_and_directory(sandbox):
    result = sandbox.commands.run("echo hello; echo oops >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "oops\n", 0)
    with pytest.raises(e2b.CommandExitException) as failed:
        sandbox.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    seen = sandbox.commands.run("echo $TASK $EXTRA $HOME; pwd; whoami", envs={"EXTRA": "x"},
                                cwd="/tmp")
    assert seen.stdout.split() == ["t-7", "x", "/home/user", "/tmp", "user"]
    assert sandbox.commands.run("pwd").stdout.strip() == "/home/user"


def test_output_arrives_in_callbacks_as_it_is_written(sandbox):
    heard = []
    result = sandbox.commands.run("for i in 1 2 3; do echo line$i; sleep 0.1; done; echo e >&2",
                                  on_stdout=heard.append, on_stderr=lambda s: heard.append("!" + s))
    assert "".join(h for h in heard if not h.startswith("!")) == "line1\nline2\nline3\n"
    assert "!e\n" in heard and result.stdout == "line1\nline2\nline3\n"


def test_background_commands_wait_take_stdin_list_and_kill(sandbox):
    handle = sandbox.commands.run("read a; read b; echo got $a $b", background=True, stdin=True)
    assert any(p.pid == handle.pid for p in sandbox.commands.list())
    sandbox.commands.send_stdin(handle.pid, "one\n")
    sandbox.commands.send_stdin(handle.pid, "two\n")
    assert handle.wait().stdout == "got one two\n"
    assert not any(p.pid == handle.pid for p in sandbox.commands.list())
    sleeper = sandbox.commands.run("sleep 300", background=True)
    assert sandbox.commands.kill(sleeper.pid)
    with pytest.raises(e2b.CommandExitException) as killed:
        sleeper.wait()
    assert killed.value.exit_code != 0
    assert not sandbox.commands.kill(sleeper.pid)  # gone: not found
    closing = sandbox.commands.run("wc -c", background=True, stdin=True)
    sandbox.commands.send_stdin(closing.pid, "12345")
    sandbox.commands.close_stdin(closing.pid)
    assert closing.wait().stdout.strip() == "5"


def test_a_command_is_reconnected_to_and_its_timeout_kills_it(sandbox):
    handle = sandbox.commands.run("sleep 1; echo late", background=True)
    handle.disconnect()
    again = sandbox.commands.connect(handle.pid)
    assert again.wait().stdout == "late\n"
    with pytest.raises(e2b.TimeoutException):
        sandbox.commands.run("echo $$ > slow.pid; exec sleep 60", timeout=1)
    wait_until(lambda: sandbox.commands.run("kill -0 $(cat slow.pid) 2>/dev/null || echo gone"
                                            ).stdout == "gone\n",
               timeout=10, what="the timed-out command to be killed")


def test_files_read_write_list_exist_rename_remove(sandbox):
    info = sandbox.files.write("notes/a.txt", "alpha\n")
    assert info.path == "/home/user/notes/a.txt"
    assert sandbox.files.read("notes/a.txt") == "alpha\n"
    sandbox.files.write("/home/user/notes/b.bin", b"\x00\xff" * 50000)
    assert sandbox.files.read("notes/b.bin", format="bytes") == bytearray(b"\x00\xff" * 50000)
    names = sorted(e.name for e in sandbox.files.list("notes"))
    assert names == ["a.txt", "b.bin"]
    entry = next(e for e in sandbox.files.list("notes") if e.name == "b.bin")
    assert entry.size == 100000 and entry.type == e2b.FileType.FILE
    assert sandbox.files.exists("notes/a.txt") and not sandbox.files.exists("notes/zzz")
    assert sandbox.files.make_dir("notes/deep/er") and not sandbox.files.make_dir("notes/deep")
    moved = sandbox.files.rename("notes/a.txt", "notes/deep/a2.txt")
    assert moved.path == "/home/user/notes/deep/a2.txt"
    assert sandbox.commands.run("cat notes/deep/a2.txt").stdout == "alpha\n"
    sandbox.files.remove("notes")
    assert not sandbox.files.exists("notes")
    with pytest.raises(e2b.NotFoundException):
        sandbox.files.read("notes/a.txt")
    many = sandbox.files.write_files([{"path": "m/1", "data": "one"},
                                      {"path": "m/2", "data": b"2"}])
    assert [w.path for w in many] == ["/home/user/m/1", "/home/user/m/2"]


def test_a_terminal_takes_keys_and_resizes(sandbox):
    out = bytearray()
    done = threading.Event()

    def heard(data):
        out.extend(data)
        if b"READY-42" in out:
            done.set()
    term = sandbox.pty.create(e2b.PtySize(rows=24, cols=80))
    sandbox.pty.resize(term.pid, e2b.PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(term.pid, b"stty size; echo READY-$((40+2))\n")
    ended = []

    def wait():
        try:
            term.wait(on_pty=heard)
        except e2b.CommandExitException as exc:  # killed, below
            ended.append(exc.exit_code)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert done.wait(30), bytes(out)
    assert b"30 100" in out
    assert sandbox.pty.kill(term.pid)
    waiter.join(30)
    assert ended and ended[0] != 0


def test_the_control_plane_lists_gets_times_and_kills(service, sandbox):
    listed = e2b.Sandbox.list(e2b.SandboxQuery(metadata={"suite": "e2b"})).next_items()
    assert [s.sandbox_id for s in listed] == [sandbox.sandbox_id]
    assert e2b.Sandbox.list(e2b.SandboxQuery(metadata={"suite": "no"})).next_items() == []
    info = sandbox.get_info()
    assert info.template_id == "base" and info.metadata == {"suite": "e2b"}
    other = e2b.Sandbox.create(timeout=60)
    assert other.is_running()
    other.set_timeout(1)
    wait_until(lambda: not other.is_running(), timeout=30, what="the sandbox's end at its timeout")
    with pytest.raises(e2b.SandboxException):
        other.commands.run("true")
    third = e2b.Sandbox.create()
    assert e2b.Sandbox.kill(third.sandbox_id) and not e2b.Sandbox.kill(third.sandbox_id)
    again = e2b.Sandbox.connect(sandbox.sandbox_id)
    assert again.commands.run("echo $TASK").stdout == "t-7\n"


def test_pause_keeps_processes_and_files_and_connect_resumes(service):
    box = e2b.Sandbox.create()
    try:
        box.files.write("kept.txt", "still here")
        counter = box.commands.run("i=0; while true; do i=$((i+1)); echo $i > n; sleep 0.05;"
                                   " done", background=True, timeout=0)
        box.pause()
        paused = e2b.Sandbox.list(e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED])).next_items()
        assert box.sandbox_id in [s.sandbox_id for s in paused]
        back = e2b.Sandbox.connect(box.sandbox_id)
        assert back.files.read("kept.txt") == "still here"
        assert any(p.pid == counter.pid for p in back.commands.list())
    finally:
        box.kill()


def test_keys_tokens_and_what_is_not_served_answer_in_e2b_shape(service, sandbox):
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create(api_key="sk-wrong")
    # bob's key sees none of alice's sandboxes
    assert e2b.Sandbox.list(api_key=service["bob"]).next_items() == []
    with pytest.raises(e2b.SandboxException):
        e2b.Sandbox.connect(sandbox.sandbox_id, api_key=service["bob"])
    status, _, body = http_call(service, "GET", "/templates", key=None)
    assert status == 401 and b'"code": 401' in body
    for method, path in (("GET", "/templates"), ("GET", "/volumes"), ("GET", "/secrets"),
                         ("GET", "/sandboxes/%s/logs" % sandbox.sandbox_id)):
        status, _, body = _e2b_call(service, method, path)
        assert status == 501 and b"not served by sandman" in body, (path, body)
    with pytest.raises(e2b.SandboxException, match="template 'no-such-template' not found"):
        e2b.Sandbox.create(template="no-such-template")
    # envd without the sandbox's access token: as if the sandbox were not there
    status, _, body = _e2b_call(service, "POST", "/process.Process/List", body=b"{}",
                                headers={"E2b-Sandbox-Id": sandbox.sandbox_id,
                                         "Content-Type": "application/json"})
    assert status == 503 and b"was not found" in body


def _e2b_call(service, method, path, body=None, headers=None):
    import http.client
    host, port = service["url"].rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body if body is not None else b"{}",
                 headers=dict({"X-API-KEY": service["alice"]}, **(headers or {})))
    answer = conn.getresponse()
    out = answer.status, dict(answer.getheaders()), answer.read()
    conn.close()
    return out


def test_the_async_sdk_runs_commands_and_files_at_once(service):
    async def main():
        box = await e2b.AsyncSandbox.create()
        try:
            results = await asyncio.gather(*(box.commands.run("echo %d" % i) for i in range(8)))
            assert [r.stdout for r in results] == ["%d\n" % i for i in range(8)]
            await box.files.write("a.txt", "async")
            assert await box.files.read("a.txt") == "async"
            handle = await box.commands.run("sleep 0.2; exit 5", background=True)
            with pytest.raises(e2b.CommandExitException):
                await handle.wait()
            heard = []
            done = await box.commands.run("echo a; echo b >&2", on_stdout=heard.append,
                                          on_stderr=lambda e: heard.append("!" + e))
            assert done.exit_code == 0 and sorted(heard) == ["!b\n", "a\n"]
            with pytest.raises(e2b.TimeoutException):
                await box.commands.run("sleep 30", timeout=1)
            screen = bytearray()
            seen = asyncio.Event()

            def on_pty(data):
                screen.extend(data)
                if b"ASYNC-7" in screen:
                    seen.set()
            term = await box.pty.create(e2b.PtySize(rows=20, cols=60), on_data=on_pty)
            await box.pty.send_stdin(term.pid, b"echo ASYNC-$((3+4))\n")
            await asyncio.wait_for(seen.wait(), 30)
            assert await box.pty.kill(term.pid)
            info = await box.get_info()
            assert info.sandbox_id == box.sandbox_id and info.template_id == "base"
        finally:
            await box.kill()
    asyncio.run(main())


def test_envd_finds_a_sandbox_by_its_host_name_and_refuses_garbage(service, sandbox):
    token = sandbox._envd_access_token
    by_name = {"Host": "49983-%s.sandman.test" % sandbox.sandbox_id, "X-Access-Token": token,
               "Content-Type": "application/json"}
    status, _, body = _e2b_call(service, "POST", "/process.Process/List", body=b"{}",
                                headers=by_name)
    assert status == 200 and "processes" in body.decode()
    for raw, content_type in ((b"not json", "application/json"), (b"[1, 2]", "application/json"),
                              (b'{"path": 7}', "application/json"),
                              (b"{}", "text/plain")):
        status, _, body = _e2b_call(service, "POST", "/filesystem.Filesystem/Stat", body=raw,
                                    headers=dict(by_name, **{"Content-Type": content_type}))
        assert status in (400, 501) and b'"code": "' in body, (raw, body)
    # a stream whose envelope says more bytes than come, and one with no envelope at all
    for raw in (b"\x00\x00\x00\x10\x00{}", b"", b"\x01\x00\x00\x00\x02{}"):
        status, _, body = _e2b_call(service, "POST", "/process.Process/Start", body=raw,
                                    headers=dict(by_name, **{
                                        "Content-Type": "application/connect+json"}))
        assert status == 200 and b'"error"' in body and b'"invalid_argument"' in body, body
    assert sandbox.commands.run("echo fine").stdout == "fine\n"


def test_a_watched_directory_tells_its_events_polled_and_streamed(service, sandbox):
    sandbox.files.make_dir("watched")
    handle = sandbox.files.watch_dir("watched", recursive=True)
    sandbox.files.write("watched/new.txt", "x")
    sandbox.files.make_dir("watched/sub")
    sandbox.commands.run("echo more >> watched/new.txt; touch watched/sub/deep")
    sandbox.files.remove("watched/new.txt")
    seen = []
    wait_until(lambda: seen.extend(handle.get_new_events()) or
               {("new.txt", e2b.FilesystemEventType.REMOVE), ("sub/deep",
                e2b.FilesystemEventType.CREATE)} <= {(e.name, e.type) for e in seen},
               timeout=10, what="the watch's events")
    kinds = {(e.name, e.type) for e in seen}
    assert ("new.txt", e2b.FilesystemEventType.WRITE) in kinds
    assert ("sub", e2b.FilesystemEventType.CREATE) in kinds
    handle.stop()
    with pytest.raises(e2b.SandboxException):
        sandbox.files.watch_dir("no/such/dir")

    async def streamed():
        box = await e2b.AsyncSandbox.connect(sandbox.sandbox_id)
        heard = asyncio.Queue()
        watch = await box.files.watch_dir("/home/user", heard.put_nowait)
        await box.files.write("/home/user/async.txt", "y")
        while True:
            event = await asyncio.wait_for(heard.get(), 10)
            if event.name == "async.txt":
                break
        await watch.stop()
    asyncio.run(streamed())


def test_forks_and_snapshots_carry_the_files(service):
    box = e2b.Sandbox.create(metadata={"kind": "source"}, envs={"TASK": "f-1"})
    try:
        box.files.write("state.txt", "before")
        forks = box.fork(count=2, timeout=60)
        assert len(forks) == 2 and all(isinstance(f, e2b.Sandbox) for f in forks), forks
        box.files.write("state.txt", "after")  # the source goes on, the forks have their own
        for i, fork in enumerate(forks):
            assert fork.files.read("state.txt") == "before"
            fork.files.write("state.txt", "fork %d" % i)
            assert fork.commands.run("echo $TASK").stdout == "f-1\n"
        assert [f.files.read("state.txt") for f in forks] == ["fork 0", "fork 1"]
        assert box.files.read("state.txt") == "after"
        snap = box.create_snapshot()
        assert snap.snapshot_id in [s.snapshot_id for s in
                                    e2b.Sandbox.list_snapshots(sandbox_id=box.sandbox_id)
                                    .next_items()]
        started = e2b.Sandbox.create(snap.snapshot_id)
        assert started.files.read("state.txt") == "after"
        # bob cannot start a sandbox of alice's snapshot, nor delete it
        with pytest.raises(e2b.SandboxException, match="not found"):
            e2b.Sandbox.create(snap.snapshot_id, api_key=service["bob"])
        assert not e2b.Sandbox.delete_snapshot(snap.snapshot_id, api_key=service["bob"])
        started.kill()
        for fork in forks:
            fork.kill()
        assert e2b.Sandbox.delete_snapshot(snap.snapshot_id)
        assert not e2b.Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        box.kill()


def test_large_and_gzip_uploads_and_downloads_go_through_in_pieces(service, sandbox):
    big = os.urandom(9 * 1024 * 1024 + 17)  # more than two of the service's 4 MiB pieces
    sandbox.files.write("big.bin", big)
    assert bytes(sandbox.files.read("big.bin", format="bytes")) == big
    text = "line\n" * 200000
    sandbox.files.write("packed.txt", io.BytesIO(text.encode()), gzip=True)
    assert sandbox.files.read("packed.txt") == text
    assert sandbox.commands.run("ls -a | grep -c e2b-upload || true").stdout.strip() == "0"
    status, _, body = _e2b_call(service, "POST", "/files?path=bad.gz",
                                body=b"not gzip at all",
                                headers={"E2b-Sandbox-Id": sandbox.sandbox_id,
                                         "X-Access-Token": sandbox._envd_access_token,
                                         "Content-Type": "application/octet-stream",
                                         "Content-Encoding": "gzip"})
    assert status == 400 and b"could not be read" in body


def test_envd_fields_of_the_wrong_type_are_refused_not_raised_on(service, sandbox):
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": sandbox._envd_access_token,
               "Content-Type": "application/json"}
    pid = sandbox.commands.run("sleep 30", background=True).pid
    for path, body in (
            ("/process.Process/SendSignal", {"process": {"pid": pid}, "signal": [9]}),
            ("/process.Process/Update", {"process": {"pid": pid}, "pty": "wide"}),
            ("/process.Process/SendInput", {"process": {"pid": "x"}, "input": {"stdin": "eA"}}),
            ("/process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": 7}}),
            ("/filesystem.Filesystem/ListDir", {"path": "/", "depth": "deep"}),
            ("/filesystem.Filesystem/GetWatcherEvents", {"watcherId": ["a"]}),
            ("/filesystem.Filesystem/Stat", {"path": ["/etc"]})):
        status, _, answer = _e2b_call(service, "POST", path, body=json.dumps(body).encode(),
                                      headers=headers)
        assert 400 <= status < 500 and b'"code": "' in answer, (path, body, status, answer)
    sandbox.commands.kill(pid)
    status, _, answer = _e2b_call(service, "POST", "/sandboxes/%s/timeout" % sandbox.sandbox_id,
                                  body=b'{"timeout": null}')
    assert status == 400 and b"timeout" in answer
    assert sandbox.is_running()


def _test_ca(where):
    """A CA of the test's, and a certificate it signed for ``*.sandman.test`` and
    127.0.0.1 (a CA's own certificate is not taken as a server's)."""
    import subprocess

    def openssl(*args):
        subprocess.run(["openssl"] + list(args), check=True, capture_output=True)
    ca, ca_key = where / "ca.pem", where / "ca.key"
    cert, key, csr = where / "cert.pem", where / "key.pem", where / "cert.csr"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=sandman test CA", "-keyout", str(ca_key), "-out", str(ca))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=sandman.test",
            "-keyout", str(key), "-out", str(csr))
    extensions = where / "ext.cnf"
    extensions.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                          "extendedKeyUsage=serverAuth\n"
                          "subjectAltName=DNS:*.sandman.test,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-extfile", str(extensions), "-out", str(cert))
    return ca, cert, key


def test_the_sdk_reaches_a_sandbox_by_its_host_name_over_tls(tmp_path, monkeypatch,
                                                             test_ca):
    """The SDK's form without a sandbox URL: envd at https://49983-<id>.<E2B_DOMAIN>
    (port 443), trusted by SSL_CERT_FILE. The name resolves by /etc/hosts, which the
    test writes for the sandbox and restores after (the SDK has no setting for it)."""
    import socket
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 443)) == 0:
            pytest.skip("port 443 is taken on this machine")
    ca, cert, key = test_ca
    hosts = open("/etc/hosts").read()
    with serving(tmp_path / "svc", "--port", "443", "--tls-cert", str(cert), "--tls-key",
                 str(key), warm={"builtin:code": 0}) as svc:
        assert svc["url"] == "https://127.0.0.1:443"
        monkeypatch.delenv("E2B_SANDBOX_URL", raising=False)
        for name, value in (("E2B_API_URL", svc["url"]), ("E2B_API_KEY", svc["alice"]),
                            ("E2B_DOMAIN", "sandman.test"), ("SSL_CERT_FILE", str(ca)),
                            ("E2B_HTTP_VERSION", "1.1")):
            monkeypatch.setenv(name, value)
        box = e2b.Sandbox.create()
        try:
            with open("/etc/hosts", "a") as fh:
                fh.write("127.0.0.1 49983-%s.sandman.test\n" % box.sandbox_id)
            assert box.envd_api_url == "https://49983-%s.sandman.test" % box.sandbox_id
            assert box.commands.run("echo by name").stdout == "by name\n"
            box.files.write("named.txt", "tls")
            assert box.files.read("named.txt") == "tls"
        finally:
            with open("/etc/hosts", "w") as fh:
                fh.write(hosts)
            box.kill()
