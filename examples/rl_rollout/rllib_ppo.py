"""RLlib PPO on sandboxes: EnvRunners step ``CodeRepairEnv``, a ``SandboxEnv`` that
leases one sandbox per episode from a sandman pool.

    python examples/rl_rollout/rllib_ppo.py [--iterations 4] [--env-runners 1]

Prints each training iteration's mean episode return, then the sandboxes left on
this host once the algorithm is stopped and the pool shut down; exits 0 only when
every iteration ran and nothing was left.
"""

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ray  # noqa: E402

import sandman_ray as sandman  # noqa: E402
from sandman_ray.spec import DEFAULT_IMAGE  # noqa: E402
from common import CACHE_ROOT, init_ray, require_positive, sandboxes_left  # noqa: E402

POOL = "rllib-ppo"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--env-runners", type=int, default=1)
    parser.add_argument("--envs-per-runner", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128, help="train batch per learner")
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument("--state-root", default="/tmp/sandman-ray/state")
    parser.add_argument("--cache-root", default=CACHE_ROOT)
    args = parser.parse_args(argv)
    require_positive(parser, args, ("iterations", "env_runners", "envs_per_runner", "batch"))
    return args


def build(args):
    from ray.rllib.algorithms.ppo import PPOConfig
    from env import CodeRepairEnv
    config = (PPOConfig()
              .environment(CodeRepairEnv, env_config={"pool": POOL, "image": args.image})
              .framework("torch")
              .env_runners(num_env_runners=args.env_runners,
                           num_envs_per_env_runner=args.envs_per_runner,
                           num_cpus_per_env_runner=0)
              .fault_tolerance(restart_failed_env_runners=False)  # an env error is raised
              .learners(num_learners=0)
              .training(train_batch_size_per_learner=args.batch, minibatch_size=64,
                        num_epochs=4, lr=3e-3, entropy_coeff=0.01)
              .debugging(seed=0))
    return config.build_algo()


def main(argv=None) -> int:
    args = parse_args(argv)
    init_ray("rllib-ppo")
    ran = episodes = 0
    leased = -1
    try:
        in_flight = args.env_runners * args.envs_per_runner
        sandman.create_pool(POOL, warm={args.image: in_flight}, max_sandboxes=in_flight + 4,
                            provider=sandman.LocalProvider(state_root=args.state_root,
                                                           cache_root=args.cache_root))
        algo = build(args)
        try:
            for _ in range(args.iterations):
                started = time.perf_counter()
                result = algo.train()
                runners = result.get("env_runners", {})
                ran += 1
                episodes += runners.get("num_episodes", 0)
                print("iteration %d: episode return mean %.2f, %d episodes, %.1f s" % (
                    ran, runners.get("episode_return_mean", float("nan")),
                    runners.get("num_episodes", 0), time.perf_counter() - started), flush=True)
        finally:
            algo.stop()
        pool = sandman.get_pool(POOL)
        deadline = time.monotonic() + 30  # leases of stopped EnvRunners are reclaimed
        while ray.get(pool.status.remote())["states"]["leased"] and time.monotonic() < deadline:
            time.sleep(0.2)
        leased = ray.get(pool.status.remote())["states"]["leased"]
        print("leases open after stop: %d" % leased)
        sandman.shutdown_pool(POOL)
    finally:
        ray.shutdown()
    n_left = sandboxes_left(POOL, args.state_root)
    print("sandboxes left: %d" % n_left)
    return 0 if ran == args.iterations and episodes > 0 and leased == 0 and n_left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
