"""Persistent shell sessions through a real daemon process."""

import asyncio
import sys
import uuid

import pytest

from sandman_ray import AsyncDaemonClient, DaemonError
from conftest import DaemonProcess, processes_matching


def test_state_persists_between_runs(client):
    client.session_open("state")
    client.run("cd /tmp && export EXPORTED=1 && plain=2 && greet() { echo hi $1; }",
               session="state")
    r = client.run("pwd; echo $EXPORTED $plain; greet you; sh -c 'echo $EXPORTED'",
                   session="state")
    assert r.stdout == b"/tmp\n1 2\nhi you\n1\n" and r.exit_code == 0
    client.session_close("state")


def test_default_session_opens_on_first_use(client):
    assert client.run("echo $0").exit_code == 0


def test_exit_code_and_separate_streams(client):
    r = client.run("echo out; echo err >&2; (exit 4)")
    assert (r.exit_code, r.stdout, r.stderr) == (4, b"out\n", b"err\n")


def test_output_without_trailing_newline_and_quotes(client):
    assert client.run("printf 'no newline'").stdout == b"no newline"
    assert client.run("printf '%s' \"it's\" '\"quoted\"'").stdout == b"it's\"quoted\""


def test_stdin_is_at_eof(client):
    r = client.run("cat; read x; echo read=$?", timeout=5)
    assert not r.timed_out and r.stdout == b"read=1\n"


def test_stdin_is_dev_null_in_a_plain_sh_session_too(client):
    client.session_open("plain-sh", shell="/bin/sh")
    try:
        client.run("x=kept", session="plain-sh")
        r = client.run("cat; read y; echo read=$? $x", session="plain-sh", timeout=5)
        assert not r.timed_out and r.stdout == b"read=1 kept\n"
    finally:
        client.session_close("plain-sh")


def test_bash_sessions_work_under_an_open_file_limit_below_their_kept_fd(tmp_path):
    """A bash session keeps /dev/null on fd 253 for its commands' stdin; under a limit
    of 128 open files it cannot, and opens /dev/null per command instead."""
    d = DaemonProcess("unix:%s/n.sock" % tmp_path, python="prlimit",
                      python_flags=("--nofile=128:128", sys.executable))
    try:
        with d.client() as c:
            r = c.run("echo hi; cat; read x; echo read=$?", timeout=10)
            assert (r.exit_code, r.stdout, r.stderr) == (0, b"hi\nread=1\n", b"")
    finally:
        d.stop()


def test_stderr_is_complete_when_the_command_ends(client):
    """Only stdout carries the sentinel: what a command wrote to stderr just before it
    ended, and more than a pipe holds, is all in its result and none in the next."""
    big = client.run("head -c 300000 /dev/zero | tr '\\0' e >&2; echo out")
    assert big.stdout == b"out\n" and big.stderr == b"e" * 300000
    for i in range(100):
        r = client.run("echo out%d; echo err%d >&2" % (i, i))
        assert (r.stdout, r.stderr) == (b"out%d\n" % i, b"err%d\n" % i)


def test_syntax_error_does_not_kill_the_session(client):
    r = client.run("if then fi")
    assert r.exit_code != 0 and r.session_alive
    assert client.run("echo alive").stdout == b"alive\n"


def test_output_that_contains_an_old_sentinel_does_not_end_the_command(client):
    client.run("true")
    # print whatever looks like a sentinel: random per command, so nothing matches
    r = client.run("for i in 1 2 3; do echo sm0123456789abcdef$i; done; echo done")
    assert r.stdout.endswith(b"done\n") and r.stdout.count(b"\n") == 4


def test_timeout_interrupts_the_command_and_keeps_the_session(client):
    marker = "5%d.5" % (uuid.uuid4().int % 10 ** 6)
    client.run("KEEP=kept")
    r = client.run("sleep %s" % marker, timeout=0.3, kill_grace_s=1)
    assert r.timed_out and r.session_alive
    assert processes_matching("sleep " + marker) == []
    assert client.run("echo $KEEP").stdout == b"kept\n"


def test_a_busy_shell_builtin_loop_ends_the_session(client):
    client.session_open("busy")
    r = client.run("while :; do :; done", session="busy", timeout=0.3, kill_grace_s=0.2)
    assert r.timed_out and not r.session_alive and r.exit_code is None
    with pytest.raises(DaemonError) as err:
        client.run("true", session="busy")
    assert err.value.type == "SessionClosed"
    client.session_close("busy")


def test_exit_in_a_session_is_reported(client):
    client.session_open("leaving")
    r = client.run("echo bye; exit 7", session="leaving", timeout=10)
    assert not r.session_alive and r.stdout == b"bye\n"
    assert client.session_close("leaving")["exit_code"] == 7


def test_sessions_are_isolated_by_name(client):
    client.session_open("a")
    client.session_open("b")
    client.run("X=from-a", session="a")
    assert client.run("echo ${X:-none}", session="b").stdout == b"none\n"
    names = {s["session"] for s in client.session_list()}
    assert {"a", "b"} <= names
    for name in ("a", "b"):
        client.session_close(name)
    with pytest.raises(DaemonError, match="SessionNotFound"):
        client.run("true", session="a")


def test_opening_an_open_session_is_an_error(client):
    client.session_open("twice")
    with pytest.raises(DaemonError, match="SessionExists"):
        client.session_open("twice")
    client.session_close("twice")


def test_concurrent_runs_on_one_session_are_serialised(daemon):
    async def main():
        c = await AsyncDaemonClient.connect(daemon.address, daemon.token)
        try:
            await c.session_open("serial")
            await c.run("n=0", session="serial")
            await asyncio.gather(*[c.run("n=$((n+1))", session="serial") for _ in range(50)])
            return (await c.run("echo $n", session="serial")).stdout
        finally:
            await c.session_close("serial")
            c.close()
    assert asyncio.run(main()) == b"50\n"


def test_large_output_is_capped(client):
    r = client.run("head -c 300000 /dev/zero | tr '\\0' x", max_output=1000)
    assert len(r.stdout) == 1000 and r.truncated and r.exit_code == 0
