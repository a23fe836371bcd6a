"""The six tests of mini-swe-agent's ``tests/environments/test_local.py`` that read this
machine where they mean the environment's (a temporary directory made here, this
process's variables and working directory, a pid file and a Python of this machine), as
the same checks in the environment's sandbox. tests/test_peer_minisweagent.py runs
these in their place and says why each was replaced."""

import shlex

from sandman_local import LocalEnvironment

CHILD = "\n".join([
    "import os, sys, time",
    "open(sys.argv[1], 'w').write(str(os.getpid()))",
    "while True:",
    "    time.sleep(1)"])


def _sh(env, command: str) -> str:
    """``command`` in the environment's sandbox, beside its actions."""
    result = env.sandbox.exec(["/bin/sh", "-c", command])
    assert result.exit_code == 0, result
    return result.stdout.decode()


def _made(env, *directories: str) -> None:
    """The directories in the environment's sandbox (theirs: TemporaryDirectory() here)."""
    _sh(env, "mkdir -p " + " ".join(map(shlex.quote, directories)))


def test_local_environment_existing_env_variables():
    """The sandbox's own variables (its spec's, where theirs patches os.environ) stay
    and merge with the config's."""
    env = LocalEnvironment(spec={"image": "builtin:debian", "env": {"EXISTING_VAR": "existing_value"}},
                           env={"NEW_VAR": "new_value"})
    result = env.execute({"command": "echo $EXISTING_VAR $NEW_VAR"})
    assert result["returncode"] == 0
    assert "existing_value new_value" in result["output"]


def test_local_environment_custom_cwd():
    temp_dir = "/tmp/peer-cwd"
    env = LocalEnvironment(cwd=temp_dir)
    _made(env, temp_dir)
    result = env.execute({"command": "pwd"})
    assert result["returncode"] == 0
    assert temp_dir in result["output"]


def test_local_environment_cwd_parameter_override():
    temp_dir1, temp_dir2 = "/tmp/peer-cwd-1", "/tmp/peer-cwd-2"
    env = LocalEnvironment(cwd=temp_dir1)
    _made(env, temp_dir1, temp_dir2)
    result = env.execute({"command": "pwd"}, cwd=temp_dir2)
    assert result["returncode"] == 0
    assert temp_dir2 in result["output"]


def test_local_environment_default_cwd():
    """Without a cwd, commands run where the sandbox's own processes start (theirs:
    os.getcwd() of the process that runs the test)."""
    env = LocalEnvironment()
    current_dir = _sh(env, "pwd").strip()
    result = env.execute({"command": "pwd"})
    assert result["returncode"] == 0
    assert current_dir in result["output"]


def test_local_environment_timeout_kills_child_process():
    """A timeout kills the processes the command started: the child's pid, written in
    the sandbox, names no process there once the command timed out."""
    temp_dir = "/tmp/peer-child"
    env = LocalEnvironment(timeout=1)
    _made(env, temp_dir)
    env.sandbox.write_file(temp_dir + "/child.py", CHILD.encode())
    pid_file = temp_dir + "/child.pid"
    result = env.execute({"command": "python3 %s %s" % (shlex.quote(temp_dir + "/child.py"),
                                                        shlex.quote(pid_file))})
    assert result["returncode"] == -1
    child_pid = int(_sh(env, "cat %s" % shlex.quote(pid_file)))
    gone = _sh(env, "kill -0 %d 2>/dev/null && echo alive || echo gone" % child_pid)
    assert gone.strip() == "gone"


def test_local_environment_file_operations():
    temp_dir = "/tmp/peer-files"
    env = LocalEnvironment(cwd=temp_dir)
    _made(env, temp_dir)
    result = env.execute({"command": "echo 'test content' > test.txt"})
    assert result["returncode"] == 0
    result = env.execute({"command": "cat test.txt"})
    assert result["returncode"] == 0
    assert "test content" in result["output"]
    # the file is in the sandbox, read through its handle
    assert env.sandbox.read_file(temp_dir + "/test.txt").decode().strip() == "test content"
