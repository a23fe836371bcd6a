"""The SkyRL-gym integration on a real local Ray with the LocalProvider: envs made by the
installed skyrl_gym's ``make``, each episode in a leased ``builtin:debian`` sandbox."""

import importlib.util

import pytest

import sandman_ray as sandman
from conftest import ROOT, leased, own_pool, shared_ray
from sandman_ray.spec import DEFAULT_IMAGE

import skyrl_gym  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402  (a skyrl_gym dependency)
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402

from sandman_ray.integrations.skyrl import ENV_ID, SandboxTextEnv, register_envs  # noqa: E402

STATE = "/tmp/sandman-ray-test/skyrl-state"
PROMPT = [{"role": "user", "content": "fix add() in calc.py"}]
TASK = {
    "files": {"calc.py": "def add(a, b):\n    return a - b\n",
              "test_calc.py": "from calc import add\nassert add(2, 3) == 5\nprint('passed')\n"},
    "reward_command": "python3 -c 'from calc import add; assert add(2, 3) == 5'",
    # what a SkyRL dataset row also carries: not the env's business
    "reward_spec": {"method": "rule", "ground_truth": None}, "extra_info": {"index": 3},
}


@pytest.fixture(scope="module")
def cluster():
    yield shared_ray()


@pytest.fixture(scope="module")
def pool(cluster):
    """One pool for the module's episodes (each gives its sandbox back: the counts
    checked after each would see one that leaked)."""
    with own_pool(STATE, "skyrl", warm={DEFAULT_IMAGE: 2}) as name:
        yield name


def make(pool: str, config=None, **extras):
    return skyrl_gym.make(ENV_ID, env_config=dict({"pool": pool}, **(config or {})),
                          extras=dict(TASK, **extras))


def shown(out) -> str:
    """The one observation of a step that did not end the episode."""
    assert out["done"] is False and out["reward"] == 0.0
    [message] = out["observations"]
    assert message["role"] == "user"
    return message["content"]


def test_the_right_fix_is_rewarded_and_its_sandbox_given_back_at_once(pool):
    # env_config as SkyRL passes it: an OmegaConf DictConfig
    env = skyrl_gym.make(ENV_ID, env_config=OmegaConf.create({"pool": pool}), extras=TASK)
    assert isinstance(env, SandboxTextEnv) and isinstance(env, BaseTextEnv)
    prompt, info = env.init(PROMPT)
    assert prompt == PROMPT and info["sandbox_id"]
    assert leased(pool) == 1
    assert "return a - b" in shown(env.step("First, the code. <bash>cat calc.py</bash>"))
    failing = shown(env.step("<bash>python3 test_calc.py</bash>"))
    assert "AssertionError" in failing and "[exit code 1]" in failing
    shown(env.step("<bash>sed -i 's/a - b/a + b/' calc.py</bash>"))
    passing = shown(env.step("<bash>python3 test_calc.py</bash>"))
    assert "passed" in passing and "[exit code 0]" in passing
    out = env.step("Fixed. <submit>")
    assert (out["done"], out["reward"], out["observations"]) == (True, 1.0, [])
    assert out["metadata"]["submitted"] is True and out["metadata"]["reward_exit_code"] == 0
    assert leased(pool) == 0  # given back when done, before close
    assert env.get_metrics() == {"turns": 5, "commands": 4, "command_timeouts": 0,
                                 "submitted": 1}
    with pytest.raises(sandman.SandmanError, match="after the episode ended"):
        env.step("<bash>ls</bash>")
    env.close()
    env.close()
    assert leased(pool) == 0


def test_a_wrong_fix_is_rewarded_zero(pool):
    env = make(pool)
    env.init(PROMPT)
    shown(env.step("<bash>sed -i 's/a - b/a * b/' calc.py</bash>"))
    out = env.step("<submit/>")
    assert (out["done"], out["reward"]) == (True, 0.0)
    assert "AssertionError" in out["metadata"]["reward_output"]
    env.close()
    assert leased(pool) == 0


def test_the_reward_ignores_what_the_model_defined_in_its_shell(pool):
    env = make(pool)
    env.init(PROMPT)
    shown(env.step("<bash>python3() { return 0; }; export PYTHONPATH=/nowhere</bash>"))
    assert env.step("<submit>")["reward"] == 0.0
    env.close()


