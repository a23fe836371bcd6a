"""Background processes: spawn, status, output cursors, wait, signal, list."""

import pytest

from sandman_ray import DaemonError
from conftest import processes_matching, wait_until


def test_spawn_wait_and_read_output_by_cursor(client):
    pid = client.spawn("for i in 1 2 3; do echo line$i; done; echo oops >&2; exit 3")
    status = client.proc_wait(pid, timeout=10)
    assert not status.running and status.exit_code == 3 and not status.timed_out
    first = client.proc_output(pid, max_bytes=6)
    assert first.data == b"line1\n" and first.cursor == 6 and not first.eof
    rest = client.proc_output(pid, cursor=first.cursor)
    assert rest.data == b"line2\nline3\n" and rest.eof
    assert client.proc_output(pid, "stderr").data == b"oops\n"


def test_process_outlives_the_call_that_started_it(client):
    pid = client.spawn("sleep 30")
    assert client.proc_status(pid).running
    assert any(p.pid == pid for p in client.proc_list())
    status = client.proc_signal(pid, "TERM")
    assert client.proc_wait(pid, timeout=10).signal == 15
    del status


def test_wait_with_timeout_reports_still_running(client):
    pid = client.spawn("sleep 30")
    status = client.proc_wait(pid, timeout=0.1)
    assert status.running and status.timed_out
    client.proc_signal(pid, 9)
    assert client.proc_wait(pid, timeout=10).exit_code == 128 + 9


def test_signal_reaches_the_whole_group(client):
    pid = client.spawn("sleep 41.25 & sleep 41.25 & wait")
    client.proc_signal(pid, "KILL")
    client.proc_wait(pid, timeout=10)
    # the wait ends with the group's leader; its children are killed by the same signal
    # but may still be on their way out when it returns
    wait_until(lambda: processes_matching("sleep 41.25") == [], timeout=5,
               what="both background sleeps to die")


def test_ring_buffer_keeps_the_tail_and_counts_what_was_dropped(client):
    pid = client.spawn("head -c 5000 /dev/zero | tr '\\0' a; printf END", buffer_bytes=1000)
    client.proc_wait(pid, timeout=10)
    out = client.proc_output(pid)
    assert out.dropped == 4003 and len(out.data) == 1000 and out.data.endswith(b"END")
    assert client.proc_status(pid).stdout_bytes == 5003


def test_stdin_is_fed_then_closed(client):
    pid = client.spawn("cat | wc -c", stdin=b"x" * 100000)
    client.proc_wait(pid, timeout=10)
    assert client.proc_output(pid).data.strip() == b"100000"


def test_unknown_pid_and_bad_signal_are_errors(client):
    with pytest.raises(DaemonError, match="ProcessNotFound"):
        client.proc_status(999999)
    pid = client.spawn("true")
    with pytest.raises(DaemonError, match="unknown signal"):
        client.proc_signal(pid, "NOPE")
    with pytest.raises(DaemonError, match="'stream' must be"):
        client.proc_output(pid, "stdin")


def test_follow_streams_output_as_it_comes_then_the_exit(daemon, client):
    pid = client.spawn("echo one; echo two >&2; read line; echo got:$line; exit 4",
                       stdin_open=True)
    stream = client.proc_follow(pid)
    first = next(iter(stream))
    assert first in (("stdout", b"one\n"), ("stderr", b"two\n"))  # before it exits
    with daemon.client() as other:  # (this connection is the stream's until it ends)
        assert other.proc_status(pid).running
        assert other.proc_stdin(pid, b"hello\n") == 6
    chunks = [first] + list(stream)
    assert chunks[-1] is stream.result  # the chunks, then the status
    out = b"".join(d for s, d in chunks[:-1] if s == "stdout")
    err = b"".join(d for s, d in chunks[:-1] if s == "stderr")
    assert out == b"one\ngot:hello\n" and err == b"two\n"
    result = stream.result
    assert result["exit_code"] == 4 and result["dropped"] == 0
    assert result["stdout_cursor"] == len(out) and result["stderr_cursor"] == len(err)
    # following again from the cursors: nothing more, the status at once
    again = client.proc_follow(pid, result["stdout_cursor"], result["stderr_cursor"])
    assert list(again) == [again.result] and again.result["exit_code"] == 4


def test_an_open_stdin_is_read_until_it_is_closed(client):
    pid = client.spawn("wc -c", stdin_open=True)
    for _ in range(3):
        client.proc_stdin(pid, b"x" * 50000)  # more than a pipe holds, written in turn
    assert client.proc_status(pid).running
    client.proc_stdin(pid, close=True)
    assert client.proc_wait(pid, timeout=10).exit_code == 0
    assert client.proc_output(pid).data.strip() == b"150000"
    with pytest.raises(DaemonError, match="no open stdin"):
        client.proc_stdin(pid, b"late")


def test_stdin_is_refused_where_it_is_not_open_or_asked_twice(client):
    pid = client.spawn("sleep 30")
    with pytest.raises(DaemonError, match="no open stdin"):
        client.proc_stdin(pid, b"x")
    client.proc_signal(pid, "KILL")
    with pytest.raises(DaemonError, match="exclude each other"):
        client.spawn("cat", stdin=b"x", stdin_open=True)


def test_closing_a_follow_leaves_the_process_running(daemon):
    with daemon.client() as client:
        pid = client.spawn("for i in $(seq 50); do echo $i; sleep 0.05; done")
        stream = client.proc_follow(pid)
        assert next(iter(stream))[1].startswith(b"1")
        stream.close()
    with daemon.client() as client:
        assert client.proc_status(pid).running
        assert client.proc_wait(pid, timeout=20).exit_code == 0
        tail = client.proc_follow(pid)
        assert b"".join(d for _, d in list(tail)[:-1]).endswith(b"50\n")
