"""SWE-ReX on sandman: ``SandmanDeployment`` built from its config by SWE-ReX's own
``get_deployment``, its lifecycle (a lease from start to stop), its runtime's files and
errors, and mini-swe-agent's ``DefaultAgent`` running an episode through SWE-ReX on a
deployment config that names sandman (SWE-ReX's own suite runs in
tests/test_peer_swerex.py)."""

import asyncio
import os
import uuid

import pytest

from conftest import leased, own_pool, shared_ray
from sandman_ray.spec import DEFAULT_IMAGE

STATE = "/tmp/sandman-ray-test/swerex-state"
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", "/tmp/sandman-ray-test/minisweagent-config")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_CONFIGURED", "1")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402
from swerex.deployment import get_deployment  # noqa: E402
from swerex.deployment.docker import DockerDeployment  # noqa: E402
from swerex.exceptions import DeploymentNotStartedError  # noqa: E402
from swerex.runtime.abstract import (  # noqa: E402
    Command, CreateBashSessionRequest, ReadFileRequest, UploadRequest)

from sandman_ray.integrations.swerex import (  # noqa: E402
    SandmanDeployment, SandmanDeploymentConfig, deployment_config)

MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@pytest.fixture(scope="module")
def cluster():
    yield shared_ray()


@pytest.fixture(scope="module")
def pool(cluster):
    with own_pool(STATE, "x", warm={DEFAULT_IMAGE: 1}) as name:
        yield name


def test_get_deployment_builds_sandman_s_from_its_config_and_a_dict():
    built = get_deployment(SandmanDeploymentConfig(image="builtin:debian", pool="p1"))
    assert isinstance(built, SandmanDeployment)
    from_dict = deployment_config({"type": "sandman", "spec": {"image": "host", "cpu": 1}})
    assert isinstance(from_dict, SandmanDeploymentConfig)
    assert isinstance(get_deployment(from_dict), SandmanDeployment)
    # SWE-ReX's own types still come through the same door
    assert isinstance(deployment_config({"type": "docker", "image": "python:3.11"})
                      .get_deployment(), DockerDeployment)


@pytest.mark.parametrize("config,problem", [
    ({"type": "sandman", "imgae": "host"}, "imgae"),
    ({"type": "sandman", "image": "host", "spec": {"image": "host"}}, "image or spec, not both"),
    ({"type": "sandman", "pool": "a/b"}, "pool name 'a/b'"),
    ({"type": "sandman", "acquire_timeout_s": 0}, "acquire_timeout_s must be positive"),
    ({"type": "sandman", "spec": {"gpus": 1}}, "SandboxSpec has no field gpus"),
])
def test_a_bad_config_is_refused_naming_the_problem(config, problem):
    with pytest.raises(ValueError, match=problem):
        deployment_config(config)


def test_a_deployment_holds_one_lease_from_start_to_stop(pool, tmp_path):
    async def main():
        deployment = SandmanDeployment(pool=pool)
        with pytest.raises(DeploymentNotStartedError):
            deployment.runtime
        with pytest.raises(DeploymentNotStartedError):
            await deployment.is_alive()
        await deployment.start()
        await deployment.start()  # once
        held = leased(pool)
        runtime = deployment.runtime
        assert (await deployment.is_alive()).is_alive
        await runtime.create_session(CreateBashSessionRequest())
        # a file of this machine and a directory go in, modes kept
        (tmp_path / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
        (tmp_path / "tool.sh").chmod(0o755)
        (tmp_path / "tree" / "sub").mkdir(parents=True)
        (tmp_path / "tree" / "sub" / "f").write_text("deep")
        await runtime.upload(UploadRequest(source_path=str(tmp_path / "tool.sh"),
                                           target_path="/opt/new/tool.sh"))
        await runtime.upload(UploadRequest(source_path=str(tmp_path / "tree"),
                                           target_path="/opt/tree"))
        ran = await runtime.execute(Command(command=["/opt/new/tool.sh"]))
        deep = await runtime.read_file(ReadFileRequest(path="/opt/tree/sub/f"))
        with pytest.raises(FileNotFoundError):
            await runtime.read_file(ReadFileRequest(path="/no/such/file"))
        with pytest.raises(FileNotFoundError):
            await runtime.execute(Command(command=["no-such-program-xyz"]))
        await deployment.stop()
        await deployment.stop()  # once
        return held, ran.stdout, deep.content, (tmp_path / "tool.sh").exists()

    held, ran, deep, here = asyncio.run(main())
    assert held == 1 and leased(pool) == 0
    assert ran == "tool ran\n" and deep == "deep" and here
    assert not os.path.exists("/opt/tree/sub/f")  # in the sandbox only


BUGGY = "def add(a, b):\n    return a - b\n"
CHECK = ("python -B -c 'import calc; assert calc.add(2, 3) == 5, calc.add(2, 3); "
         "print(\"check ok\")'")


def test_mini_swe_agent_runs_an_episode_through_swerex_on_a_sandman_deployment(pool):
    task_dir = "/srv/swerex-task-%s" % uuid.uuid4().hex[:8]
    env = get_environment({
        "environment_class": "sandman_ray.integrations.swerex_env.SwerexEnvironment",
        "deployment": {"type": "sandman", "pool": pool, "image": DEFAULT_IMAGE},
        "cwd": task_dir, "timeout": 20})
    assert leased(pool) == 1
    sandbox = env.deployment.sandbox
    sandbox.write_file(task_dir + "/calc.py", BUGGY)
    model = DeterministicModel(outputs=[
        make_output("Run the check.", [{"command": CHECK}]),
        make_output("Fix it.", [{"command": "sed -i 's/a - b/a + b/' calc.py"}]),
        make_output("Check again.", [{"command": CHECK}]),
        make_output("Done.", [{"command": "echo %s; cat calc.py" % MARKER}]),
    ])
    agent = DefaultAgent(model, env, system_template="You work in a sandbox.",
                         instance_template="{{task}}", step_limit=10, cost_limit=0)
    try:
        result = agent.run("Make calc.add add.")
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert result["exit_status"] == "Submitted"
        assert result["submission"] == BUGGY.replace("a - b", "a + b")
        assert "AssertionError: -1" in observations[0] and "check ok" in observations[2]
        assert sandbox.read_file(task_dir + "/calc.py").decode() == result["submission"]
        assert not os.path.exists(task_dir)
    finally:
        env.close()
    assert leased(pool) == 0
