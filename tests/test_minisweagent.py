"""mini-swe-agent on sandman: ``SandmanEnvironment`` driven by mini-swe-agent's own
``DefaultAgent`` with its scripted ``DeterministicModel``, loaded by its own
``get_environment`` and its ``mini`` command, and compared command by command with its
``LocalEnvironment`` (on a real local Ray and the LocalProvider)."""

import gc
import importlib
import json
import os
import platform
import sys
import uuid

import pytest

import sandman_ray as sandman
from conftest import leased, own_pool, shared_ray, wait_until
from sandman_ray.spec import DEFAULT_IMAGE

STATE = "/tmp/sandman-ray-test/minisweagent-state"
# mini-swe-agent reads its global config (a .env) when imported: point it at an empty
# directory of the test's, so that no user's config (model, limits) takes part and
# nothing is written to the home directory; and skip its first-run setup prompt.
MSWEA_CONFIG_DIR = "/tmp/sandman-ray-test/minisweagent-config"
os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = MSWEA_CONFIG_DIR
os.environ["MSWEA_SILENT_STARTUP"] = "1"
os.environ["MSWEA_CONFIGURED"] = "1"

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from sandman_ray.integrations.minisweagent import SandmanEnvironment  # noqa: E402

CLASS_PATH = "sandman_ray.integrations.minisweagent.SandmanEnvironment"
MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@pytest.fixture(scope="module")
def cluster():
    yield shared_ray()


@pytest.fixture
def pool(cluster):
    with own_pool(STATE, "m", warm={DEFAULT_IMAGE: 1}) as name:
        yield name


# ---------------------------------------------------------------------- an agent's run
BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
CHECK = ("python3 -B -c 'import calc; assert calc.add(2, 3) == 5, calc.add(2, 3); "
         "print(\"check ok\")'")


def test_agent_fixes_a_bug_in_the_sandbox_and_submits(pool):
    task_dir = "/srv/mswea-task-%s" % uuid.uuid4().hex[:8]
    env = SandmanEnvironment(pool=pool, cwd=task_dir, timeout=20)
    assert leased(pool) == 1
    env.sandbox.write_file(task_dir + "/calc.py", BUGGY)
    model = DeterministicModel(outputs=[
        make_output("Run the check first.", [{"command": CHECK}]),
        make_output("Fix the operator.", [{"command": "sed -i 's/a - b/a + b/' calc.py"}]),
        make_output("Check again.", [{"command": CHECK}]),
        make_output("Done.", [{"command": "echo %s; cat calc.py" % MARKER}]),
    ])
    agent = DefaultAgent(
        model, env,
        system_template="You work on {{system}} {{release}} {{machine}}, node={{node}}.",
        instance_template="{{task}}", step_limit=10, cost_limit=0)

    result = agent.run("Make calc.add add.")

    assert result == {"exit_status": "Submitted", "submission": FIXED}
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    assert "AssertionError: -1" in observations[0]
    assert "<returncode>1</returncode>" in observations[0]
    assert "check ok" in observations[2] and "<returncode>0</returncode>" in observations[2]
    # the system facts in the prompt are the sandbox's, not this machine's
    node = env.sandbox.exec("uname -n").text.strip()
    assert node != platform.node()
    assert agent.messages[0]["content"].endswith("node=%s." % node)
    # the fix happened in the sandbox, and nowhere on this machine
    assert env.sandbox.read_file(task_dir + "/calc.py").decode() == FIXED
    assert not os.path.exists(task_dir)
    trajectory = agent.serialize()
    assert trajectory["info"]["config"]["environment_type"] == CLASS_PATH
    assert trajectory["info"]["sandbox"] == {"pool": pool, "sandbox_id": env.sandbox_id}

    env.close()
    assert leased(pool) == 0 and env.sandbox is None
    env.close()  # twice is fine
    with pytest.raises(sandman.SandmanError, match="is closed"):
        env.execute({"command": "true"})


# ---------------------------------------------------------------------- as LocalEnvironment
CONFIG = {"cwd": "/tmp", "env": {"GREETING": "hello from config"}, "timeout": 3}


