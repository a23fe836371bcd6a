"""Streamed output with backpressure, giving a request up, commands that run exactly
once, and terminals: against a real daemon."""

import asyncio
import os
import socket
import threading

import pytest

from sandman_ray.client import AsyncDaemonClient, ExecResult
from sandman_ray.daemon.sandmand.spawn import descendants
from sandman_ray.daemon.sandmand.wire import encode_frame
from sandman_ray.errors import DaemonError
from conftest import wait_until


def _chunks(stream):
    """(bytes per stream, the result) of a whole stream."""
    got = {"stdout": bytearray(), "stderr": bytearray()}
    result = None
    for item in stream:
        if isinstance(item, ExecResult):
            result = item
        else:
            got[item[0]] += item[1]
    return got, result


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _commands_of(daemon, name):
    """Pids of processes under the daemon whose command is ``name``."""
    found = []
    for pid in descendants(daemon.pid):
        try:
            with open("/proc/%d/comm" % pid) as fh:
                if fh.read().strip() == name:
                    found.append(pid)
        except OSError:
            pass
    return found


def _rss_kib(pid):
    with open("/proc/%d/status" % pid) as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS for %d" % pid)


def test_output_arrives_while_the_command_runs(client, tmp_path):
    go = tmp_path / "go"
    stream = client.exec_stream("echo first; while [ ! -e %s ]; do sleep 0.01; done; "
                                "echo second >&2" % go)
    assert next(stream) == ("stdout", b"first\n")  # the command is still waiting
    go.touch()
    got, result = _chunks(stream)
    assert bytes(got["stderr"]) == b"second\n" and stream.result is result
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"", b"")


def test_a_stream_is_whole_with_no_cap_unless_one_is_asked(client):
    got, result = _chunks(client.exec_stream("head -c 50000000 /dev/zero"))
    assert len(got["stdout"]) == 50_000_000 and not got["stdout"].strip(b"\0")
    assert result.ok and not result.truncated
    got, result = _chunks(client.exec_stream("head -c 50000 /dev/zero", max_output=1000))
    assert len(got["stdout"]) == 1000 and result.truncated


def test_a_reader_that_stops_holds_the_command_not_the_daemons_memory(daemon):
    before = _rss_kib(daemon.pid)
    with daemon.client() as client:
        stream = client.exec_stream(["cat", "/dev/zero"])
        assert next(stream)[0] == "stdout"
        wait_until(lambda: _commands_of(daemon, "cat"), what="cat started")
        cat = _commands_of(daemon, "cat")[0]

        def blocked():  # cat waits on its pipe: the daemon stopped reading it
            with open("/proc/%d/wchan" % cat) as fh:
                return fh.read().endswith("pipe_write")  # (anon_)pipe_write
        wait_until(blocked, what="cat blocked on its pipe")
        grown_mib = (_rss_kib(daemon.pid) - before) / 1024
        assert grown_mib < 32, grown_mib
        for _ in range(64):  # it goes on as the reader does
            assert next(stream)[0] == "stdout"
        stream.close()  # the reader gives up: the command is killed
        wait_until(lambda: not _alive(cat), what="cat killed")
        assert client.ping() is None  # and the connection serves the next call


def test_closing_a_stream_early_kills_its_command_and_keeps_the_connection(client, daemon):
    stream = client.exec_stream("echo start; exec sleep 100")
    assert next(stream) == ("stdout", b"start\n")
    wait_until(lambda: _commands_of(daemon, "sleep"), what="sleep started")
    sleeper = _commands_of(daemon, "sleep")[0]
    stream.close()
    assert not _alive(sleeper)
    assert client.exec("echo next").stdout == b"next\n"


def test_an_asyncio_stream_whose_consumer_is_cancelled_kills_its_command(daemon):
    async def main():
        client = await AsyncDaemonClient.connect(daemon.address, daemon.token)
        started = asyncio.Event()

        async def consume():
            async for item in client.exec_stream("echo start; exec sleep 100"):
                started.set()
        task = asyncio.ensure_future(consume())
        await started.wait()
        sleeper = _commands_of(daemon, "sleep")[0]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        got = []
        async for item in client.exec_stream("echo again"):
            got.append(item)
        client.close()
        return sleeper, got
    sleeper, got = asyncio.run(main())
    wait_until(lambda: not _alive(sleeper), what="sleep killed")
    assert got[0] == ("stdout", b"again\n") and got[-1].ok


