"""The trainer integrations on a real local Ray with the LocalProvider: the gymnasium
``SandboxEnv`` (and the example's ``CodeRepairEnv`` on it), and the verl-style
``SandboxTool`` driven the way verl's agent loop drives a tool."""

import asyncio
import sys

import pytest
import ray

import sandman_ray as sandman
from conftest import ROOT, freezer_state, leased, shared_ray, unique_pool, wait_until

EXAMPLE = ROOT / "examples" / "rl_rollout"
sys.path.insert(0, str(EXAMPLE))

gymnasium = pytest.importorskip("gymnasium")
from sandman_ray.integrations.gym import SandboxEnv  # noqa: E402
from sandman_ray.integrations.verl import SandboxTool  # noqa: E402

STATE = "/tmp/sandman-ray-test/integrations-state"
CACHE = str(ROOT / ".cache" / "provider")


@pytest.fixture(scope="module")
def cluster():
    yield shared_ray()


def new_pool(**config):
    config.setdefault("warm", {"host": 2})
    return unique_pool(sandman.LocalProvider(state_root=STATE, cache_root=CACHE), "i", **config)


@pytest.fixture(scope="module")
def pool(cluster):
    """One pool for the module's tests (each gives back what it takes: the counts
    checked after each would see a lease that leaked)."""
    name = new_pool()
    yield name
    sandman.shutdown_pool(name)


@pytest.fixture
def one_sandbox_pool(cluster):
    """Every episode gets the same sandbox: what one episode left, the next would see
    unless the pool reset it."""
    from sandman_ray.spec import DEFAULT_IMAGE
    name = new_pool(warm={DEFAULT_IMAGE: 1}, max_sandboxes=1)
    yield name
    sandman.shutdown_pool(name)


class MarkerEnv(SandboxEnv):
    """Writes a marker in reset; step(0) says whether an earlier episode's marker is
    still there (it must not be: each episode gets a reset sandbox)."""

    observation_space = gymnasium.spaces.Discrete(2)
    action_space = gymnasium.spaces.Discrete(1)

    def setup(self, options):
        seen = self.exec("ls /tmp/marker").exit_code == 0
        self.put_files({"marker": "episode %d" % self.episodes}, "/tmp")
        return int(seen), {}

    def act(self, action):
        text = self.read_file("/tmp/marker").decode()
        return 0, float(text == "episode %d" % self.episodes), True, False, {}


def test_sandbox_env_leases_a_reset_sandbox_per_episode(one_sandbox_pool):
    pool = one_sandbox_pool
    env = MarkerEnv(pool=pool)
    with pytest.raises(sandman.SandmanError, match="before reset"):
        env.step(0)
    sandbox_ids = set()
    for _ in range(3):
        seen_before, _ = env.reset()
        sandbox_ids.add(ray.get(env.sandbox.sandbox_id.remote()))
        assert seen_before == 0  # nothing of the last episode is left
        assert env.step(0)[1] == 1.0
        assert leased(pool) == 1
    assert len(sandbox_ids) == 1  # the same sandbox each time, reset in between
    env.close()
    assert leased(pool) == 0
    env.close()  # twice is fine


def test_code_repair_env_rewards_the_right_edit_only(pool):
    from gymnasium.utils.env_checker import check_env
    from coderepair import FIX
    from env import CodeRepairEnv
    env = CodeRepairEnv({"pool": pool})
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=11)
    assert env.observation_space.contains(obs)
    assert env.step(FIX[info["family"]])[1:3] == (1.0, True)
    _, info = env.reset(seed=12)
    wrong = next(i for i, offered in enumerate(info["offered"])
                 if offered and i != FIX[info["family"]])
    assert env.step(wrong)[1] == 0.0
    env.close()
    assert leased(pool) == 0


