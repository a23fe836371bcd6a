"""The wire contract under abuse: every bad input gets a clear error or a closed
connection, and the daemon keeps serving everyone else."""

import asyncio
import os
import socket
import struct
import sys
import time

import msgpack
import pytest

from sandman_ray import (AsyncDaemonClient, AuthError, ConnectionLost, DaemonClient, DaemonError,
                         ProtocolError)
from sandman_ray.daemon.sandmand.wire import MAX_FRAME, PROTOCOL_VERSION, encode_frame
from conftest import DaemonProcess, TOKEN, wait_until


def raw_socket(daemon, hello=True):
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(daemon.address.split(":", 1)[1])
    if hello:
        sock.sendall(encode_frame({"op": "hello", "token": TOKEN, "version": PROTOCOL_VERSION, "id": 0}))
        assert read_frame(sock)["ok"]
    return sock


def read_frame(sock):
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            return None
        header += chunk
    (n,) = struct.unpack(">I", header)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return msgpack.unpackb(body, raw=False)


def closed_after_error(sock):
    """The daemon's last word before closing, or None if it closed silently."""
    reply = read_frame(sock)
    assert read_frame(sock) is None, "the connection should be closed"
    return reply


@pytest.fixture(autouse=True)
def daemon_still_serves(daemon):
    yield
    with daemon.client() as c:
        assert c.exec("echo still here").stdout == b"still here\n"


def test_ping_and_info(client):
    assert client.ping() is None
    info = client.info()
    assert info["protocol"] == PROTOCOL_VERSION and info["pid"] > 0 and "rlimits" in info["limits"]
    assert "nofile" in info["limits"]["rlimits"]


def test_wrong_token_is_refused(daemon):
    with pytest.raises(AuthError, match="wrong token"):
        DaemonClient(daemon.address, "not-the-token")


def test_first_frame_must_be_hello(daemon):
    sock = raw_socket(daemon, hello=False)
    sock.sendall(encode_frame({"op": "ping", "id": 1}))
    assert closed_after_error(sock)["error"]["type"] == "AuthError"


def test_wrong_protocol_version_is_refused(daemon):
    sock = raw_socket(daemon, hello=False)
    sock.sendall(encode_frame({"op": "hello", "token": TOKEN, "version": 99, "id": 0}))
    assert "version" in closed_after_error(sock)["error"]["message"]


def test_silent_connection_is_closed_after_the_hello_timeout(daemon):
    sock = raw_socket(daemon, hello=False)
    started = time.monotonic()
    assert "no hello" in closed_after_error(sock)["error"]["message"]
    assert time.monotonic() - started < 5  # the fixture's daemon allows 1 s


@pytest.mark.parametrize("payload", [
    b"\x00\x00\x00\x03\xc1\xc1\xc1",                 # undecodable body
    b"\x00\x00\x00\x01\x05",                         # a frame that is not a map
    struct.pack(">I", MAX_FRAME + 1) + b"x" * 16,    # length over the limit
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",            # someone else's protocol
])
def test_garbage_closes_the_connection_with_a_protocol_error(daemon, payload):
    sock = raw_socket(daemon)
    sock.sendall(payload)
    reply = closed_after_error(sock)
    assert reply["id"] is None and reply["error"]["type"] == "ProtocolError"


def test_truncated_frame_then_disconnect_leaves_the_daemon_serving(daemon):
    sock = raw_socket(daemon)
    sock.sendall(struct.pack(">I", 1000) + b"\x81\xa2op")
    sock.close()


def test_unknown_op_and_bad_ids_get_errors_and_the_connection_stays(daemon):
    sock = raw_socket(daemon)
    sock.sendall(encode_frame({"op": "launch-missiles", "id": 7}))
    reply = read_frame(sock)
    assert reply["id"] == 7 and reply["error"]["type"] == "UnknownOp"
    sock.sendall(encode_frame({"op": "ping", "id": "seven"}))
    assert read_frame(sock)["error"]["type"] == "BadRequest"
    sock.sendall(encode_frame({"op": "ping", "id": 8}))
    assert read_frame(sock) == {"id": 8, "ok": True, "result": None}


def test_wrong_field_types_name_the_field(client):
    cases = [("exec", {"cmd": 5}, "'cmd' must be str or list"),
             ("exec", {"cmd": "true", "stream": "yes"}, "'stream' must be bool"),
             ("run", {"cmd": ["ls"]}, "'cmd' must be str"),
             ("read_file", {"path": "/etc/hostname", "length": 1.5}, "'length' must be int"),
             ("proc_status", {"pid": True}, "'pid' must be int, got bool"),
             ("exec", {"cmd": "true", "max_output": 1 << 40}, "'max_output' must be in"),
             ("exec", {"cmd": "true", "kill_grace": 1}, "'kill_grace' is not a field of exec"),
             ("proc_status", {}, "field 'pid' is required"),
             ("write_file", {"path": "/tmp/x", "data": None}, "field 'data' is required"),
             ("proc_signal", {"pid": 1, "signal": 1.5}, "'signal' must be int or str")]
    for op, fields, message in cases:
        with pytest.raises(DaemonError, match=message):
            client._call(op, dict(fields))


