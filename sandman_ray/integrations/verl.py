"""``SandboxTool``: a shell tool with verl's tool lifecycle, one sandbox per trajectory.

verl calls a tool as ``create`` -> ``execute`` (once or many times) -> ``calc_reward``
-> ``release``, all ``async``; its agent loop (``ToolAgentLoop``, verl 0.9) does
``create`` -> ``execute`` -> ``release`` once per tool *call*, and never calls
``calc_reward``. An agent's shell only makes sense if the calls of one rollout share
state, so this tool keys sandboxes by trajectory, and every instance of a trajectory
uses the same sandbox and the same shell session:

- an instance created with a trajectory id (``trajectory_id=`` or
  ``create_kwargs={"trajectory_id": ...}``) belongs to that trajectory at once;
- an instance created without one is bound at its first ``execute`` or
  ``calc_reward``: to verl's rollout (the ``request_id`` of the ``agent_data`` that
  verl's agent loop passes to ``execute``, one per sample), else to itself alone.

A trajectory's sandbox goes back to the pool ``linger_s`` after its last instance is
released (at once for an instance alone: nothing else can reach it), or at once on
``release_trajectory`` and ``close``. Under verl's agent loop, the n samples of a prompt
share their dataset row's ``create_kwargs`` (its ``files`` and ``setup``) and still get
a sandbox each, through their request ids. Their reward comes from verl's reward
function; ``calc_reward`` is for agent loops that call it.

When verl is installed (``pip install 'sandman-ray[integrations]'`` pins the tested
version), ``SandboxTool`` is a subclass of verl's ``BaseTool``: a tool config names it
(``class_name: sandman_ray.integrations.verl.SandboxTool``, ``config: {type: native,
...}``), verl's loader builds it, its schema is verl's ``OpenAIFunctionToolSchema`` and its
responses verl's ``ToolResponse``. Without verl the module still imports: the class
keeps the same constructor and methods, with the schema as a dict and a small stand-in
for ``ToolResponse`` (the same ``text`` field).

config (all optional):
    pool: the sandman pool to lease from (``default``): a pool's name, a service's URL
        (its key in $SANDMAN_API_KEY) or ``sandman_ray.connect(...)``'s pool.
    image: the sandbox image (``host``), or spec: a dict of SandboxSpec fields.
    workdir: where a trajectory's shell starts and files land (``/tmp/work``).
    exec_timeout_s: per command (30). acquire_timeout_s: per sandbox (120).
    reward_command: run by ``calc_reward``; reward 1.0 when it exits 0.
    linger_s: how long an idle trajectory keeps its sandbox (60).
    max_output_chars: output returned to the model per call (4000): a longer one keeps
        its head and its tail (``sandboxes.clip``).
"""

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from sandman_ray.errors import SandmanError
from sandman_ray.integrations.sandboxes import (
    Leases, check_workdir, clip, output_text, prepare_async, sandbox_spec)
from sandman_ray.integrations.steps import step_done_async, stepping

try:  # verl's own base class and types when verl is installed
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
except ImportError:  # pragma: no cover - depends on the environment
    BaseTool = object  # type: ignore[misc,assignment]
    OpenAIFunctionToolSchema = None  # type: ignore[misc,assignment]

    @dataclass
    class ToolResponse:  # type: ignore[no-redef]
        """What the model sees of a tool call (verl's ToolResponse has the same field)."""

        text: Optional[str] = None

__all__ = ["SandboxTool", "ToolResponse"]

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a bash command in this task's sandbox. The working directory, "
                       "variables and files persist between calls.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}


@dataclass
class _Trajectory:
    """One trajectory's sandbox and the tool instances that use it.

    opening: the task that leases and prepares the sandbox; it belongs to the
        trajectory, not to the create that started it, so cancelling that create does
        not cancel it for the others (or leak what it leased).
    """

    trajectory_id: str
    opening: "asyncio.Task"
    instances: set = field(default_factory=set)
    linger: Optional[asyncio.TimerHandle] = None
    alone: bool = False  # keyed by its one instance: no later call can join it