def test_a_command_with_an_id_runs_once(client, tmp_path):
    log = tmp_path / "log"
    cmd = "echo ran >> %s; wc -l < %s" % (log, log)
    first = client.exec(cmd, command_id="append-1")
    again = client.exec(cmd, command_id="append-1")
    assert log.read_text() == "ran\n"
    assert again == first and first.stdout.strip() == b"1"
    with pytest.raises(DaemonError, match="another request"):
        client.exec("echo other", command_id="append-1")
    pid = client.spawn("sleep 30", command_id="spawn-1")
    assert client.spawn("sleep 30", command_id="spawn-1") == pid
    assert sum(p.running for p in client.proc_list() if p.pid == pid) == 1
    client.proc_signal(pid, "KILL")
    run = client.run("echo once >> %s" % log, command_id="run-1")
    assert client.run("echo once >> %s" % log, command_id="run-1") == run
    assert log.read_text() == "ran\nonce\n"


def test_a_retry_on_another_connection_attaches_to_the_command_it_lost(daemon, tmp_path):
    log, go = tmp_path / "log", tmp_path / "go"
    cmd = "echo ran >> %s; while [ ! -e %s ]; do sleep 0.01; done; echo done" % (log, go)
    first = daemon.client()
    lost = []
    caller = threading.Thread(target=lambda: lost.append(
        _raises(lambda: first.exec(cmd, command_id="lost-1"))))
    caller.start()
    wait_until(log.exists, what="the command started")
    first.abort()  # the caller's connection is gone, its command is not
    caller.join(10)
    assert lost and lost[0] is not None
    with daemon.client() as second:
        answer = []
        retry = threading.Thread(target=lambda: answer.append(
            second.exec(cmd, command_id="lost-1")))
        retry.start()
        wait_until(lambda: _commands_of(daemon, "sh"), what="the command still runs")
        assert not answer  # attached: waiting for the first run, not a second one
        go.touch()
        retry.join(10)
        assert answer[0].stdout == b"done\n"
        assert log.read_text() == "ran\n"
        assert second.exec(cmd, command_id="lost-1") == answer[0]
    first.close()