def test_env_of_a_killed_worker_leaves_no_lease(pool):
    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": str(EXAMPLE)}})
    class Runner:
        def __init__(self, pool):
            from env import CodeRepairEnv  # the example's directory is on its path
            self.env = CodeRepairEnv({"pool": pool})

        def start(self):
            self.env.reset()
            return True

    runner = Runner.remote(pool)
    assert ray.get(runner.start.remote())
    assert leased(pool) == 1
    ray.kill(runner)
    wait_until(lambda: leased(pool) == 0, timeout=15, what="the killed worker's lease reclaimed")


# ---------------------------------------------------------------------- verl-style tool
async def tool_call(tool, trajectory_id, command):
    """One tool call as verl's agent loop makes it: create, execute, release."""
    instance_id, _ = await tool.create(create_kwargs={"trajectory_id": trajectory_id})
    try:
        response, reward, metrics = await tool.execute(instance_id, {"command": command})
        return response.text, metrics
    finally:
        await tool.release(instance_id)


def test_tool_calls_of_a_trajectory_share_one_sandbox(pool):
    async def trajectory(tool, name):
        await tool_call(tool, name, "mkdir -p sub && cd sub && export WHO=%s" % name)
        await tool_call(tool, name, "echo $WHO > who.txt; touch only-%s" % name)
        text, metrics = await tool_call(tool, name, "pwd; cat who.txt; ls")
        return text, metrics

    async def main():
        tool = SandboxTool({"pool": pool, "linger_s": 30, "reward_command": "test -f sub/done"})
        results = await asyncio.gather(*(trajectory(tool, "t%d" % i) for i in range(3)))
        during = leased(pool)
        instance, _ = await tool.create(trajectory_id="t0")
        before = await tool.calc_reward(instance)
        await tool.execute(instance, {"command": "touch done"})
        after = await tool.calc_reward(instance)
        await tool.release(instance)
        assert tool.open_trajectories() == 3
        await tool.close()
        return results, during, before, after, tool.open_trajectories()

    results, during, before, after, still_open = asyncio.run(main())
    assert during == 3  # one sandbox per trajectory, not per call
    for i, (text, metrics) in enumerate(results):
        lines = text.splitlines()
        assert lines[0] == "/tmp/work/sub" and lines[1] == "t%d" % i
        assert "only-t%d" % i in lines and not any(
            "only-t%d" % j in lines for j in range(3) if j != i)  # trajectories are apart
        assert metrics["exit_code"] == 0 and lines[-1] == "[exit code 0]"
    assert (before, after) == (0.0, 1.0)
    assert still_open == 0 and leased(pool) == 0


def test_a_trajectory_paused_between_steps_sees_what_one_never_paused_sees(cluster):
    """PoolConfig(pause_between_steps=True): after each call the tool pauses the
    trajectory's sandbox (frozen while the model would think), and the next call finds
    its shell, variables, directory and background process as they were."""
    steps = ["mkdir -p sub && cd sub && export WHO=me && echo made",
             "sleep 300 & echo $! > pid; echo started",
             "kill -0 $(cat pid) && echo alive; pwd; echo $WHO",
             "ls; cat pid > /dev/null && echo read"]

    async def trajectory(pool):
        tool = SandboxTool({"pool": pool, "linger_s": 30})
        texts, states = [], []
        for command in steps:
            text, _ = await tool_call(tool, "t", command)
            sb = tool._trajectories["t"].opening.result()
            texts.append(text)
            states.append(freezer_state(pool, sb.sandbox))
        await tool.close()
        return texts, states

    plain, pausing = new_pool(), new_pool(pause_between_steps=True)
    try:
        texts, states = asyncio.run(trajectory(plain))
        paused_texts, paused_states = asyncio.run(trajectory(pausing))
    finally:
        sandman.shutdown_pool(plain)
        sandman.shutdown_pool(pausing)
    assert all(text.endswith("[exit code 0]") for text in texts), texts
    assert "alive\n/tmp/work/sub\nme" in texts[2]
    assert paused_texts == texts
    assert states == ["THAWED"] * len(steps) and paused_states == ["FROZEN"] * len(steps)


