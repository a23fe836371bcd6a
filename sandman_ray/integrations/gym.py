"""``SandboxEnv``: a gymnasium environment whose episodes each run in a sandbox.

``reset`` hands the last episode's sandbox back to the pool (which resets it for the
next user, in milliseconds with the LocalProvider) and leases one for the new episode;
``step`` runs the action in it; ``close`` releases it. Subclasses say what an episode
is::

    class ShellEnv(SandboxEnv):
        observation_space = gymnasium.spaces.Text(4096)
        action_space = gymnasium.spaces.Discrete(2)

        def setup(self, options):
            self.put_files({"task.txt": "..."}, "/tmp/work")
            return self.exec("cat /tmp/work/task.txt").text, {}

        def act(self, action):
            result = self.exec(["true", "false"][action])
            return result.text, float(result.ok), True, False, {}

The environment works wherever Ray does: in a driver, a Ray task or actor, or an
RLlib EnvRunner. A worker that dies takes its handle with it and the pool reclaims the
sandbox, so a crashed env leaks nothing.
"""

from typing import Any, Dict, Optional, Tuple, Union

import gymnasium as gym
import ray

import sandman_ray as sandman
from sandman_ray.client import ExecResult, tar_of
from sandman_ray.errors import SandmanError
from sandman_ray.spec import DEFAULT_IMAGE, SandboxSpec

__all__ = ["SandboxEnv"]


class SandboxEnv(gym.Env):
    """A gymnasium ``Env`` with one leased sandbox per episode.

    spec: the sandbox to lease (a SandboxSpec or an image string).
    pool: the sandman pool to lease from (it must exist, or be ``default``).
    acquire_timeout_s: how long ``reset`` waits for a sandbox.
    exec_timeout_s: the default timeout of ``exec``.

    Subclasses set ``observation_space`` and ``action_space`` and implement ``setup``
    and ``act``; inside them ``self.sandbox`` is the episode's SandboxHandle and
    ``exec``, ``put_files`` and ``read_file`` are shortcuts to it.
    """

    metadata = {"render_modes": []}

    def __init__(self, spec: Union[SandboxSpec, str] = DEFAULT_IMAGE, pool: str = "default",
                 acquire_timeout_s: float = 120.0, exec_timeout_s: float = 60.0):
        super().__init__()
        self.sandbox_spec = SandboxSpec.of(spec)  # (gymnasium's ``spec`` is the EnvSpec)
        self.pool = pool
        self.acquire_timeout_s = acquire_timeout_s
        self.exec_timeout_s = exec_timeout_s
        self.sandbox = None
        self.episodes = 0

    # ------------------------------------------------------------------ to implement
    def setup(self, options: Optional[dict]) -> Tuple[Any, Dict]:
        """Prepare the episode in ``self.sandbox``; return (observation, info)."""
        raise NotImplementedError

    def act(self, action) -> Tuple[Any, float, bool, bool, Dict]:
        """Run ``action`` in ``self.sandbox``; return (observation, reward, terminated,
        truncated, info)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ gymnasium
    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        self._release()
        self.sandbox = sandman.acquire(self.sandbox_spec, pool=self.pool,
                                       timeout=self.acquire_timeout_s)
        self.episodes += 1
        try:
            return self.setup(options)
        except BaseException as exc:
            try:
                self._release()
            except Exception as release_error:  # keep the setup error; say both
                raise SandmanError("%s.setup failed (%s) and its sandbox could not be "
                                   "released: %s" % (type(self).__name__, exc, release_error)
                                   ) from exc
            raise

    def step(self, action):
        if self.sandbox is None:
            raise SandmanError("%s.step() before reset(): no sandbox is leased"
                               % type(self).__name__)
        return self.act(action)

    def close(self) -> None:
        self._release()
        super().close()

    def _release(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            sandman.release(sandbox)

    # ------------------------------------------------------------------ shortcuts
    def exec(self, cmd, timeout: Optional[float] = None, **kwargs) -> ExecResult:
        """Run a command in the episode's sandbox (see DaemonClient.exec)."""
        return ray.get(self.sandbox.exec.remote(
            cmd, timeout=self.exec_timeout_s if timeout is None else timeout, **kwargs))

    def put_files(self, files: Dict[str, Union[str, bytes]], directory: str) -> None:
        """Write ``{relative path: contents}`` under ``directory`` in one call."""
        ray.get(self.sandbox.put_archive.remote(directory, tar_of(files)))

    def read_file(self, path: str) -> bytes:
        return ray.get(self.sandbox.read_file.remote(path))