def _raises(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc
    return None


def test_old_answers_are_forgotten_and_never_run_again(client, tmp_path):
    log = tmp_path / "log"
    cmd = "echo ran >> %s; head -c 16777216 /dev/zero" % log
    for i in range(5):  # 5 x 16 MiB of kept output: more than the 64 MiB kept
        client.exec(cmd, command_id="big-%d" % i, max_output=16 * 1024 * 1024)
    with pytest.raises(DaemonError) as err:
        client.exec(cmd, command_id="big-0", max_output=16 * 1024 * 1024)
    assert err.value.type == "CommandForgotten"
    assert client.exec(cmd, command_id="big-4", max_output=16 * 1024 * 1024).ok
    assert log.read_text() == "ran\n" * 5


def _read_until(client, pty, marker, cursor=0):
    seen = b""
    for _ in range(100):
        r = client.pty_read(pty, cursor, timeout=5)
        seen += r["data"]
        cursor = r["cursor"]
        if marker in seen or r["eof"]:
            break
    assert marker in seen, seen
    return seen, cursor


def test_an_interactive_shell_on_a_terminal(client, daemon):
    term = client.pty_open(["sh", "-i"], cols=100, rows=30)
    pty = term["pty"]
    client.pty_write(pty, "[ -t 0 ] && [ -t 1 ] && echo tty-$((6*7)); stty size\n")
    seen, cursor = _read_until(client, pty, b"30 100")
    assert b"tty-42" in seen
    client.pty_resize(pty, 120, 40)
    client.pty_write(pty, "stty size; sleep 1000 &\n")
    seen, cursor = _read_until(client, pty, b"40 120", cursor)
    with daemon.client() as other:  # the terminal is the lease's, not the connection's
        assert [t["pty"] for t in other.pty_list()] == [pty]
        again, _ = _read_until(other, pty, b"tty-42")
    wait_until(lambda: _commands_of(daemon, "sleep"), what="the background sleep")
    sleeper = _commands_of(daemon, "sleep")[0]
    status = client.pty_close(pty)
    assert not status["running"] and not status["open"]
    wait_until(lambda: not _alive(sleeper), what="the terminal's processes gone")
    with pytest.raises(DaemonError) as err:
        client.pty_write(pty, "echo no\n")
    assert err.value.type == "TerminalClosed"
    with pytest.raises(DaemonError) as err:
        client.pty_read(12345)
    assert err.value.type == "TerminalNotFound"


def test_a_program_that_checks_for_a_terminal_sees_one(client):
    term = client.pty_open(["python3", "-c", "import os, sys; print('isatty', sys.stdin.isatty(), "
                            "sys.stdout.isatty(), os.get_terminal_size())"], cols=91, rows=17)
    seen, _ = _read_until(client, term["pty"], b"isatty")
    _read_until(client, term["pty"], b")\r\n")
    seen, _ = _read_until(client, term["pty"], b"columns=91, lines=17")
    assert b"isatty True True" in seen
    assert not client.exec("[ -t 1 ]").ok  # exec's output is a pipe, not a terminal
    with pytest.raises(DaemonError, match="cols and rows"):
        client.pty_open(cols=0)


def test_a_terminal_closed_under_a_waiting_write_harms_no_later_connection(daemon, client):
    """A write that waits for room in a terminal that never reads is ended by the
    close (TerminalClosed), and its descriptor number, reused, serves new connections;
    two writes at once are both answered, in order."""
    async def main():
        a = await AsyncDaemonClient.connect(daemon.address, daemon.token)
        for _ in range(4):
            pty = (await a.pty_open("stty raw -echo; exec sleep 1000"))["pty"]
            stuck = asyncio.ensure_future(a.pty_write(pty, b"x" * (1 << 20)))
            await asyncio.sleep(0)  # sent: it waits for room
            await a.pty_close(pty, kill_grace_s=0)
            with pytest.raises(DaemonError) as err:
                await stuck
            assert err.value.type == "TerminalClosed"
            fresh = await AsyncDaemonClient.connect(daemon.address, daemon.token)
            assert await fresh.ping() is None
            fresh.close()
        pty = (await a.pty_open(["cat"]))["pty"]
        done = await asyncio.gather(a.pty_write(pty, "one\n"), a.pty_write(pty, "two\n"))
        assert done == [None, None]
        await a.pty_close(pty)
        a.close()
    asyncio.run(main())


def test_closing_a_terminal_ends_what_its_exited_leader_left_on_it(client, daemon):
    term = client.pty_open("trap '' HUP TERM; (trap '' HUP TERM; exec sleep 777.125) & exit 0")
    wait_until(lambda: _commands_of_all("sleep", "777.125"), what="the left-behind sleep")
    left = _commands_of_all("sleep", "777.125")
    wait_until(lambda: not client.pty_list()[-1]["running"], what="the leader's exit")
    client.pty_close(term["pty"], kill_grace_s=0.1)
    wait_until(lambda: not any(_alive(pid) for pid in left), what="the sleep killed")
    for _ in range(20):  # closed terminals are forgotten past the last 16
        client.pty_close(client.pty_open(["true"])["pty"])
    assert sum(not t["open"] for t in client.pty_list()) == 16


def _commands_of_all(name, arg):
    """Pids of processes on this machine running ``name arg`` (reparented ones too)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as fh:
                    if fh.read().split(b"\0")[:2] == [name.encode(), arg.encode()]:
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_kept_answers_for_many_retries_are_not_copied_per_retry(daemon, tmp_path):
    """Sixty retries attached to one command whose answer is 8 MB, on a connection that
    does not read: the daemon encodes the answer once and holds back the rest of the
    requests past its high-water mark, so it grows by far less than 60 copies."""
    go = tmp_path / "go"
    cmd = "while [ ! -e %s ]; do sleep 0.01; done; head -c 8000000 /dev/zero" % go
    before = _rss_kib(daemon.pid)
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(daemon.address[len("unix:"):])
    raw.sendall(encode_frame({"op": "hello", "id": 0, "token": daemon.token, "version": 2}))
    for rid in range(1, 61):
        raw.sendall(encode_frame({"op": "exec", "id": rid, "cmd": cmd, "command_id": "big",
                                  "max_output": 8000000}))
    with daemon.client() as other:
        wait_until(lambda: _commands_of(daemon, "sh"), what="the command started")
        go.touch()
        assert len(other.exec(cmd, command_id="big", max_output=8000000).stdout) == 8000000
        grown_mib = (_rss_kib(daemon.pid) - before) / 1024
        assert grown_mib < 64, grown_mib
    raw.close()