async def leases(pool):
    return (await sandman.get_pool(pool).status.remote())["states"]["leased"]


async def until_no_lease(pool, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while await leases(pool) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return await leases(pool)


def test_tool_keeps_an_idle_trajectory_sandbox_for_linger_s_then_gives_it_back(pool):
    async def main():
        tool = SandboxTool({"pool": pool, "linger_s": 1.0})
        await tool_call(tool, "t", "echo kept > note")
        kept = await leases(pool)
        second, _ = await tool_call(tool, "t", "cat note")  # within linger: same sandbox
        return kept, second, await until_no_lease(pool), tool.open_trajectories()

    kept, second, after, still_open = asyncio.run(main())
    assert kept == 1 and second.startswith("kept")
    assert after == 0 and still_open == 0


def test_tool_concurrent_first_calls_of_a_trajectory_lease_once(pool):
    async def main():
        tool = SandboxTool({"pool": pool, "linger_s": 30})
        texts = await asyncio.gather(*(tool_call(tool, "same", "echo %d >> calls" % i)
                                       for i in range(4)))
        during = await leases(pool)
        lines, _ = await tool_call(tool, "same", "sort calls")
        await tool.close()
        return texts, during, lines, await leases(pool)

    texts, during, lines, after = asyncio.run(main())
    assert during == 1 and lines.split()[:4] == ["0", "1", "2", "3"]
    assert after == 0


def test_tool_a_cancelled_create_neither_fails_the_others_nor_leaks(pool):
    async def main():
        tool = SandboxTool({"pool": pool, "linger_s": 0})
        first = asyncio.ensure_future(tool.create(trajectory_id="t"))
        second = asyncio.ensure_future(tool.create(trajectory_id="t"))
        await asyncio.sleep(0)  # both are waiting for the sandbox
        first.cancel()
        instance, _ = await second  # the sandbox still comes, for the one who waits
        text = (await tool.execute(instance, {"command": "echo ok"}))[0].text
        await tool.release(instance)
        alone = asyncio.ensure_future(tool.create(trajectory_id="u"))
        await asyncio.sleep(0)
        alone.cancel()  # cancelled with nobody else on it: what it leased goes back
        with pytest.raises(asyncio.CancelledError):
            await alone
        await tool.close()
        return first.cancelled(), text, await until_no_lease(pool), tool.open_trajectories()

    first_cancelled, text, after, still_open = asyncio.run(main())
    assert first_cancelled and text.startswith("ok")
    assert after == 0 and still_open == 0


def test_tool_close_during_linger_and_create_during_release(pool):
    async def main():
        tool = SandboxTool({"pool": pool, "linger_s": 30})
        await tool_call(tool, "a", "echo 1 > mark")
        await tool_call(tool, "b", "true")
        releasing = asyncio.ensure_future(tool.release_trajectory("a"))
        await asyncio.sleep(0)
        fresh, _ = await tool_call(tool, "a", "cat mark || echo none")  # a new sandbox
        assert await releasing
        await tool.close()  # "b" lingers; close gives it (and the new "a") back now
        return fresh, await leases(pool), tool.open_trajectories()

    fresh, after, still_open = asyncio.run(main())
    assert "none" in fresh and after == 0 and still_open == 0


def test_tool_files_setup_timeouts_and_bad_calls(pool):
    async def main():
        tool = SandboxTool({"pool": pool, "exec_timeout_s": 0.5, "linger_s": 0})
        instance, _ = await tool.create(create_kwargs={
            "files": {"src/app.py": "print('hi')\n"}, "setup": "mkdir -p out"})
        out = {}
        out["files"] = (await tool.execute(instance, {"command": "cat src/app.py; ls"}))[0].text
        out["slow"] = (await tool.execute(instance, {"command": "sleep 5"}))[0].text
        out["after"] = (await tool.execute(instance, {"command": "echo alive"}))[0].text
        out["bad"] = await tool.execute(instance, {"cmd": "ls"})
        await tool.release(instance)
        with pytest.raises(sandman.SandmanError, match="no tool instance"):
            await tool.execute(instance, {"command": "true"})
        with pytest.raises(sandman.SandmanError, match="reward_command"):
            other, _ = await tool.create()
            try:
                await tool.calc_reward(other)
            finally:
                await tool.release(other)
        # ``exit 3`` ends the task's shell, where the setup runs
        with pytest.raises(sandman.SandmanError, match="setup command ended its shell"):
            await tool.create(create_kwargs={"setup": "exit 3", "trajectory_id": "x"})
        with pytest.raises(sandman.SandmanError, match="setup command exited 4"):
            await tool.create(create_kwargs={"setup": "(exit 4)", "trajectory_id": "y"})
        failing, _ = await tool.create(create_kwargs={"setup": "exit 3"})
        with pytest.raises(sandman.SandmanError, match="setup command ended its shell"):
            await tool.execute(failing, {"command": "true"})  # bound at its first call
        await tool.release(failing)
        return out, tool.open_trajectories()

    out, still_open = asyncio.run(main())
    assert "print('hi')" in out["files"] and "out" in out["files"].split()
    assert "[timed out after 0.5 s]" in out["slow"]
    assert out["after"].startswith("alive")
    text, reward, metrics = out["bad"]
    assert "needs a non-empty string parameter 'command'" in text.text and reward == 0.0
    assert still_open == 0 and leased(pool) == 0
    with pytest.raises(ValueError, match="unknown keys"):
        SandboxTool({"pool": pool, "imgae": "host"})
    with pytest.raises(ValueError, match="image or spec, not both"):
        SandboxTool({"image": "host", "spec": {"image": "host"}})
    with pytest.raises(ValueError, match="SandboxSpec has no field gpus"):
        SandboxTool({"spec": {"image": "host", "gpus": 1}})
    with pytest.raises(ValueError, match="pool name 'a/b'"):
        SandboxTool({"pool": "a/b"})


def test_under_verl_the_samples_of_one_row_get_a_sandbox_each(pool):
    """verl's agent loop creates an instance per tool call with the dataset row's
    create_kwargs (the same for all n samples of a prompt, no trajectory id) and passes
    its agent_data to execute: each sample's calls share one sandbox, and the samples
    do not see each other's. A call with no rollout to go by is a sandbox alone, given
    back at its release."""
    from verl.experimental.agent_loop.tool_agent_loop import AgentData

    row = {"files": {"calc.py": CALC_BUG}}

    async def call(tool, agent_data, command):
        instance, _ = await tool.create(create_kwargs=row)
        try:
            return (await tool.execute(instance, {"command": command},
                                       agent_data=agent_data))[0].text
        finally:
            await tool.release(instance)

    async def sample(tool, n):
        data = AgentData(messages=[], image_data=[], video_data=[], audio_data=None,
                         mm_processor_kwargs=None, metrics={}, request_id="req-%d" % n,
                         tools_kwargs={"shell": {"create_kwargs": row}})
        await call(tool, data, "echo sample%d >> calc.py && export MINE=%d" % (n, n))
        return await call(tool, data, "tail -n +3 calc.py; echo mine=$MINE")

    async def main():
        tool = SandboxTool({"pool": pool, "linger_s": 30})
        texts = await asyncio.gather(*(sample(tool, n) for n in range(3)))
        during = await leases(pool)
        alone = await call(tool, None, "cat calc.py")  # no agent_data: its own sandbox
        after_alone = await leases(pool)
        await tool.close()
        return texts, during, alone, after_alone, await leases(pool)

    texts, during, alone, after_alone, left = asyncio.run(main())
    for n, text in enumerate(texts):
        assert text.split()[:2] == ["sample%d" % n, "mine=%d" % n], text
    assert during == 3 and "return a - b" in alone and "sample" not in alone
    assert after_alone == 3 and left == 0  # the lone call's sandbox went back at release


def test_tool_schema_is_what_verl_reads():
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema
    tool = SandboxTool({})
    schema = tool.get_openai_tool_schema()
    assert isinstance(tool, BaseTool) and isinstance(schema, OpenAIFunctionToolSchema)
    assert tool.name == "shell" == schema.function.name
    assert schema.function.parameters.required == ["command"]


CALC_BUG = "def add(a, b):\n    return a - b\n"
CALC_TEST = ("import unittest\nfrom calc import add\n\n"
             "class T(unittest.TestCase):\n    def test_add(self):\n"
             "        self.assertEqual(add(2, 3), 5)\n\nunittest.main()\n")


def test_verl_loads_the_tool_from_its_yaml_and_its_agent_loop_drives_it(cluster, tmp_path):
    """verl's own loader builds the tool from a tool config YAML, and verl's
    ``ToolAgentLoop._call_tool`` (create, execute, release per call, as its agent loop
    does) drives it; the loop object carries only what ``_call_tool`` reads, since its
    constructor needs a tokenizer and an inference server."""
    import json
    from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall
    from verl.tools.base_tool import BaseTool
    from verl.tools.tool_registry import initialize_tools_from_config
    from sandman_ray.spec import DEFAULT_IMAGE

    pool = new_pool(warm={DEFAULT_IMAGE: 1})
    config = tmp_path / "tool_config.yaml"
    config.write_text("tools:\n"
                      "  - class_name: sandman_ray.integrations.verl.SandboxTool\n"
                      "    config:\n"
                      "      type: native\n"
                      "      pool: %s\n"
                      "      linger_s: 30\n"
                      "      reward_command: python3 test_calc.py\n" % pool)
    [tool] = initialize_tools_from_config(str(config))
    assert isinstance(tool, BaseTool) and tool.name == "shell"
    loop = ToolAgentLoop.__new__(ToolAgentLoop)
    loop.tools = {tool.name: tool}
    loop.max_tool_response_length = 4000
    loop.tool_response_truncate_side = "middle"
    create_kwargs = {"trajectory_id": "prompt-7-sample-0",
                     "files": {"calc.py": CALC_BUG, "test_calc.py": CALC_TEST}}
    tools_kwargs = {"shell": {"create_kwargs": create_kwargs}}
    agent_data = AgentData(messages=[], image_data=[], video_data=[], audio_data=None,
                           mm_processor_kwargs=None, metrics={}, request_id="prompt-7",
                           tools_kwargs=tools_kwargs)

    async def call(arguments: str):
        response, reward, metrics = await loop._call_tool(
            FunctionCall(name="shell", arguments=arguments), tools_kwargs, agent_data)
        return response.text, metrics

    async def reward():
        instance, _ = await tool.create(create_kwargs=create_kwargs)
        try:
            return await tool.calc_reward(instance)
        finally:
            await tool.release(instance)

    async def main():
        seen = await call(json.dumps({"command": "cat calc.py; export FIXED=no"}))
        before = await reward()
        await call(json.dumps({"command": "sed -i 's/a - b/a + b/' calc.py && FIXED=yes"}))
        tests = await call(json.dumps({"command": "python3 test_calc.py 2>&1; echo $FIXED"}))
        bad = await call("{not json")
        after = await reward()
        during = await leases(pool)
        await tool.close()
        return seen, before, tests, bad, after, during, await leases(pool)

    try:
        seen, before, tests, bad, after, during, left = asyncio.run(main())
    finally:
        sandman.shutdown_pool(pool)
    assert "return a - b" in seen[0] and seen[1]["exit_code"] == 0
    assert "OK" in tests[0] and "yes" in tests[0].split()  # one shell across the calls
    assert "Invalid JSON" in bad[0]
    assert (before, after) == (0.0, 1.0)
    assert during == 1 and left == 0  # one sandbox for the trajectory, given back at close
