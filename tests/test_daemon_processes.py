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