@pytest.fixture(scope="module")
def envs(cluster):
    """The same config on this machine (mini-swe-agent's LocalEnvironment) and in a
    sandbox (one for the module's comparisons: none of them leaves anything behind)."""
    with own_pool(STATE, "m", warm={DEFAULT_IMAGE: 1}) as pool:
        ours = SandmanEnvironment(pool=pool, **CONFIG)
        yield LocalEnvironment(**CONFIG), ours
        ours.close()


SAME_ANSWER = [
    ("echo out; echo err >&2; echo out again; exit 3", {}),   # stderr merged in order
    ("pwd", {}),                                               # the config's cwd
    ("pwd", {"cwd": "/"}),                                     # an execute's cwd wins
    ("echo $GREETING", {}),                                    # the config's env
    ("printf 'a\\r\\nb\\rc\\n'; printf '\\377\\n'", {}),       # newlines, undecodable bytes
    ("kill -9 $$", {}),                                        # killed by a signal
    ("echo partial; sleep 30", {}),                            # past the config's timeout
    ("sleep 1.5; echo slept", {"timeout": 10}),                # an execute's timeout wins
    ("echo partial; sleep 30", {"timeout": 1}),
    ("echo %s; exit 1" % MARKER, {}),                          # failed: no submission
    ("echo before; echo %s" % MARKER, {}),                     # not first: no submission
    ("echo %s; echo done" % MARKER, {}),                       # submitted
    ("echo; echo %s; printf 'two\\nlines'" % MARKER, {}),      # blank lines before it
]


@pytest.mark.parametrize("command,kwargs", SAME_ANSWER)
def test_execute_answers_as_local_environment_does(envs, command, kwargs):
    answers = []
    for env in envs:
        try:
            answers.append(env.execute({"command": command}, **kwargs))
        except Submitted as submitted:
            answers.append(("Submitted", submitted.messages))
    assert answers[1] == answers[0]


def test_submission_marker_ends_the_run_as_local_environment_does(envs):
    local, ours = envs
    with pytest.raises(Submitted) as submitted:
        ours.execute({"command": "echo %s; echo the patch" % MARKER})
    assert submitted.value.messages == ({
        "role": "exit", "content": "the patch\n",
        "extra": {"exit_status": "Submitted", "submission": "the patch\n"}},)


def test_timeout_is_reported_as_local_environment_reports_it(envs):
    local, ours = envs
    seconds = "30.%03d" % (uuid.uuid4().int % 1000)  # names this command's sleep
    command = "echo partial; sleep %s" % seconds
    message = "Command '%s' timed out after 1 seconds" % command
    assert ours.execute({"command": command}, timeout=1) == {
        "output": "partial\n", "returncode": -1,
        "exception_info": "An error occurred while executing the command: " + message,
        "extra": {"exception_type": "TimeoutExpired", "exception": message}}
    # killed with what it started, as LocalEnvironment kills the process group
    left = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'sleep %s'" \
        % seconds.replace(".", "[.]")
    assert ours.execute({"command": left})["output"] == "0\n"


def test_output_past_the_daemons_cap_ends_with_a_note(envs):
    local, ours = envs
    answer = ours.execute({"command": "head -c 17000000 /dev/zero | tr '\\0' a"})
    assert answer["returncode"] == 0
    assert answer["output"].endswith("\n[output past 16 MiB was dropped in the sandbox]")
    assert answer["output"].startswith("a" * 1000) and len(answer["output"]) > 16_000_000


def test_missing_cwd_is_reported_as_local_environment_reports_it(envs):
    missing = "/nonexistent-%s" % uuid.uuid4().hex[:8]
    local, ours = (env.execute({"command": "pwd"}, cwd=missing) for env in envs)
    assert (ours["output"], ours["returncode"]) == (local["output"], local["returncode"])
    assert ours["returncode"] == -1
    assert ours["extra"]["exception_type"] == local["extra"]["exception_type"]
    assert ours["extra"]["exception_type"] == "FileNotFoundError"
    assert ours["exception_info"].startswith("An error occurred while executing the command: ")
    assert missing in ours["exception_info"]


