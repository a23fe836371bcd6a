"""``SandboxTextEnv``: a SkyRL-gym text environment whose episode runs in a sandbox.

The model acts in text. Each reply either runs one shell command or ends the episode::

    <bash>sed -i 's/a - b/a + b/' calc.py</bash>     one command, in a persistent shell
    <submit>                                         done: score the task

(``ACTION_FORMAT`` says this in words, for a system prompt.) The command runs in the
episode's shell session, so ``cd``, variables and files carry over to the next turn;
its output (stdout, then stderr) comes back as the next observation, ``{"role": "user",
"content": "<output>\\n...</output>\\n[exit code 0]"}``, with reward 0. A reply with a
submit marker ends the episode (a ``<bash>`` block beside it is not run, as SkyRL's own
envs ignore a tool call beside ``<solution>``); so does the ``max_turns``-th reply,
after its command has run. Then the task's reward command runs in the sandbox: reward
1.0 when it exits 0, else 0.0, and the sandbox goes back to the pool. A reply that is
not one well-formed action (no block, two blocks, an unclosed or empty one) is the
model's mistake: it is answered with an ``error: ...`` observation and uses up its turn.

The episode is ``skyrl_gym.make`` -> ``init(prompt)`` (lease a sandbox, put the task's
files in ``workdir``, run its setup there) -> ``step`` ... -> done -> ``close`` (gives
the sandbox back if the episode did not end; an env dropped without ``close`` gives it
back when collected, as any dropped SandboxHandle does). Importing this module registers
the env as ``sandman-bash`` (``ENV_ID``); a SkyRL entrypoint imports it before
training, in every process that calls ``skyrl_gym.make``.

env_config (SkyRL's ``environment.skyrl_gym.sandman-bash``; a dict, DictConfig or
dataclass; all optional):
    pool: the sandman pool to lease from (``default``): a pool's name, a service's URL
        (its key in $SANDMAN_API_KEY) or ``sandman_ray.connect(...)``'s pool.
    image: the sandbox image (``builtin:debian``), or spec: a dict of SandboxSpec fields.
    workdir: where the task's files land and the shell starts (``/tmp/work``).
    max_turns: used when extras has none (10).
    exec_timeout_s: per model command (30). task_timeout_s: the setup and reward
        commands (300). acquire_timeout_s: for a sandbox (120).
    max_output_chars: output shown to the model per command (4000): a longer one keeps
        its head and tail, with a note of what was cut.

extras (per sample: the dataset row's columns, as SkyRL passes them):
    reward_command (required): scores the episode; exit 0 means solved. It runs as a
        command of its own in ``workdir``, not in the model's shell, so nothing the model
        defined there (functions, aliases, variables) changes how it is scored.
    files: ``{relative path: contents}`` put under ``workdir``, or a list of ``{"path":
        ..., "contents": ...}`` records. Entries whose contents are None are skipped: a
        ``datasets`` column of dicts gives every row the keys of all rows, as None.
    setup: a command run once in the model's shell before the first turn (its exported
        variables and directory persist); a failure raises from ``init``.
    max_turns: the turn budget (SkyRL's generator sets it from its own ``max_turns``).
    image: this task's image, over the config's.
Other keys (``reward_spec``, ``extra_info`` ...) are ignored.
"""

import dataclasses
import operator
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any, Dict, Optional, Tuple, Union

from sandman_ray.integrations import require_python

require_python("skyrl", "skyrl-gym 0.4", (3, 10))

import skyrl_gym  # noqa: E402  (after the check: skyrl-gym's own import says nothing)
from skyrl_gym.envs.base_text_env import (  # noqa: E402
    BaseTextEnv, BaseTextEnvStepOutput, ConversationType)

from sandman_ray.errors import DaemonError, SandmanError  # noqa: E402
from sandman_ray.integrations.sandboxes import (  # noqa: E402
    SESSION, Leases, check_workdir, clip, output_text, prepare, sandbox_spec)
from sandman_ray.integrations.steps import step_done  # noqa: E402
from sandman_ray.spec import SandboxSpec  # noqa: E402

__all__ = ["ACTION_FORMAT", "ENV_ID", "SandboxTextEnv", "register_envs"]

ENV_ID = "sandman-bash"
ENTRY_POINT = "sandman_ray.integrations.skyrl:SandboxTextEnv"

