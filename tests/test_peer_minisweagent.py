"""mini-swe-agent's own environment and agent tests against sandman:
``tests/environments/test_local.py`` and ``tests/agents/test_default.py`` of
mini-swe-agent 2.4.6 with their ``tests/conftest.py`` (from its git repository at the
release's tag, each file pinned by sha256: tests/peer/fetch.py), each with one import
changed: ``LocalEnvironment`` (and its config) come from tests/peer/sandman_local.py,
a ``SandmanEnvironment`` on a leased sandbox. The suite runs in a process of its own
with a Ray of its own (tests/peer/minisweagent_plugin.py). The tests that read this
machine where they mean the environment's are replaced by the same checks in the
sandbox (REPLACED, and tests/peer/minisweagent_replaced.py).

The files are not in mini-swe-agent's sdists; where GitHub is out of reach and
``MINI_SWE_AGENT_GIT`` names no clone, the suite is skipped and says so."""

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))
from fetch import PeerUnreachable, fetch  # noqa: E402  (tests/peer/fetch.py)
from outcomes import outcomes as read_outcomes  # noqa: E402

from conftest import LOCAL_CACHE, require_bwrap  # noqa: E402

PEER = Path(__file__).resolve().parent / "peer"
SUITES = {"tests/environments/test_local.py":
              "from minisweagent.environments.local import LocalEnvironment, "
              "LocalEnvironmentConfig\n",
          "tests/agents/test_default.py":
              "from minisweagent.environments.local import LocalEnvironment\n"}
ENVIRONMENTS = "tests/environments/test_local.py"
# test name -> why it reads this machine (its replacement: minisweagent_replaced.py)
REPLACED = {
    "test_local_environment_existing_env_variables":
        "patches os.environ of the process that runs pytest, which a sandbox does not "
        "inherit; the sandbox's own variables are its spec's",
    "test_local_environment_custom_cwd":
        "makes its working directory with tempfile on the machine that runs pytest",
    "test_local_environment_cwd_parameter_override":
        "makes both working directories with tempfile on the machine that runs pytest",
    "test_local_environment_default_cwd":
        "expects os.getcwd() of the process that runs pytest",
    "test_local_environment_timeout_kills_child_process":
        "writes its child program and reads its pid file on the machine that runs "
        "pytest, and runs it with that machine's Python, and kill(0)s the pid there",
    "test_local_environment_file_operations":
        "reads the file the command wrote with Path.read_text() on the machine that "
        "runs pytest",
}


def _files():
    try:
        return fetch("mini-swe-agent")
    except PeerUnreachable as exc:
        pytest.skip(str(exc))


def _changed(source: str, line: str) -> str:
    """The test file with its one import of LocalEnvironment taken from sandman_local."""
    assert source.count(line) == 1, "the pinned file imports LocalEnvironment otherwise"
    return source.replace(line, line.replace("minisweagent.environments.local",
                                             "sandman_local"))


def _tests_in(source: str) -> set:
    return set(re.findall(r"^def (test_\w+)", source, re.M))


def test_minisweagent_suites_pass_against_sandman(tmp_path):
    require_bwrap()
    files = _files()
    run = files / "run"
    shutil.rmtree(run, ignore_errors=True)
    (run / "tests").mkdir(parents=True)
    shutil.copy(files / "tests" / "conftest.py", run / "tests" / "conftest.py")
    for suite, line in SUITES.items():
        (run / suite).parent.mkdir(parents=True, exist_ok=True)
        (run / suite).write_text(_changed((files / suite).read_text(), line))
    shutil.copy(PEER / "minisweagent_replaced.py", run / "tests" / "test_sandman_replaced.py")
    # test_default.py reads the package's configs from its repository's src/
    import minisweagent
    config = run / "src" / "minisweagent" / "config"
    config.parent.mkdir(parents=True)
    config.symlink_to(Path(minisweagent.__file__).parent / "config")
    junit = tmp_path / "minisweagent.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "minisweagent_plugin", "--rootdir", str(run), "--junitxml", str(junit),
               "tests"]
    for name in REPLACED:
        command += ["--deselect", "%s::%s" % (ENVIRONMENTS, name)]
    env = dict(os.environ, SANDMAN_PEER_CACHE=LOCAL_CACHE,
               SANDMAN_PEER_POOL="peer-msa-" + uuid.uuid4().hex[:6],
               PYTHONPATH=os.pathsep.join([str(run), str(PEER),
                                          os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(command, cwd=str(run), capture_output=True, text=True, timeout=900,
                          env=env, stdin=subprocess.DEVNULL)
    outcomes = read_outcomes(junit)
    report = proc.stdout[-4000:] + proc.stderr[-2000:]
    failed = sorted(name for name, outcome in outcomes.items() if outcome != "passed")
    assert not failed and proc.returncode == 0, "failed: %s\n%s" % (failed, report)
    # every test of both files ran (the replaced ones in their sandbox form)
    ran = {name.split("::")[1].split("[")[0] for name in outcomes}
    for suite in SUITES:
        theirs = _tests_in((run / suite).read_text())
        missing = theirs - set(REPLACED) - ran
        assert not missing, (suite, sorted(missing))
    assert all(outcomes.get("test_sandman_replaced::%s" % name) == "passed" for name in REPLACED)
    assert len(outcomes) >= 60, "the pinned suites ran %d tests" % len(outcomes)


@pytest.mark.parametrize("name", sorted(REPLACED))
def test_each_replaced_test_exists_in_the_pinned_suite_and_says_why(name):
    source = (_files() / ENVIRONMENTS).read_text()
    assert re.search(r"^def %s\(" % name, source, re.M)
    assert "def %s(" % name in (PEER / "minisweagent_replaced.py").read_text()
    assert REPLACED[name]
