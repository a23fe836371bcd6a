"""Rollout workers: Ray actors that each run many episodes at once with asyncio, one
sandbox per episode, acquired and released through sandman_ray's public API."""

import asyncio
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import ray

import sandman_ray as sandman
from coderepair import EDITS, REPO_DIR, TEST_COMMAND, edit_mask, features, make_task
from policy import Decision, LinearPolicy, group_advantages

EXEC_TIMEOUT_S = 30.0
# A task's set-up in group mode (``--group-size``), standing in for the dependency
# install of a SWE task: a copy of the image's Python standard library, compiled
# (~27 MB, ~1.3 s here). Done once per task; its G samples fork from it.
PREPARE_COMMAND = ("mkdir -p /opt/deps && cp -r /usr/lib/python3* /opt/deps/ && "
                   "python3 -m compileall -q /opt/deps")


class RolloutWorker:
    """Runs episodes: acquire a sandbox, put the task's repository in it, inspect the
    files, run the tests, apply the edit the policy picks, run the tests again; the
    reward is whether they pass. ``concurrency`` episodes are in flight at once."""

    def __init__(self, index: int, pool: str, spec: sandman.SandboxSpec, concurrency: int,
                 openai: Optional[dict] = None, seed: int = 0):
        self.index, self.pool, self.spec = index, pool, spec
        self.concurrency = concurrency
        self.rng = np.random.default_rng(seed + 7919 * index)
        self.chooser = None
        if openai is not None:
            from openai_policy import OpenAIChooser
            self.chooser = OpenAIChooser(**openai)
        self.done = 0

    def progress(self) -> int:
        """Episodes finished since the last ``rollout`` began."""
        return self.done

    async def rollout(self, weights: np.ndarray, seeds: Sequence[int]) -> List[Dict]:
        """One episode per task seed; returns one record per episode (an ``error`` key
        instead of a reward when the episode could not run)."""
        self.done = 0
        gate = asyncio.Semaphore(self.concurrency)

        async def guarded(seed):
            async with gate:
                try:
                    return await self._episode(weights, seed)
                except Exception as exc:  # reported per episode; the batch goes on
                    return {"seed": seed, "error": "%s: %s" % (type(exc).__name__, exc)}
                finally:
                    self.done += 1
        return await asyncio.gather(*(guarded(s) for s in seeds))

    async def rollout_groups(self, weights: np.ndarray, seeds: Sequence[int],
                             group_size: int) -> List[Dict]:
        """GRPO-style: per task seed, one sandbox prepared (the repository, its set-up,
        the tests run once), forked into ``group_size`` sandboxes that each try an edit
        the policy samples; each record carries its advantage within the group."""
        self.done = 0
        gate = asyncio.Semaphore(max(1, self.concurrency // group_size))

        async def guarded(seed):
            async with gate:
                try:
                    return await self._group(weights, seed, group_size)
                except Exception as exc:  # reported per episode; the batch goes on
                    return [{"seed": seed, "error": "%s: %s" % (type(exc).__name__, exc)}
                            ] * group_size
                finally:
                    self.done += group_size
        groups = await asyncio.gather(*(guarded(s) for s in seeds))
        return [record for group in groups for record in group]

    async def _group(self, weights: np.ndarray, seed: int, group_size: int) -> List[Dict]:
        task = make_task(seed)
        started = time.perf_counter()
        sb = await sandman.acquire_async(self.spec, pool=self.pool, timeout=120)
        acquire_s = time.perf_counter() - started
        forks: List = []
        try:
            await sb.put_archive.remote(REPO_DIR, task.tar())
            setup = await sb.exec.remote(["sh", "-c", PREPARE_COMMAND], timeout=120)
            if setup.exit_code != 0:
                raise RuntimeError("task %s: its set-up failed: %s" % (
                    task.task_id, setup.stderr[-300:].decode(errors="replace")))
            begun = time.perf_counter()
            source = (await sb.exec.remote("cat " + task.module_path, cwd=REPO_DIR)).text
            exec_s = [time.perf_counter() - begun]
            before = await sb.exec.remote(TEST_COMMAND, cwd=REPO_DIR, timeout=EXEC_TIMEOUT_S)
            if before.exit_code == 0:
                raise RuntimeError("task %s passes before any edit" % task.task_id)
            prepare_s = time.perf_counter() - started
            forked = time.perf_counter()
            forks = await sandman.fork_async(sb, group_size, timeout=120)
            fork_s = time.perf_counter() - forked
            observed, offered = features(source, before.text), edit_mask(source)
            samples = await asyncio.gather(*(self._sample(f, weights, task, source, observed,
                                                          offered) for f in forks))
        finally:
            await asyncio.gather(*(sandman.release_async(f) for f in forks + [sb]))
        rewards = [reward for reward, _, _ in samples]
        advantages = group_advantages(rewards)
        return [{"seed": seed, "family": task.family, "group": seed,
                 "decision": Decision(observed, offered, action), "reward": reward,
                 "advantage": advantage, "acquire_s": acquire_s, "exec_s": exec_s,
                 "test_s": [test_s], "episode_s": time.perf_counter() - started,
                 "prepare_s": prepare_s, "fork_s": fork_s, "group_size": group_size}
                for (reward, action, test_s), advantage in zip(samples, advantages)]

    async def _sample(self, sb, weights, task, source, observed, offered):
        """One sample of a group: the edit the policy picks, applied in a fork, and the
        tests run; (reward, action, seconds the tests took)."""
        action = LinearPolicy.sample(weights, observed, offered, self.rng)
        await sb.write_file.remote("%s/%s" % (REPO_DIR, task.module_path),
                                   EDITS[action].apply(source))
        begun = time.perf_counter()
        after = await sb.exec.remote(TEST_COMMAND, cwd=REPO_DIR, timeout=EXEC_TIMEOUT_S)
        return (1.0 if after.exit_code == 0 else 0.0), action, time.perf_counter() - begun

    async def _episode(self, weights: np.ndarray, seed: int) -> Dict:
        task = make_task(seed)
        started = time.perf_counter()
        sb = await sandman.acquire_async(self.spec, pool=self.pool, timeout=120)
        acquire_s = time.perf_counter() - started
        exec_s: List[float] = []
        test_s: List[float] = []

        async def run(cmd, samples):
            begun = time.perf_counter()
            result = await sb.exec.remote(cmd, cwd=REPO_DIR, timeout=EXEC_TIMEOUT_S)
            samples.append(time.perf_counter() - begun)
            return result

        try:
            await sb.put_archive.remote(REPO_DIR, task.tar())
            listing = await run("ls", exec_s)                       # inspect the repository
            source = (await run("cat " + task.module_path, exec_s)).text
            if task.module_path not in listing.text.split() or not source:
                raise RuntimeError("task %s: the repository did not arrive in the sandbox"
                                   % task.task_id)
            before = await run(TEST_COMMAND, test_s)                 # run the tests
            if before.exit_code == 0:
                raise RuntimeError("task %s passes before any edit" % task.task_id)
            observed = features(source, before.text)
            offered = edit_mask(source)
            if self.chooser is not None:
                action = await self.chooser.choose(source, before.text, offered)
            else:
                action = LinearPolicy.sample(weights, observed, offered, self.rng)
            await sb.write_file.remote("%s/%s" % (REPO_DIR, task.module_path),
                                       EDITS[action].apply(source))  # apply one edit
            after = await run(TEST_COMMAND, test_s)                  # run the tests again
        finally:
            await sandman.release_async(sb)
        return {"seed": seed, "family": task.family,
                "decision": Decision(observed, offered, action),
                "reward": 1.0 if after.exit_code == 0 else 0.0,
                "acquire_s": acquire_s, "exec_s": exec_s, "test_s": test_s,
                "episode_s": time.perf_counter() - started}


# an actor that waits on sandboxes (the sandboxes do the work): it takes no CPU
RemoteRolloutWorker = ray.remote(num_cpus=0)(RolloutWorker)