def test_hundred_concurrent_requests_on_one_connection(daemon):
    async def main():
        c = await AsyncDaemonClient.connect(daemon.address, daemon.token)
        try:
            calls = []
            for i in range(100):
                calls.append(c.exec("sleep 0.2; echo %d" % i) if i % 2 else c.ping())
            started = time.monotonic()
            results = await asyncio.gather(*calls)
            return results, time.monotonic() - started
        finally:
            c.close()
    results, elapsed = asyncio.run(main())
    assert [r.stdout for r in results[1::2]] == [b"%d\n" % i for i in range(1, 100, 2)]
    assert elapsed < 10  # in flight together, not 50 x 0.2 s in a row


def test_a_stalled_client_does_not_block_others(daemon):
    stalled = raw_socket(daemon)
    for i in range(20):  # asks for 20 x 8 MiB and never reads the replies
        stalled.sendall(encode_frame({"op": "exec", "id": 100 + i,
                                      "cmd": "head -c 8000000 /dev/zero",
                                      "max_output": 8000000}))
    with daemon.client() as other:
        for _ in range(20):
            assert other.exec("echo ok").stdout == b"ok\n"
    stalled.close()


def test_client_side_timeout_and_connection_loss_are_typed(tmp_path):
    d = DaemonProcess("unix:%s/t.sock" % tmp_path)
    try:
        c = d.client()
        from sandman_ray import CallTimeout
        with pytest.raises(CallTimeout):
            c._call("exec", {"cmd": "sleep 5"}, timeout=0.2)
        assert c.exec("echo next").stdout == b"next\n"  # the late reply is skipped
        with pytest.raises(CallTimeout):
            c._call("exec", {"cmd": "sleep 5"}, timeout=0.05)
        # a frame larger than the socket buffer, sent right after a timeout
        c.write_file(str(tmp_path / "big"), b"x" * (8 << 20))
        assert (tmp_path / "big").stat().st_size == 8 << 20
        d.proc.kill()
        d.proc.wait()
        with pytest.raises(ConnectionLost):
            c.exec("true")
    finally:
        d.stop()


def test_shutdown_stops_children_and_removes_the_socket(tmp_path):
    import os
    from conftest import processes_matching
    d = DaemonProcess("unix:%s/s.sock" % tmp_path)
    c = d.client()
    c.spawn("sleep 61.75")
    c.run("sleep 62.75 &")
    c.shutdown(kill_grace_s=1)
    assert d.proc.wait(10) == 0
    assert processes_matching("sleep 61.75") == [] and processes_matching("sleep 62.75") == []
    assert not os.path.exists(str(tmp_path / "s.sock"))
    d.stop()


def test_sigterm_stops_the_daemon_and_its_children(tmp_path):
    import signal
    from conftest import processes_matching
    d = DaemonProcess("unix:%s/s.sock" % tmp_path)
    c = d.client()
    c.spawn("sleep 63.75")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(10) == 0
    assert processes_matching("sleep 63.75") == []
    d.stop()


def _cpu_seconds(pid):
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_file_descriptors_refuses_at_once_and_does_not_spin(tmp_path):
    """Connections past the daemon's fd limit (64 here) are told why and closed, the
    daemon does not busy-loop on its listening socket, and it serves again once
    connections close."""
    d = DaemonProcess("unix:%s/f.sock" % tmp_path, python="prlimit",
                      python_flags=("--nofile=64:64", sys.executable))
    path = d.address[len("unix:"):]
    held = []
    try:
        for _ in range(100):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            held.append(s)
        used = _cpu_seconds(d.pid)
        time.sleep(1.0)  # an idle second: a loop woken by the listening socket would spin
        assert _cpu_seconds(d.pid) - used < 0.5
        start = time.monotonic()
        with pytest.raises((ProtocolError, ConnectionLost)) as refused:
            d.client()
        assert time.monotonic() - start < 5  # not the 10 s hello timeout
        if refused.type is ProtocolError:  # else the refusal beat the hello's send
            assert "out of file descriptors" in str(refused.value)
    finally:
        for s in held:
            s.close()

    def serves():
        try:
            with d.client() as c:
                return c.exec("true").exit_code == 0
        except (ProtocolError, ConnectionLost):
            return False  # it has not seen every closed connection yet
    wait_until(serves, timeout=10, what="the daemon to serve again")
    d.stop()


def test_a_hello_sent_with_the_first_call_still_guards_it(daemon, tmp_path):
    """``hello_first=False`` sends the hello and the first request together: a wrong
    token fails that call with AuthError and the daemon runs nothing of it; the right
    one answers the call as usual."""
    marker = tmp_path / "ran"
    wrong = DaemonClient(daemon.address, "not-the-token", hello_first=False)
    with pytest.raises(AuthError):
        wrong.exec(["touch", str(marker)])
    wrong.close()
    assert not marker.exists()
    with DaemonClient(daemon.address, daemon.token, hello_first=False) as right:
        assert right.exec(["touch", str(marker)]).ok
    assert marker.exists()


def test_a_refused_hello_is_said_even_when_the_daemon_closed_before_the_call_was_sent(
        daemon, tmp_path):
    """The daemon answers a wrong hello and closes at once: a first call written after
    that fails to send (EPIPE), and the client still raises the daemon's AuthError
    (read from what it already received), not a lost connection. Here the call waits
    until the refusal has arrived, so the send always fails."""
    import select
    wrong = DaemonClient(daemon.address, "not-the-token", hello_first=False)
    try:
        assert select.select([wrong._sock], [], [], 10)[0]  # the refusal is here
        with pytest.raises(AuthError):
            wrong.exec(["touch", str(tmp_path / "ran")])
    finally:
        wrong.close()
    assert not (tmp_path / "ran").exists()