def test_template_vars_are_local_environment_vars_read_in_the_sandbox(envs):
    local, ours = envs
    local_vars = local.get_template_vars(extra="x")
    our_vars = ours.get_template_vars(extra="x")
    # every variable LocalEnvironment gives, other than this machine's environment
    assert set(local_vars) - set(os.environ) <= set(our_vars)
    sandbox_env = dict(line.split("=", 1) for line in
                       ours.sandbox.exec("env").text.splitlines() if "=" in line)
    assert our_vars["PATH"] == sandbox_env["PATH"]
    for name, flag in (("system", "s"), ("node", "n"), ("release", "r"), ("version", "v"),
                       ("machine", "m")):
        assert our_vars[name] == ours.sandbox.exec("uname -" + flag).text.strip()
    processor = ours.sandbox.exec("uname -p").text.strip()
    assert our_vars["processor"] == ("" if processor == "unknown" else processor)
    assert our_vars["node"] != platform.node()
    assert (our_vars["cwd"], our_vars["env"]) == ("/tmp", CONFIG["env"])
    assert our_vars["extra"] == "x"
    assert "GREETING" not in our_vars  # the config's env is for commands, as locally


# ---------------------------------------------------------------------- loading it
def test_get_environment_makes_it_from_its_import_path(pool):
    env = get_environment({"environment_class": CLASS_PATH, "pool": pool, "cwd": "/usr",
                           "spec": {"image": DEFAULT_IMAGE, "env": {"FROM_SPEC": "1"}}})
    try:
        assert type(env) is SandmanEnvironment
        answer = env.execute({"command": "pwd; echo $FROM_SPEC"})
        assert answer == {"output": "/usr\n1\n", "returncode": 0, "exception_info": ""}
        assert leased(pool) == 1
    finally:
        env.close()
    assert leased(pool) == 0


def test_without_minisweagent_the_import_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "minisweagent.environments.local", None)  # missing
    monkeypatch.delitem(sys.modules, "sandman_ray.integrations.minisweagent")
    with pytest.raises(ImportError, match=r"needs mini-swe-agent \(pip install mini-swe"):
        importlib.import_module("sandman_ray.integrations.minisweagent")


@pytest.mark.parametrize("config,problem", [
    ({"run_args": ["--rm"]}, "run_args\n  Extra inputs are not permitted"),
    ({"image": DEFAULT_IMAGE, "spec": {"image": DEFAULT_IMAGE}}, "image or spec, not both"),
    ({"spec": {"imag": DEFAULT_IMAGE}}, "SandboxSpec has no field imag"),
    ({"image": "dir:relative"}, "image 'dir:relative': dir needs an absolute path"),
    ({"timeout": 0}, "timeout must be positive seconds"),
    ({"pool": "no/slash"}, "pool name 'no/slash'"),
    ({"env": {"A=B": "x"}}, "env has an invalid variable name 'A=B'"),
])
def test_bad_config_is_refused_naming_the_problem(cluster, config, problem):
    with pytest.raises(ValueError, match=problem.replace("\n", "\\n")):
        get_environment({"environment_class": CLASS_PATH, **config})


def test_mini_command_runs_on_sandman_with_environment_class(pool, tmp_path):
    """``mini --environment-class ...``: the user's command line, in this process (on
    its Ray). mini never closes its environment: the lease goes back when the handle is
    collected."""
    from typer.testing import CliRunner
    from minisweagent.run.mini import app
    outputs = [make_output("Look.", [{"command": "uname -n"}]),
               make_output("Done.", [{"command": "echo %s; echo via mini" % MARKER}])]
    (tmp_path / "model.yaml").write_text(json.dumps({"model": {"outputs": outputs}}))
    trajectory = tmp_path / "run.traj.json"
    result = CliRunner().invoke(app, [
        "--environment-class", CLASS_PATH, "--model-class", "deterministic",
        "-m", "deterministic", "-c", "mini.yaml", "-c", str(tmp_path / "model.yaml"),
        "-c", "environment.pool=%s" % pool, "-y", "--exit-immediately",
        "-t", "say hello", "-o", str(trajectory)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    saved = json.loads(trajectory.read_text())
    info = saved["info"]
    assert (info["exit_status"], info["submission"]) == ("Submitted", "via mini\n")
    assert info["config"]["environment_type"] == CLASS_PATH
    # uname -n ran in that sandbox (the LocalProvider names a sandbox's host after it)
    assert info["sandbox"]["sandbox_id"] in json.dumps(saved["messages"])
    assert leased(pool) == 1  # the agent mini returned still holds it
    del result
    gc.collect()
    wait_until(lambda: leased(pool) == 0, timeout=15, what="mini's dropped lease given back")
