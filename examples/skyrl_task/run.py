"""One SkyRL-gym episode in a sandbox, played by a scripted policy.

The task: ``calc.py``'s ``add`` subtracts. The "model" is a fixed list of replies that
read the file, fix it with sed, run the test and submit; the env runs each command in
the episode's sandbox and scores the submit with the task's reward command.

    python examples/skyrl_task/run.py
"""

from pathlib import Path
from typing import Sequence

import ray
import skyrl_gym

import sandman_ray as sandman
from sandman_ray.integrations.skyrl import ACTION_FORMAT, ENV_ID  # registers ENV_ID
from sandman_ray.spec import DEFAULT_IMAGE

CACHE_ROOT = str(Path(__file__).resolve().parents[2] / ".cache" / "provider")
POOL = "skyrl-task"

# One dataset row's extras, as SkyRL passes them to the env. The reward command carries
# its own check: the model could edit test_calc.py.
TASK = {
    "files": {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "test_calc.py": "from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n",
    },
    "reward_command": "python3 -c 'from calc import add; assert add(2, 3) + add(-4, 4) == 5'",
    "max_turns": 8,
}
PROMPT = [
    {"role": "system", "content": ACTION_FORMAT},
    {"role": "user", "content": "add() in calc.py is wrong. Fix it so that test_calc.py passes."},
]
POLICY = [
    "Let me look at the code.\n<bash>cat calc.py</bash>",
    "It subtracts. <bash>sed -i 's/a - b/a + b/' calc.py</bash>",
    "<bash>python3 test_calc.py</bash>",
    "The test passes. <submit>",
]


def play(pool: str, replies: Sequence[str] = POLICY) -> float:
    """Play ``replies`` as the model's turns; the episode's reward."""
    env = skyrl_gym.make(ENV_ID, env_config={"pool": pool}, extras=TASK)
    try:
        env.init(PROMPT)
        for reply in replies:
            print("model> %s" % reply)
            out = env.step(reply)
            for message in out["observations"]:
                print("%s> %s" % (message["role"], message["content"]))
            if out["done"]:
                return out["reward"]
    finally:
        env.close()
    raise RuntimeError("the replies ran out before the episode ended")


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False)
    sandman.create_pool(POOL, provider=sandman.LocalProvider(cache_root=CACHE_ROOT),
                        warm={DEFAULT_IMAGE: 1})
    try:
        print("reward: %s" % play(POOL))
    finally:
        sandman.shutdown_pool(POOL)


if __name__ == "__main__":
    main()
