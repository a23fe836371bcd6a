"""SWE-ReX's own runtime suite against sandman: ``tests/test_execution.py`` of swe-rex
1.4.0 (fetched into .cache/peer from its sdist, pinned by sha256: tests/peer/fetch.py),
unchanged, with fixtures that give it a ``SandmanRuntime`` on a leased sandbox
(tests/peer/swerex_fixtures.py, as the suite's conftest.py). It runs in a process of its
own, with a Ray of its own. The tests that read this machine's files where they mean the
runtime's are replaced by the same checks in the sandbox (REPLACED, and
tests/peer/swerex_replaced.py)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))
from fetch import fetch  # noqa: E402  (tests/peer/fetch.py)
from outcomes import outcomes as read_outcomes  # noqa: E402

from conftest import LOCAL_CACHE, require_bwrap  # noqa: E402

PEER = Path(__file__).resolve().parent / "peer"
SUITE = "tests/test_execution.py"
# test name -> why it reads this machine (its replacement is in swerex_replaced.py)
REPLACED = {
    "test_read_write_file": "reads the file the runtime wrote with Path.read_text() on the "
                            "machine that runs pytest",
    "test_read_large_file": "writes the file the runtime reads with Path.write_text() on "
                            "the machine that runs pytest",
}
PYTEST_INI = """[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
timeout = 120
"""


def test_swerex_runtime_suite_passes_against_sandman(tmp_path):
    require_bwrap()
    run = fetch("swe-rex") / "run"
    shutil.rmtree(run, ignore_errors=True)
    (run / "tests").mkdir(parents=True)
    shutil.copy(fetch("swe-rex") / SUITE, run / SUITE)
    (run / "tests" / "__init__.py").write_text("")
    shutil.copy(PEER / "swerex_fixtures.py", run / "tests" / "conftest.py")
    shutil.copy(PEER / "swerex_replaced.py", run / "tests" / "test_sandman_replaced.py")
    (run / "pytest.ini").write_text(PYTEST_INI)
    junit = tmp_path / "swerex.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--junitxml", str(junit), "tests"]
    for name in REPLACED:
        command += ["--deselect", "%s::%s" % (SUITE, name)]
    proc = subprocess.run(command, cwd=str(run), capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, SANDMAN_PEER_CACHE=LOCAL_CACHE,
                                   PYTHONPATH=os.pathsep.join(
                                       [str(PEER), os.environ.get("PYTHONPATH", "")])),
                          stdin=subprocess.DEVNULL)
    outcomes = read_outcomes(junit)
    report = proc.stdout[-4000:] + proc.stderr[-2000:]
    failed = sorted(name for name, outcome in outcomes.items() if outcome == "failed")
    assert not failed and proc.returncode == 0, "failed: %s\n%s" % (failed, report)
    # every test of the suite ran, but the replaced ones, and these ran instead
    theirs = set(re.findall(r"^async def (test_\w+)", (run / SUITE).read_text(), re.M))
    ran = {name.split("::")[1] for name in outcomes if name.startswith("test_execution::")}
    assert ran == theirs - set(REPLACED), sorted(theirs - set(REPLACED) - ran)
    assert all(outcomes["test_sandman_replaced::%s" % name] == "passed" for name in REPLACED)
    # only what SWE-ReX marks xfail itself may fail
    assert all(outcome in ("passed", "xfailed") for outcome in outcomes.values()), outcomes
    assert len(theirs) >= 45, "the pinned suite holds %d tests" % len(theirs)


@pytest.mark.parametrize("name", sorted(REPLACED))
def test_each_replaced_test_exists_in_the_pinned_suite_and_says_why(name):
    source = (fetch("swe-rex") / SUITE).read_text()
    assert re.search(r"^async def %s\(" % name, source, re.M)
    assert "async def %s(" % name in (PEER / "swerex_replaced.py").read_text()
    assert REPLACED[name]