def test_directory_variables_and_files_persist_across_steps(pool):
    env = make(pool, setup="export GREETING=hello")
    env.init(PROMPT)
    shown(env.step("<bash>mkdir -p sub && cd sub && export LEVEL=7 && echo kept > note</bash>"))
    here = shown(env.step("<bash>pwd; echo $LEVEL $GREETING; cat note</bash>"))
    assert "/tmp/work/sub\n7 hello\nkept\n" in here
    assert "kept" in shown(env.step("<bash>cat /tmp/work/sub/note</bash>"))
    env.close()  # mid-episode: the sandbox goes back all the same
    assert leased(pool) == 0


def test_two_episodes_do_not_see_each_others_files(pool):
    first, second = make(pool), make(pool)
    first.init(PROMPT)
    second.init(PROMPT)
    try:
        assert first.sandbox.sandbox_id() != second.sandbox.sandbox_id()
        shown(first.step("<bash>echo mine > secret && echo mine > /tmp/secret</bash>"))
        seen = shown(second.step("<bash>cat secret /tmp/secret; ls</bash>"))
        assert "mine" not in seen and "No such file" in seen and "calc.py" in seen
        assert "mine" in shown(first.step("<bash>cat /tmp/secret</bash>"))
    finally:
        first.close()
        second.close()
    assert leased(pool) == 0


def test_the_last_turn_runs_its_command_then_ends_the_episode(pool):
    env = make(pool, max_turns=2)
    env.init(PROMPT)
    shown(env.step("<bash>true</bash>"))
    out = env.step("<bash>sed -i 's/a - b/a + b/' calc.py</bash>")
    assert (out["done"], out["reward"], out["observations"]) == (True, 1.0, [])
    assert out["metadata"]["submitted"] is False and out["metadata"]["exit_code"] == 0
    assert leased(pool) == 0
    env.close()


def test_max_turns_from_env_config_when_extras_have_none(pool):
    env = skyrl_gym.make(ENV_ID, env_config={"pool": pool, "max_turns": 1},
                         extras={"reward_command": "false"})
    env.init(PROMPT)
    out = env.step("no tool call at all")
    assert (out["done"], out["reward"]) == (True, 0.0)
    env.close()
    assert leased(pool) == 0


def test_a_malformed_reply_is_answered_with_an_error_and_uses_its_turn(pool):
    env = make(pool, max_turns=10)
    env.init(PROMPT)
    replies = {
        "I think the bug is in add().": "no action found",
        "<bash>ls": "without a closing </bash>",
        "<bash>ls</bash> and <bash>pwd</bash>": "one <bash>...</bash> block per reply, found 2",
        "<bash>   </bash>": "empty",
    }
    for reply, problem in replies.items():
        out = env.step(reply)
        assert shown(out).startswith("error: ") and problem in shown(out)
        assert out["metadata"]["error"]
    assert env.turns == 4 and env.commands == 0
    assert "calc.py" in shown(env.step("<bash>ls</bash>"))  # the episode goes on
    env.close()


def test_long_output_keeps_head_and_tail_with_a_note(pool):
    env = make(pool, config={"max_output_chars": 200})
    env.init(PROMPT)
    text = shown(env.step("<bash>seq 1 20000</bash>"))
    body = text[len("<output>\n"):text.index("</output>")]
    assert body.startswith("1\n2\n3\n") and body.endswith("19999\n20000\n")
    assert "characters cut ...]" in body and len(body) < 260
    assert text.endswith("[exit code 0]")
    # past what the daemon keeps, the tail shown is not the command's, and it says so
    text = shown(env.step("<bash>seq 1 300000</bash>"))
    assert "\n300000\n" not in text and "KiB per stream was dropped" in text
    env.close()


def test_a_command_past_its_timeout_is_stopped_and_said_so(pool):
    env = make(pool, config={"exec_timeout_s": 0.5})
    env.init(PROMPT)
    text = shown(env.step("<bash>echo started; sleep 30</bash>"))
    assert "started" in text and "[timed out after 0.5 s]" in text
    assert "calc.py" in shown(env.step("<bash>ls</bash>"))  # the shell survived
    assert env.get_metrics()["command_timeouts"] == 1
    env.close()


def test_a_shell_that_exits_is_replaced_in_the_workdir(pool):
    env = make(pool)
    env.init(PROMPT)
    shown(env.step("<bash>cd / && export GONE=1</bash>"))
    ended = shown(env.step("<bash>exit 3</bash>"))
    assert "[the shell ended; a new one starts in /tmp/work]" in ended
    assert "/tmp/work\n[]" in shown(env.step("<bash>pwd; echo [$GONE]</bash>"))
    env.close()


def test_a_submit_marker_inside_a_command_is_part_of_the_command(pool):
    env = make(pool)
    env.init(PROMPT)
    assert "<submit>" in shown(env.step("<bash>echo '<submit>'</bash>"))
    assert env.step("done. <submit/>")["done"]
    env.close()


