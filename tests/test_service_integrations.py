"""The integrations on a pool of a sandman service instead of this Ray cluster's: verl's
tool, SkyRL's env, mini-swe-agent's environment and SWE-ReX's deployment, each given
the service's URL (its key in $SANDMAN_API_KEY) or ``sandman_ray.connect``'s pool, run
an episode against a real ``sandman serve`` and give their sandboxes back."""

import asyncio

import pytest

from sandman_ray.remote import connect
from test_service import serving

pytest.importorskip("skyrl_gym")
pytest.importorskip("minisweagent")
pytest.importorskip("swerex")

IMAGE = "builtin:debian"  # a tenant of the service runs images, not the host


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("service-integrations")) as running:
        yield running


@pytest.fixture
def tenant(service, monkeypatch):
    """alice's pool, and her key where a config that names the URL finds it."""
    monkeypatch.setenv("SANDMAN_API_KEY", service["alice"])
    pool = connect(service["url"], service["alice"])
    yield pool
    assert pool.leases() == []  # every integration gave its sandbox back


def test_the_verl_tool_on_a_service(service, tenant):
    from sandman_ray.integrations.verl import SandboxTool

    async def trajectory():
        tool = SandboxTool({"pool": tenant, "image": IMAGE, "linger_s": 0,
                            "reward_command": "test -f done"})
        instance, _ = await tool.create(trajectory_id="t1")
        await tool.execute(instance, {"command": "cd /tmp && export WHO=alice"})
        response, _, metrics = await tool.execute(instance, {"command": "pwd; echo $WHO"})
        before = await tool.calc_reward(instance)
        await tool.execute(instance, {"command": "touch /tmp/work/done"})
        after = await tool.calc_reward(instance)
        held = len(tenant.leases())
        await tool.release(instance)
        await tool.close()
        return response.text, metrics["exit_code"], before, after, held
    text, code, before, after, held = asyncio.run(trajectory())
    assert text.splitlines()[:2] == ["/tmp", "alice"] and code == 0
    assert (before, after, held) == (0.0, 1.0, 1)


def test_the_skyrl_env_on_a_service(service, tenant):
    import skyrl_gym
    from sandman_ray.integrations.skyrl import ENV_ID
    from test_skyrl import PROMPT, TASK
    env = skyrl_gym.make(ENV_ID, env_config={"pool": service["url"]}, extras=TASK)
    env.init(PROMPT)
    assert len(tenant.leases()) == 1
    env.step("<bash>sed -i 's/a - b/a + b/' calc.py</bash>")
    out = env.step("Fixed. <submit>")
    assert (out["done"], out["reward"]) == (True, 1.0)
    env.close()


def test_the_minisweagent_environment_on_a_service(service, tenant):
    from sandman_ray.integrations.minisweagent import SandmanEnvironment
    env = SandmanEnvironment(pool=service["url"], cwd="/tmp", timeout=20)
    try:
        out = env.execute({"command": "echo hi; pwd"})
        assert out["output"] == "hi\n/tmp\n" and out["returncode"] == 0
        assert env.execute({"command": "exit 3"})["returncode"] == 3
    finally:
        env.close()


def test_the_swerex_deployment_on_a_service(service, tenant):
    from swerex.runtime.abstract import (
        BashAction, Command, CreateBashSessionRequest, ReadFileRequest, WriteFileRequest)
    from sandman_ray.integrations.swerex import SandmanDeployment

    async def episode():
        deployment = SandmanDeployment(pool=service["url"])
        await deployment.start()
        try:
            runtime = deployment.runtime
            await runtime.create_session(CreateBashSessionRequest())
            await runtime.run_in_session(BashAction(command="cd /tmp && export X=42"))
            seen = await runtime.run_in_session(BashAction(command="echo $X; pwd"))
            await runtime.write_file(WriteFileRequest(path="/tmp/f", content="data"))
            read = await runtime.read_file(ReadFileRequest(path="/tmp/f"))
            ran = await runtime.execute(Command(command=["echo", "ran"]))
            return seen.output, read.content, ran.stdout
        finally:
            await deployment.stop()
    seen, read, ran = asyncio.run(episode())
    assert seen.split() == ["42", "/tmp"] and read == "data" and ran == "ran\n"


def test_a_pool_that_is_not_one_is_refused_naming_it(monkeypatch):
    from sandman_ray.integrations.sandboxes import Leases
    monkeypatch.delenv("SANDMAN_API_KEY", raising=False)
    with pytest.raises(ValueError, match="SANDMAN_API_KEY"):
        Leases("http://127.0.0.1:8470")
    with pytest.raises(ValueError, match="a service URL is"):
        Leases("http://")
    with pytest.raises(ValueError, match=r"pool name 42: .*give a service's URL"):
        Leases(42)