class SandboxTool(BaseTool):
    """A verl tool whose instances share a sandbox per trajectory (see module)."""

    def __init__(self, config: Optional[Dict[str, Any]] = None, tool_schema: Any = None):
        config = dict(config or {})
        known = {"pool", "image", "spec", "workdir", "exec_timeout_s", "acquire_timeout_s",
                 "reward_command", "linger_s", "max_output_chars", "type"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError("SandboxTool config has unknown keys %s (known: %s)"
                             % (unknown, sorted(known)))
        try:
            self.leases = Leases(config.get("pool", "default"))
        except ValueError as exc:
            raise ValueError("SandboxTool config['pool']: %s" % exc) from None
        self.pool = self.leases.name
        try:
            self.spec = sandbox_spec(config.get("image"), config.get("spec"))
        except ValueError as exc:
            raise ValueError("SandboxTool config: %s" % exc) from None
        self.workdir = check_workdir(config.get("workdir", "/tmp/work"),
                                     "SandboxTool config['workdir']")
        self.exec_timeout_s = float(config.get("exec_timeout_s", 30.0))
        self.acquire_timeout_s = float(config.get("acquire_timeout_s", 120.0))
        self.reward_command = config.get("reward_command")
        self.linger_s = float(config.get("linger_s", 60.0))
        self.max_output_chars = int(config.get("max_output_chars", 4000))
        if self.linger_s < 0 or self.exec_timeout_s <= 0 or self.max_output_chars < 1:
            raise ValueError("SandboxTool: linger_s must be >= 0, exec_timeout_s > 0 and "
                             "max_output_chars >= 1")
        schema = tool_schema if tool_schema is not None else DEFAULT_SCHEMA
        if OpenAIFunctionToolSchema is not None and isinstance(schema, dict):
            schema = OpenAIFunctionToolSchema.model_validate(schema)
        if BaseTool is not object:
            super().__init__(config, schema)  # verl's: config, tool_schema and name
        self.tool_schema = schema
        self.name = _schema_name(schema)
        self._trajectories: Dict[str, _Trajectory] = {}  # open trajectories by id
        self._instances: Dict[str, _Trajectory] = {}     # instance id -> its trajectory
        self._unbound: Dict[str, Dict[str, Any]] = {}    # created without a trajectory id
                                                          # and not called yet: create_kwargs
        self._giving_back: set = set()                   # release tasks in flight

    def get_openai_tool_schema(self):
        return self.tool_schema

    # ------------------------------------------------------------------ lifecycle
    async def create(self, instance_id: Optional[str] = None, trajectory_id: Optional[str] = None,
                     create_kwargs: Optional[Dict[str, Any]] = None,
                     **kwargs) -> Tuple[str, ToolResponse]:
        """A tool instance. ``create_kwargs`` may carry ``trajectory_id``, ``files``
        (``{relative path: contents}`` put under ``workdir``) and ``setup`` (a command
        run once, when the trajectory's sandbox is leased).

        With a trajectory id, the instance joins that trajectory's sandbox now (leased
        on the trajectory's first create). The id must name one rollout: the
        ``create_kwargs`` of a dataset row are the same for all n samples of a prompt,
        so never put the row's index alone there. Without one, the instance is bound at
        its first call (see the module): a setup that fails then raises from that call."""
        create_kwargs = dict(create_kwargs or {})
        instance_id = instance_id or uuid.uuid4().hex
        if instance_id in self._instances or instance_id in self._unbound:
            raise SandmanError("tool instance %s already exists" % instance_id)
        key = trajectory_id or create_kwargs.get("trajectory_id")
        if key is None:
            self._unbound[instance_id] = create_kwargs
            return instance_id, ToolResponse(text="shell tool instance %s" % instance_id)
        await self._join(instance_id, str(key), create_kwargs)
        return instance_id, ToolResponse(text="sandbox ready for trajectory %s" % key)

    async def _join(self, instance_id: str, key: str, create_kwargs: Dict[str, Any],
                    alone: bool = False) -> _Trajectory:
        """Put ``instance_id`` on trajectory ``key`` (opened if it has no sandbox yet)
        and wait for its sandbox."""
        traj = self._trajectories.get(key)
        if traj is None:
            opening = asyncio.get_running_loop().create_task(self._open(create_kwargs))
            traj = self._trajectories[key] = _Trajectory(key, opening, alone=alone)
        elif traj.linger is not None:
            traj.linger.cancel()
            traj.linger = None
        traj.instances.add(instance_id)
        self._instances[instance_id] = traj
        try:
            await asyncio.shield(traj.opening)
        except BaseException:
            self._forget(instance_id)
            if traj.opening.done() and not traj.opening.cancelled() \
                    and traj.opening.exception() is not None:
                self._drop(traj)  # nothing was leased; the next create tries again
            else:
                self._idle(traj)  # this create was cancelled: the sandbox may be unused now
            raise
        return traj

    async def _open(self, create_kwargs: Dict[str, Any]):
        sandbox = await self.leases.acquire_async(self.spec, self.acquire_timeout_s)
        try:
            await prepare_async(sandbox, self.workdir, create_kwargs.get("files"),
                                create_kwargs.get("setup"), self.exec_timeout_s)
            await step_done_async(sandbox)  # the model writes the first call now
        except BaseException:
            await self.leases.release_async(sandbox)
            raise
        return sandbox

    async def execute(self, instance_id: str, parameters: Dict[str, Any],
                      **kwargs) -> Tuple[ToolResponse, float, Dict[str, Any]]:
        """Run ``parameters["command"]`` in the trajectory's shell session. A malformed
        call is answered with an error text for the model (it is the model's mistake),
        not raised."""
        sandbox = await self._sandbox(instance_id, kwargs.get("agent_data"))
        command = parameters.get("command") if isinstance(parameters, dict) else None
        if not isinstance(command, str) or not command.strip():
            return (ToolResponse(text="error: the shell tool needs a non-empty string "
                                      "parameter 'command', got %r" % (parameters,)),
                    0.0, {"error": "bad parameters"})
        started = time.perf_counter()
        async with stepping(sandbox):
            result = await sandbox.run_async(command, timeout=self.exec_timeout_s)
        text = clip(output_text(result), self.max_output_chars)
        if result.timed_out:
            text += "\n[timed out after %g s]" % self.exec_timeout_s
        text += "\n[exit code %s]" % result.exit_code
        return ToolResponse(text=text), 0.0, {
            "exit_code": result.exit_code, "timed_out": result.timed_out,
            "latency_s": time.perf_counter() - started}

    async def calc_reward(self, instance_id: str, reward_command: Optional[str] = None,
                          **kwargs) -> float:
        """1.0 when the reward command (argument, else config) exits 0 in the sandbox."""
        command = reward_command or self.reward_command
        if not command:
            raise SandmanError("SandboxTool.calc_reward needs a reward_command "
                               "(in the tool config or as an argument)")
        sandbox = await self._sandbox(instance_id, kwargs.get("agent_data"))
        async with stepping(sandbox):
            result = await sandbox.exec_async(command, cwd=self.workdir,
                                              timeout=self.exec_timeout_s)
        return 1.0 if result.ok else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """End a tool instance; its trajectory's sandbox stays ``linger_s`` for the
        trajectory's next call, then goes back to the pool."""
        self._unbound.pop(instance_id, None)  # never called: it holds nothing
        traj = self._forget(instance_id)
        if traj is not None:
            self._idle(traj)
            if not self._lingers(traj):
                await self._wait_given_back()

    async def release_trajectory(self, trajectory_id: str) -> bool:
        """Give the trajectory's sandbox back now (its instances end too). False when the
        trajectory has no sandbox."""
        traj = self._trajectories.get(str(trajectory_id))
        if traj is None:
            return False
        return await asyncio.shield(self._give_back(traj))

    async def close(self) -> None:
        """Release every trajectory's sandbox, and wait for releases under way."""
        self._unbound.clear()
        for traj in list(self._trajectories.values()):
            self._give_back(traj)
        await self._wait_given_back()

    def open_trajectories(self) -> int:
        return len(self._trajectories)

    # ------------------------------------------------------------------ helpers
    def _forget(self, instance_id: str) -> Optional[_Trajectory]:
        traj = self._instances.pop(instance_id, None)
        if traj is not None:
            traj.instances.discard(instance_id)
        return traj

    def _drop(self, traj: _Trajectory) -> None:
        """Forget ``traj`` (only if it is still the open trajectory of its id)."""
        if self._trajectories.get(traj.trajectory_id) is traj:
            del self._trajectories[traj.trajectory_id]
        if traj.linger is not None:
            traj.linger.cancel()
            traj.linger = None
        for instance_id in list(traj.instances):
            self._instances.pop(instance_id, None)
        traj.instances.clear()

    def _idle(self, traj: _Trajectory) -> None:
        """``traj`` may have no instance left: give its sandbox back after ``linger_s``."""
        if traj.instances or self._trajectories.get(traj.trajectory_id) is not traj \
                or traj.linger is not None:
            return
        if not self._lingers(traj):
            self._give_back(traj)
        else:
            traj.linger = asyncio.get_running_loop().call_later(
                self.linger_s, self._linger_over, traj)

    def _lingers(self, traj: _Trajectory) -> bool:
        """Whether ``traj``'s sandbox waits ``linger_s`` for a next call once it has no
        instance (not when nothing else can reach it)."""
        return self.linger_s > 0 and not traj.alone

    def _linger_over(self, traj: _Trajectory) -> None:
        traj.linger = None
        if not traj.instances:
            self._give_back(traj)

    def _give_back(self, traj: _Trajectory) -> "asyncio.Task":
        """Start returning ``traj``'s sandbox to the pool (a tracked task that a
        cancelled caller does not stop)."""
        self._drop(traj)

        async def give_back() -> bool:
            try:
                sandbox = await traj.opening
            except BaseException:
                return False  # its create failed: nothing was leased
            await self.leases.release_async(sandbox)
            return True
        task = asyncio.get_running_loop().create_task(give_back())
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)
        return task

    async def _wait_given_back(self) -> None:
        while self._giving_back:
            await asyncio.gather(*list(self._giving_back), return_exceptions=True)

    async def _sandbox(self, instance_id: str, agent_data: Any = None):
        """The instance's sandbox; an instance created without a trajectory id is bound
        here, to ``agent_data``'s rollout (verl's agent loop) or to itself alone."""
        create_kwargs = self._unbound.pop(instance_id, None)
        if create_kwargs is not None:
            rollout = getattr(agent_data, "request_id", None)
            key = "request:%s" % rollout if rollout else "instance:%s" % instance_id
            traj = await self._join(instance_id, key, create_kwargs, alone=not rollout)
            return traj.opening.result()
        traj = self._instances.get(instance_id)
        if traj is None:
            raise SandmanError("no tool instance %s (never created, or released)" % instance_id)
        return await asyncio.shield(traj.opening)


def _schema_name(schema: Any) -> str:
    if isinstance(schema, dict):
        return schema.get("function", {}).get("name", "shell")
    function = getattr(schema, "function", None)
    return getattr(function, "name", "shell")