ACTION_FORMAT = (
    "Act by running shell commands: write exactly one command per reply as "
    "<bash>command</bash>. Its output comes back in <output>...</output> with its exit "
    "code. The shell keeps its working directory, variables and files between commands. "
    "When the task is done, reply <submit>.")

_BASH_BLOCK = re.compile(r"<bash>(.*?)</bash>", re.DOTALL)
_SUBMIT = re.compile(r"<submit\s*/?>")
_CONFIG_KEYS = frozenset({"pool", "image", "spec", "workdir", "max_turns", "exec_timeout_s",
                          "task_timeout_s", "acquire_timeout_s", "max_output_chars"})
# Output the daemon keeps per stream of a command (the rest is dropped there): the view
# shown to the model is the head and tail of this, so the tail is the command's own for
# any output up to it. Only a command that prints that much pays for it: ``cat`` of 1 MiB
# in a session took 7-9 ms here against 2.5 ms for 4 KiB (direct calls, a 2-vCPU VM).
OUTPUT_KEPT_BYTES = 1 << 20


class SandboxTextEnv(BaseTextEnv):
    """A multi-turn shell task in one leased sandbox per episode (see the module).

    After ``init``, ``sandbox`` is the episode's SandboxHandle (None once it is given
    back). ``get_metrics`` reports turns, commands run, their timeouts and whether the
    model submitted.
    """

    def __init__(self, env_config: Any = None, extras: Optional[Mapping] = None):
        super().__init__()
        config = _plain(env_config, "env_config")
        unknown = sorted(set(config) - _CONFIG_KEYS)
        if unknown:
            raise ValueError("SandboxTextEnv: env_config has unknown keys %s (known: %s)"
                             % (unknown, sorted(_CONFIG_KEYS)))
        extras = _plain(extras, "extras")
        try:
            self.leases = Leases(config.get("pool", "default"))
        except ValueError as exc:
            raise ValueError("SandboxTextEnv: env_config['pool']: %s" % exc) from None
        self.pool = self.leases.name
        self.sandbox_spec = _spec(config, extras)
        self.workdir = check_workdir(config.get("workdir", "/tmp/work"),
                                     "SandboxTextEnv: env_config['workdir']")
        self.exec_timeout_s = _seconds(config, "exec_timeout_s", 30.0)
        self.task_timeout_s = _seconds(config, "task_timeout_s", 300.0)
        self.acquire_timeout_s = _seconds(config, "acquire_timeout_s", 120.0)
        self.max_output_chars = _count(config, "env_config", "max_output_chars", 4000)
        # a None column of a dataset is an absent value
        self.max_turns = _count(extras, "extras", "max_turns", None) \
            if extras.get("max_turns") is not None \
            else _count(config, "env_config", "max_turns", 10)
        self.reward_command = extras.get("reward_command")
        if not isinstance(self.reward_command, str) or not self.reward_command.strip():
            raise ValueError("SandboxTextEnv: extras['reward_command'] must be a command that "
                             "exits 0 when the task is solved, got %r (extras has keys %s)"
                             % (self.reward_command, sorted(extras)))
        self.setup = extras.get("setup")
        if self.setup is not None and not isinstance(self.setup, str):
            raise ValueError("SandboxTextEnv: extras['setup'] must be a command string, got %r"
                             % (self.setup,))
        self.files = _task_files(extras.get("files"))
        self.sandbox = None
        self.done = False
        self.submitted = False
        self.commands = 0  # commands the model ran
        self.command_timeouts = 0

    # ------------------------------------------------------------------ SkyRL-gym
    def init(self, prompt: ConversationType) -> Tuple[ConversationType, Dict[str, Any]]:
        """Lease the episode's sandbox and prepare the task in it; the prompt is
        returned as it is, with ``{"sandbox_id"}``."""
        if self.sandbox is not None or self.done:
            raise SandmanError("SandboxTextEnv.init() called twice: an env is one episode")
        self.sandbox = self.leases.acquire(self.sandbox_spec, self.acquire_timeout_s)
        try:
            self._prepare()
            sandbox_id = self.sandbox.sandbox
            step_done(self.sandbox)  # the model writes the first action now
        except BaseException as exc:
            self._release_after(exc)
            raise
        return prompt, {"sandbox_id": sandbox_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.done:
            raise SandmanError("SandboxTextEnv.step() after the episode ended")
        if self.sandbox is None:
            raise SandmanError("SandboxTextEnv.step() before init(): no sandbox is leased")
        if not isinstance(action, str):
            raise TypeError("SandboxTextEnv.step() takes the model's reply as a str, got %s"
                            % type(action).__name__)
        self.turns += 1
        try:
            if _SUBMIT.search(_BASH_BLOCK.sub("", action)):  # a marker outside commands
                self.submitted = True
                return self._finish({"submitted": True})
            command, problem = _parse(action)
            if problem is not None:
                observation, metadata = "error: " + problem, {"error": problem}
            else:
                observation, metadata = self._run(command)
            if self.turns >= self.max_turns:
                metadata["submitted"] = False
                return self._finish(metadata)
            step_done(self.sandbox)
        except BaseException as exc:
            self._release_after(exc)
            raise
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": observation}],
                                     reward=0.0, done=False, metadata=metadata)

    def close(self) -> None:
        """Give the sandbox back if the episode still holds it (twice is fine)."""
        self._release()

    def get_metrics(self) -> Dict[str, Any]:
        return {"turns": self.turns, "commands": self.commands,
                "command_timeouts": self.command_timeouts, "submitted": int(self.submitted)}

    # ------------------------------------------------------------------ the episode
    def _prepare(self) -> None:
        prepare(self.sandbox, self.workdir, self.files, self.setup, self.task_timeout_s,
                SESSION)

    def _run(self, command: str) -> Tuple[str, Dict[str, Any]]:
        """Run the model's command in its shell: the observation and the step's metadata."""
        self.commands += 1
        result = self.sandbox.run(command, session=SESSION, timeout=self.exec_timeout_s,
                                  max_output=OUTPUT_KEPT_BYTES)
        notes = []
        if result.truncated:
            notes.append("[output past %d KiB per stream was dropped: the end shown is "
                         "not the command's]" % (OUTPUT_KEPT_BYTES // 1024))
        if result.timed_out:
            self.command_timeouts += 1
            notes.append("[timed out after %g s]" % self.exec_timeout_s)
        if result.exit_code is not None:
            notes.append("[exit code %d]" % result.exit_code)
        if not result.session_alive:  # ``exit``, or a busy shell killed at the timeout
            self.sandbox.session_close(SESSION)
            try:
                self.sandbox.session_open(SESSION, cwd=self.workdir)
                notes.append("[the shell ended; a new one starts in %s%s]" % (
                    self.workdir, ", without what the setup exported" if self.setup else ""))
            except DaemonError:  # the model removed the workdir (or made it a file)
                self.sandbox.session_open(SESSION)
                notes.append("[the shell ended; %s is gone, so a new one starts in the "
                             "sandbox's working directory]" % self.workdir)
        text = self._clipped(output_text(result))
        observation = "<output>\n%s%s</output>\n%s" % (
            text, "" if not text or text.endswith("\n") else "\n", "\n".join(notes))
        return observation, {"command": command, "exit_code": result.exit_code,
                             "timed_out": result.timed_out, "duration_s": result.duration_s}

    def _finish(self, metadata: Dict[str, Any]) -> BaseTextEnvStepOutput:
        """Score the episode with the reward command and give the sandbox back."""
        self.done = True
        try:
            result = self.sandbox.exec(self.reward_command, cwd=self.workdir,
                                       timeout=self.task_timeout_s,
                                       max_output=OUTPUT_KEPT_BYTES)
        except DaemonError as exc:  # it could not start: the model removed the workdir
            result = None
            metadata.update(reward_error=str(exc))
        self._release()
        metadata.update(turns=self.turns)
        if result is not None:
            metadata.update(reward_exit_code=result.exit_code,
                            reward_timed_out=result.timed_out,
                            reward_output=self._clipped(output_text(result)))
        return BaseTextEnvStepOutput(observations=[],
                                     reward=1.0 if result is not None and result.ok else 0.0,
                                     done=True, metadata=metadata)

    # ------------------------------------------------------------------ helpers
    def _clipped(self, text: str) -> str:
        return clip(text, self.max_output_chars)

    def _release(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            self.leases.release(sandbox)

    def _release_after(self, exc: BaseException) -> None:
        """The episode failed with ``exc``: give the sandbox back, keeping ``exc`` the
        error raised (and saying so if the release fails too)."""
        try:
            self._release()
        except Exception as release_error:
            raise SandmanError("SandboxTextEnv: %s (%s), and its sandbox could not be "
                               "released: %s" % (type(exc).__name__, exc, release_error)
                               ) from exc


def register_envs() -> None:
    """Register ``SandboxTextEnv`` with skyrl_gym as ``sandman-bash`` (done on import;
    calling it again does nothing)."""
    existing = skyrl_gym.registry.get(ENV_ID)
    if existing is None:
        skyrl_gym.register(id=ENV_ID, entry_point=ENTRY_POINT)
    elif existing.entry_point not in (ENTRY_POINT, SandboxTextEnv):
        raise skyrl_gym.error.RegistrationError(
            "skyrl_gym env id %r is taken by %r; sandman_ray's SandboxTextEnv needs it"
            % (ENV_ID, existing.entry_point))


# ---------------------------------------------------------------------- parsing
def _parse(action: str) -> Tuple[Optional[str], Optional[str]]:
    """The command of a reply, or the problem with it (said to the model)."""
    blocks = _BASH_BLOCK.findall(action)
    if len(blocks) > 1:
        return None, "write one <bash>...</bash> block per reply, found %d" % len(blocks)
    if not blocks:
        if "<bash>" in action:
            return None, "<bash> without a closing </bash>"
        return None, ("no action found: run a command as <bash>command</bash>, "
                      "or reply <submit> when the task is done")
    command = blocks[0].strip()
    if not command:
        return None, "the <bash></bash> block is empty"
    return command, None


# ---------------------------------------------------------------------- configuration
def _plain(value: Any, what: str) -> Dict[str, Any]:
    """A dict of plain values from a dict, an OmegaConf DictConfig (as SkyRL passes
    env_config) or a dataclass."""
    if value is None:
        return {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ValueError("SandboxTextEnv: %s must be a mapping (a dict or a DictConfig), got %s"
                         % (what, type(value).__name__))
    return {key: _unwrapped(item) for key, item in value.items()}


def _unwrapped(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _unwrapped(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_unwrapped(item) for item in value]
    return value


def _spec(config: Dict[str, Any], extras: Dict[str, Any]) -> SandboxSpec:
    try:
        spec = sandbox_spec(config.get("image"), config.get("spec"))
        if extras.get("image") is not None:
            spec = dataclasses.replace(spec, image=extras["image"])
    except ValueError as exc:
        raise ValueError("SandboxTextEnv: bad sandbox spec: %s" % exc) from None
    return spec


def _seconds(config: Dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError("SandboxTextEnv: env_config[%r] must be positive seconds, got %r"
                         % (key, value))
    return float(value)


def _count(source: Dict[str, Any], what: str, key: str, default: Optional[int]) -> int:
    value = source.get(key, default)
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # ints, and numpy's from a dataset
    except TypeError:
        number = 0
    if number < 1:
        raise ValueError("SandboxTextEnv: %s[%r] must be a positive integer, got %r"
                         % (what, key, value))
    return number


def _task_files(files: Any) -> Dict[str, Union[str, bytes]]:
    """``extras['files']`` as ``{relative path: contents}`` (see the module)."""
    if files is None:
        return {}
    if isinstance(files, Mapping):
        entries = list(files.items())
    elif isinstance(files, (str, bytes)):
        raise ValueError("SandboxTextEnv: extras['files'] must map paths to contents, got a "
                         "%s" % type(files).__name__)
    else:
        entries = []
        for record in files:
            if not isinstance(record, Mapping) or "path" not in record \
                    or "contents" not in record:
                raise ValueError("SandboxTextEnv: extras['files'] as a list holds "
                                 "{'path': ..., 'contents': ...} records, got %r" % (record,))
            entries.append((record["path"], record["contents"]))
    out: Dict[str, Union[str, bytes]] = {}
    for path, contents in entries:
        if contents is None:
            continue
        parts = PurePosixPath(path).parts if isinstance(path, str) else ()
        if not parts or path.startswith("/") or ".." in parts:
            raise ValueError("SandboxTextEnv: extras['files'] path %r must be relative to the "
                             "workdir, without '..'" % (path,))
        if not isinstance(contents, (str, bytes)):
            raise ValueError("SandboxTextEnv: extras['files'][%r] must be str or bytes, got %s"
                             % (path, type(contents).__name__))
        out[path] = contents
    return out


register_envs()
