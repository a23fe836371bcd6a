"""Rollout workers: Ray actors that each run many episodes at once with asyncio, one
sandbox per episode, acquired and released through sandman_ray's public API."""

import asyncio
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import ray

import sandman_ray as sandman
from coderepair import EDITS, REPO_DIR, TEST_COMMAND, edit_mask, features, make_task
from policy import Decision, LinearPolicy

EXEC_TIMEOUT_S = 30.0


@ray.remote(num_cpus=0)  # waits on sandboxes; the sandboxes do the work
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
