"""One-shot commands through a real daemon process."""

import os
import time
import uuid

import pytest

from sandman_ray import DaemonError
from conftest import processes_matching, wait_until


def test_exec_returns_exit_code_and_separate_streams(client):
    r = client.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    assert 0 < r.duration_s < 5


def test_plain_command_and_shell_command_agree(client):
    assert client.exec("true").exit_code == 0
    assert client.exec("false").exit_code == 1
    assert client.exec("ls /").stdout == client.exec("ls / | cat").stdout


def test_argv_form_runs_without_a_shell(client):
    r = client.exec(["printf", "%s|", "a b", "$HOME", "*"])
    assert r.stdout == b"a b|$HOME|*|"


def test_an_argv_may_pass_empty_arguments_but_not_an_empty_program(client):
    assert client.exec(["printf", "%s|", "", "x", ""]).stdout == b"|x||"
    assert client.exec(["/bin/sh", "-c", ""]).exit_code == 0
    for argv in ([], [""], ["printf", "a\0b"], ["printf", 1]):
        with pytest.raises(DaemonError) as err:
            client.exec(argv)
        assert err.value.type == "BadRequest" and "first one not empty" in str(err.value)


def test_unknown_command_in_a_shell_string_exits_127(client):
    r = client.exec("no-such-command-xyz")
    assert r.exit_code == 127 and b"not found" in r.stderr


def test_unknown_command_in_argv_form_is_an_error(client):
    with pytest.raises(DaemonError) as err:
        client.exec(["no-such-command-xyz"])
    assert err.value.type == "FileNotFoundError" and "no-such-command-xyz" in str(err.value)


def test_cwd_env_and_stdin(client, tmp_path):
    r = client.exec("pwd; echo $FOO; cat", cwd=str(tmp_path), env={"FOO": "bar"}, stdin=b"input")
    assert r.stdout == ("%s\nbar\ninput" % tmp_path).encode()


def test_env_merges_over_the_sandbox_environment_and_none_unsets(client):
    assert client.exec("echo $PATH").stdout.strip() != b""
    assert client.exec("echo ${HOME:-unset}", env={"HOME": None}).stdout == b"unset\n"


def test_commands_do_not_inherit_the_token_or_the_interpreter_locale(client):
    env = client.exec(["env"]).text
    assert "SANDMAN_TOKEN" not in env


def test_stdin_is_empty_by_default(client):
    r = client.exec("cat", timeout=5)
    assert r.exit_code == 0 and r.stdout == b"" and not r.timed_out


def test_timeout_kills_the_whole_process_group(client):
    marker = "1%d.5" % (uuid.uuid4().int % 10 ** 6)
    r = client.exec("sleep %s & sleep %s & sleep %s" % (marker, marker, marker),
                    timeout=0.3, kill_grace_s=1)
    assert r.timed_out and r.exit_code == 128 + 15
    assert processes_matching("sleep " + marker) == []


def test_timeout_kills_a_tree_that_ignores_sigterm(client):
    marker = "2%d.5" % (uuid.uuid4().int % 10 ** 6)
    r = client.exec("trap '' TERM; sh -c 'trap \"\" TERM; sleep %s' & sleep %s; wait"
                    % (marker, marker), timeout=0.3, kill_grace_s=0.3)
    assert r.timed_out
    assert processes_matching("sleep " + marker) == []


def test_timeout_reaches_processes_that_left_the_group(client):
    marker = "3%d.5" % (uuid.uuid4().int % 10 ** 6)
    r = client.exec("setsid sleep %s & sleep %s" % (marker, marker), timeout=0.3,
                    kill_grace_s=0.5)
    assert r.timed_out
    assert processes_matching("sleep " + marker) == []


def test_background_child_does_not_hold_the_reply(client):
    marker = "4%d.5" % (uuid.uuid4().int % 10 ** 6)
    started = time.monotonic()
    r = client.exec("sleep %s & echo started" % marker, timeout=30)
    assert r.stdout == b"started\n" and time.monotonic() - started < 5
    # the background child may still be between fork and exec when the reply arrives
    wait_until(lambda: processes_matching("sleep " + marker), what="the background sleep")
    client.exec("pkill -f 'sleep %s'" % marker)


def test_output_over_the_cap_is_truncated_and_flagged(client):
    r = client.exec("head -c 100000 /dev/zero", max_output=1000)
    assert len(r.stdout) == 1000 and r.truncated
    r = client.exec("head -c 1000 /dev/zero", max_output=1000)
    assert len(r.stdout) == 1000 and not r.truncated


def test_endless_output_does_not_exhaust_daemon_memory(client, daemon):
    def rss_kb():
        with open("/proc/%d/status" % daemon.pid) as fh:
            return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS"))
    before = rss_kb()
    r = client.exec("yes", timeout=1.0, max_output=1 << 20)
    assert r.timed_out and r.truncated and len(r.stdout) == 1 << 20
    assert rss_kb() - before < 64 * 1024


def test_sigpipe_ends_a_pipeline_as_in_any_shell(client):
    r = client.exec("yes | head -n 2", timeout=10)
    assert r.stdout == b"y\ny\n" and not r.timed_out


def test_streaming_sends_output_as_events(client):
    events = []
    r = client.exec("echo one; echo two >&2; echo three", on_output=lambda s, d: events.append((s, d)))
    assert r.exit_code == 0 and r.stdout == b""
    assert b"".join(d for s, d in events if s == "stdout") == b"one\nthree\n"
    assert b"".join(d for s, d in events if s == "stderr") == b"two\n"


def test_bad_fields_get_a_clear_error(client):
    with pytest.raises(DaemonError, match="'timeout' must be int or float, got str"):
        client._call("exec", {"cmd": "true", "timeout": "soon"})
    with pytest.raises(DaemonError, match="'cmd' is required"):
        client._call("exec", {})
    with pytest.raises(DaemonError, match="env name"):
        client.exec("true", env={"A=B": "x"})
    with pytest.raises(DaemonError, match="NUL"):
        client.exec(["ls", "a\0b"])
    with pytest.raises(DaemonError) as err:
        client.exec("true", cwd="/no/such/dir")
    assert err.value.type == "FileNotFoundError"


def test_exec_results_stay_correct_under_concurrency(daemon):
    import asyncio
    from sandman_ray import AsyncDaemonClient

    async def main():
        c = await AsyncDaemonClient.connect(daemon.address, daemon.token)
        try:
            return await asyncio.gather(*[c.exec("echo %d; exit %d" % (i, i % 7)) for i in range(100)])
        finally:
            c.close()
    results = asyncio.run(main())
    assert [(r.stdout, r.exit_code) for r in results] == [
        (b"%d\n" % i, i % 7) for i in range(100)]
