"""examples/rl_rollout: its tasks are honest (each bug fails its tests and only its
family's edit fixes it), the training loop learns from sandbox rewards and leaves no
sandbox, and RLlib's PPO trains on ``CodeRepairEnv`` through its EnvRunners. The runs
are subprocesses, as a user starts them, joined to the session's Ray."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, require_bwrap, shared_ray

EXAMPLE = ROOT / "examples" / "rl_rollout"
sys.path.insert(0, str(EXAMPLE))
STATE = "/tmp/sandman-ray-test/rl-state"


def run_example(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The example as a user runs it, on the session's Ray (``RAY_ADDRESS``: it starts
    none of its own, ~5 s each)."""
    return subprocess.run([sys.executable, str(EXAMPLE / script), "--state-root", STATE]
                          + list(args), capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          stdin=subprocess.DEVNULL, env=dict(os.environ, RAY_ADDRESS=shared_ray()))


def test_each_task_fails_and_only_its_familys_edit_fixes_it():
    from coderepair import EDITS, FAMILIES, FIX, TEST_COMMAND, edit_mask, features, make_task
    seen = {family: 0 for family in FAMILIES}
    for seed in range(200):
        task = make_task(seed)
        if seen[task.family] == 2:  # two of each family (each check starts Python ~5 times)
            continue
        seen[task.family] += 1
        assert make_task(seed) == task  # a seed names a task
        with tempfile.TemporaryDirectory() as repo:
            for path, text in task.files.items():
                Path(repo, path).write_text(text)

            def tests_pass():
                return subprocess.run(TEST_COMMAND.split(), cwd=repo, capture_output=True,
                                      text=True)
            before = tests_pass()
            assert before.returncode == 1 and ("FAIL" in before.stdout or "ERROR" in before.stdout)
            source = task.files[task.module_path]
            offered = edit_mask(source)
            assert offered[FIX[task.family]] and sum(offered) >= 2  # a real choice
            assert len(features(source, before.stdout)) > len(EDITS)
            for index, edit in enumerate(EDITS):
                if offered[index]:
                    Path(repo, task.module_path).write_text(edit.apply(source))
                    assert (tests_pass().returncode == 0) == (index == FIX[task.family]), \
                        (task.task_id, edit.name)
    assert set(seen.values()) == {2}


def test_training_loop_learns_from_sandbox_rewards_and_leaves_nothing(tmp_path):
    require_bwrap()
    out = tmp_path / "run.json"
    proc = run_example("train.py", "--iterations", "8", "--episodes", "32", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["errors"] == 0 and run["leases_open"] == 0 and run["sandboxes_left"] == 0
    assert run["last_reward"] >= run["first_reward"] + 0.25
    assert [h["episodes"] for h in run["history"]] == [32] * 8
    assert "sandboxes left: 0" in proc.stdout and "summary" in proc.stdout


def test_grpo_groups_fork_each_prepared_task_and_say_the_time_saved(tmp_path):
    """--group-size 4: each task prepared once, forked into 4 sandboxes, rewards
    weighed within the group; the run learns, says what forking saved against
    preparing each sandbox from scratch, and leaves no sandbox and no snapshot."""
    require_bwrap()
    out = tmp_path / "run.json"
    proc = run_example("train.py", "--group-size", "4", "--iterations", "6", "--episodes",
                       "16", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["errors"] == 0 and run["leases_open"] == 0 and run["sandboxes_left"] == 0
    groups = run["groups"]
    assert groups["groups"] == 6 * 4 and groups["size"] == 4
    assert groups["scratch_ms"] == pytest.approx(4 * groups["prepare_p50_ms"])
    assert groups["forked_ms"] < groups["scratch_ms"] and groups["saved_ms"] > 0
    assert "time saved by forking" in proc.stdout
    assert run["last_reward"] >= run["first_reward"] + 0.25


def test_bad_arguments_are_refused_before_anything_starts():
    for args, message in ((["--episodes", "0"], "--episodes must be at least 1"),
                          (["--policy", "openai"], "needs --openai-base-url"),
                          (["--iterations", "1"], "at least 2"),
                          (["--group-size", "3", "--episodes", "16"], "multiple of --group-size")):
        proc = run_example("train.py", *args, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.slow
def test_rllib_ppo_trains_on_sandbox_envs_and_leaves_nothing():
    require_bwrap()
    pytest.importorskip("ray.rllib")
    pytest.importorskip("torch")
    proc = run_example("rllib_ppo.py", "--iterations", "2", "--batch", "64", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("iteration ") for line in lines) == 2
    assert "leases open after stop: 0" in lines and "sandboxes left: 0" in lines