def test_a_model_that_removes_its_workdir_gets_answers_and_a_zero_not_an_error(pool):
    env = make(pool)
    env.init(PROMPT)
    shown(env.step("<bash>cd / && rm -rf /tmp/work</bash>"))
    ended = shown(env.step("<bash>exit</bash>"))  # the new shell cannot start there
    assert "/tmp/work is gone" in ended
    assert "exit code 0" in shown(env.step("<bash>pwd</bash>"))
    out = env.step("<submit>")  # the reward command cannot start in /tmp/work either
    assert out["done"] and out["reward"] == 0.0 and out["metadata"]["reward_error"]
    assert leased(pool) == 0
    env.close()


def test_a_failing_setup_raises_from_init_and_keeps_no_lease(pool):
    env = make(pool, setup="echo broken >&2; (exit 4)")
    with pytest.raises(sandman.SandmanError, match="setup command exited 4 in sandbox .*broken"):
        env.init(PROMPT)
    assert leased(pool) == 0
    with pytest.raises(sandman.SandmanError, match="before init"):
        env.step("<bash>ls</bash>")


def test_files_from_a_dataset_column_skip_absent_entries(pool):
    # a ``datasets`` column of dicts gives each row every row's keys, as None
    files = dict(TASK["files"], **{"other_task.py": None})
    records = [{"path": "data/input.txt", "contents": "42\n"}]
    env, listed = make(pool, files=files), make(pool, files=records)
    env.init(PROMPT)
    listed.init(PROMPT)
    assert "other_task.py" not in shown(env.step("<bash>ls</bash>"))
    assert "42" in shown(listed.step("<bash>cat data/input.txt</bash>"))
    env.close()
    listed.close()


@pytest.mark.parametrize("config, extras, problem", [
    ({}, {"reward_command": ""}, r"extras\['reward_command'\] must be a command"),
    ({"pool": "p", "timeout": 3}, {}, r"unknown keys \['timeout'\]"),
    ({"image": "host", "spec": {"image": "host"}}, {}, "image or spec, not both"),
    ({"spec": {"image": "host", "gpus": 1}}, {}, "bad sandbox spec: SandboxSpec has no field gpus"),
    ({"exec_timeout_s": 0}, {}, r"env_config\['exec_timeout_s'\] must be positive seconds"),
    ({"workdir": "work"}, {}, r"env_config\['workdir'\] must be an absolute path"),
    ({}, {"max_turns": 0}, r"extras\['max_turns'\] must be a positive integer"),
    ({}, {"max_turns": "5"}, r"extras\['max_turns'\] must be a positive integer"),
    ({}, {"files": {"/etc/passwd": "x"}}, "must be relative to the workdir"),
    ({}, {"files": {"../up": "x"}}, "must be relative to the workdir"),
    ({}, {"files": {"n.txt": 5}}, r"extras\['files'\]\['n.txt'\] must be str or bytes"),
    ({}, {"files": "calc.py"}, r"extras\['files'\] must map paths to contents"),
    ({}, {"setup": ["pip", "install"]}, r"extras\['setup'\] must be a command string"),
    ({"pool": "a/b"}, {}, r"env_config\['pool'\]: pool name 'a/b'"),
    ({"pool": None}, {}, r"env_config\['pool'\]: pool name None"),
])
def test_bad_input_is_refused_naming_the_problem(config, extras, problem):
    with pytest.raises(ValueError, match=problem):
        skyrl_gym.make(ENV_ID, env_config=config, extras=dict(TASK, **extras))


def test_registering_again_is_harmless_and_a_taken_id_is_refused():
    register_envs()
    assert skyrl_gym.registry[ENV_ID].entry_point == "sandman_ray.integrations.skyrl:SandboxTextEnv"
    saved = skyrl_gym.registry.pop(ENV_ID)
    try:
        skyrl_gym.register(id=ENV_ID, entry_point="elsewhere:OtherEnv")
        with pytest.raises(skyrl_gym.error.RegistrationError, match="taken"):
            register_envs()
    finally:
        skyrl_gym.registry[ENV_ID] = saved


def test_the_example_fixes_its_task(pool):
    spec = importlib.util.spec_from_file_location(
        "skyrl_task_run", ROOT / "examples" / "skyrl_task" / "run.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.play(pool) == 1.0
    assert example.play(pool, example.POLICY[:1] + example.POLICY[-1:]) == 0.0
    assert leased(pool) == 0
