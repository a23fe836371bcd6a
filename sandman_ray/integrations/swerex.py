"""SWE-ReX on sandman: ``SandmanDeployment`` and ``SandmanRuntime``.

SWE-ReX is the runtime that SWE-agent, mini-swe-agent's ``swerex_*`` environments and
several RL stacks drive: a deployment (``start``, ``stop``, ``runtime``) gives a runtime
(``execute``, bash sessions, files). A user who runs SWE-ReX's docker, modal or fargate
deployments switches to a leased sandman sandbox by naming this one::

    from swerex.deployment import get_deployment
    from sandman_ray.integrations.swerex import SandmanDeploymentConfig

    deployment = get_deployment(SandmanDeploymentConfig(image="builtin:debian"))
    # or SandmanDeploymentConfig.model_validate({"type": "sandman", "pool": "default", ...})
    await deployment.start()
    await deployment.runtime.run_in_session(BashAction(command="ls"))

``start`` leases the sandbox (on the process's Ray, started if needed) and ``stop``
gives it back. The runtime answers as SWE-ReX's own ``LocalRuntime`` does in a container:

- ``execute`` runs a command as ``subprocess.run`` would (a string with ``shell=True``
  through ``/bin/sh -c``, a list as argv), once, with the daemon's timeout (the command's
  process group is killed); ``env`` is set over the sandbox's variables.
- A bash session is an interactive ``bash`` on one of the sandbox's terminals, as
  SWE-ReX's ``pexpect`` session is (``swerex_shell.BashSession``): output is what the
  terminal shows, an interactive program (``python``, ``gdb``) is driven by
  ``is_interactive_command`` and ``expect``, and ``BashInterruptAction`` types Ctrl-C
  (then Ctrl-Z and a SIGKILL of the stopped job); a command is checked with ``bash -n``
  first.
- Files are read and written in the sandbox; ``upload`` copies a file or directory of
  this machine into it.

Errors are SWE-ReX's own types (``CommandTimeoutError``, ``NonZeroExitCodeError``,
``SessionDoesNotExistError`` ...); a file that is missing raises ``FileNotFoundError``.
"""

import asyncio
import builtins
import errno as errnos
import io
import logging
import os
import stat
import tarfile
from pathlib import Path
from typing import Any, Dict, List, Literal, Mapping, Optional

from sandman_ray.integrations import require_python

require_python("swerex", "SWE-ReX 1.4", (3, 10))

from sandman_ray.errors import DaemonError  # noqa: E402
from sandman_ray.integrations.sandboxes import (  # noqa: E402
    MERGE_STDERR, Leases, check_pool, sandbox_spec)

try:
    from pydantic import BaseModel, ConfigDict, TypeAdapter, field_validator
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import (
        CommandTimeoutError, DeploymentNotStartedError, NonZeroExitCodeError,
        SessionDoesNotExistError, SessionExistsError)
    from swerex.runtime.abstract import (
        AbstractRuntime, BashObservation, CloseBashSessionResponse, CloseResponse, Command,
        CommandResponse, CreateBashSessionRequest, CreateBashSessionResponse, IsAliveResponse,
        ReadFileRequest, ReadFileResponse, UploadRequest, UploadResponse, WriteFileRequest,
        WriteFileResponse)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sandman_ray.integrations.swerex needs SWE-ReX (pip install "
                      "swe-rex==1.4.0); importing it failed: %s" % exc) from exc

from sandman_ray.integrations.swerex_shell import BashSession, as_text  # noqa: E402

__all__ = ["SandmanDeployment", "SandmanDeploymentConfig", "SandmanRuntime",
           "deployment_config"]

logger = logging.getLogger(__name__)



class SandmanDeploymentConfig(BaseModel):
    """What ``SandmanDeployment`` takes; ``get_deployment`` (SWE-ReX's) builds it from
    this, and this from a dict (``model_validate``). Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["sandman"] = "sandman"
    """Discriminator for (de)serialization, as SWE-ReX's configs have it."""
    image: Optional[str] = None
    """The sandbox image (``builtin:debian`` when neither this nor ``spec`` is set)."""
    spec: Optional[Dict[str, Any]] = None
    """The sandbox as a dict of ``SandboxSpec`` fields (image, cpu, memory, env, workdir,
    network ...), instead of ``image``."""
    pool: str = "default"
    """The sandman pool to lease from (``default`` is created if missing), or a sandman
    service's URL (``https://HOST:PORT``; its API key in $SANDMAN_API_KEY)."""
    acquire_timeout_s: float = 120.0
    """How long ``start`` waits for a sandbox."""

    @field_validator("pool")
    @classmethod
    def _pool_name(cls, value):
        return check_pool(value)

    @field_validator("acquire_timeout_s")
    @classmethod
    def _positive(cls, value):
        if value <= 0:
            raise ValueError("acquire_timeout_s must be positive seconds, got %r" % value)
        return value

    def model_post_init(self, _context) -> None:
        sandbox_spec(self.image, self.spec)  # a bad image or spec fails here, by name

    def get_deployment(self) -> "SandmanDeployment":
        return SandmanDeployment.from_config(self)


def deployment_config(config: Mapping[str, Any]) -> BaseModel:
    """A SWE-ReX deployment config from its dict, as configs serialize: ``type`` sandman
    is a SandmanDeploymentConfig, any other one of SWE-ReX's own (``docker``,
    ``modal`` ...). ``.get_deployment()`` of it builds the deployment."""
    if not isinstance(config, Mapping):
        raise ValueError("a deployment config is a mapping with a 'type', got %r"
                         % type(config).__name__)
    if config.get("type") == "sandman":
        return SandmanDeploymentConfig.model_validate(dict(config))
    from swerex.deployment.config import DeploymentConfig
    return TypeAdapter(DeploymentConfig).validate_python(dict(config))


class SandmanDeployment(AbstractDeployment):
    """A SWE-ReX deployment on one leased sandman sandbox (see the module)."""

    def __init__(self, *, logger: Optional[logging.Logger] = None, **kwargs: Any):
        self._config = SandmanDeploymentConfig(**kwargs)
        self._runtime: Optional[SandmanRuntime] = None
        self._sandbox = None
        self._hooks = CombinedDeploymentHook()
        self.logger = logger or logging.getLogger("rex-deploy")

    @classmethod
    def from_config(cls, config: SandmanDeploymentConfig) -> "SandmanDeployment":
        return cls(**config.model_dump())

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self):
        """The SandboxHandle while started (None before and after)."""
        return self._sandbox

    async def is_alive(self, *, timeout: Optional[float] = None) -> IsAliveResponse:
        """Whether the sandbox's daemon answers. DeploymentNotStartedError before
        ``start``."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Lease the sandbox (once; a started deployment stays as it is)."""
        if self._runtime is not None:
            return
        config = self._config
        self._hooks.on_custom_step("Leasing a sandbox from sandman pool %s" % config.pool)
        self._leases = Leases(config.pool)
        self._sandbox = await self._leases.acquire_async(
            sandbox_spec(config.image, config.spec), config.acquire_timeout_s)
        self._runtime = SandmanRuntime(self._sandbox, logger=self.logger)
        self.logger.info("leased sandbox %s from pool %s", self._sandbox.sandbox, config.pool)

    async def stop(self) -> None:
        """Close the runtime's sessions and give the sandbox back (once)."""
        runtime, self._runtime = self._runtime, None
        sandbox, self._sandbox = self._sandbox, None
        try:
            if runtime is not None:
                await runtime.close()
        finally:
            if sandbox is not None:
                await self._leases.release_async(sandbox)

    @property
    def runtime(self) -> "SandmanRuntime":
        """The runtime while started; DeploymentNotStartedError otherwise."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime


class SandmanRuntime(AbstractRuntime):
    """A SWE-ReX runtime on a leased sandbox (a SandboxHandle): its calls are the
    handle's direct calls, or go through its host where this process cannot reach
    the sandbox."""

    def __init__(self, sandbox, *, logger: Optional[logging.Logger] = None):
        self.sandbox = sandbox
        self.sessions: Dict[str, BashSession] = {}
        self.logger = logger or logging.getLogger("rex-runtime")

    async def is_alive(self, *, timeout: Optional[float] = None) -> IsAliveResponse:
        try:
            await asyncio.wait_for(self.sandbox.ping_async(), timeout)
        except Exception as exc:  # noqa: BLE001 - the answer is the reason
            return IsAliveResponse(is_alive=False, message="%s: %s" % (type(exc).__name__, exc))
        return IsAliveResponse(is_alive=True)

    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        if request.session in self.sessions:
            raise SessionExistsError("session %s already exists" % request.session)
        session = BashSession(self.sandbox, request)
        self.sessions[request.session] = session
        try:
            return await session.start()
        except BaseException:
            del self.sessions[request.session]
            await session.close()
            raise

    async def run_in_session(self, action) -> BashObservation:
        session = self.sessions.get(action.session)
        if session is None:
            raise SessionDoesNotExistError("session %r does not exist" % action.session)
        return await session.run(action)

    async def close_session(self, request) -> CloseBashSessionResponse:
        session = self.sessions.pop(request.session, None)
        if session is None:
            raise SessionDoesNotExistError("session %r does not exist" % request.session)
        await session.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """Run ``command`` once, as ``subprocess.run`` would in the sandbox."""
        argv = _argv(command.command, command.shell)
        if command.merge_output_streams:
            argv = MERGE_STDERR + argv
        try:
            result = await self.sandbox.exec_async(argv, timeout=command.timeout,
                                                   cwd=command.cwd, env=command.env)
        except DaemonError as exc:  # it could not start (a missing program or cwd)
            raise _os_error(exc, argv[0]) from exc
        if result.timed_out:
            raise CommandTimeoutError("Timeout (%ss) exceeded while running command"
                                      % command.timeout)
        exit_code = -result.signal if result.signal else result.exit_code
        response = CommandResponse(stdout=as_text(result.stdout),
                                   stderr=as_text(result.stderr), exit_code=exit_code)
        if command.check and exit_code != 0:
            message = ("Command %r failed with exit code %s. Stdout:\n%r\nStderr:\n%r"
                       % (command.command, exit_code, response.stdout, response.stderr))
            raise NonZeroExitCodeError("%s: %s" % (command.error_msg, message)
                                       if command.error_msg else message)
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        try:
            data = await self.sandbox.read_file_async(request.path)
        except DaemonError as exc:
            raise _os_error(exc, request.path) from exc
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8",
                                                    request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Write the text, its directories made as needed."""
        try:
            await self.sandbox.write_file_async(request.path, request.content.encode(),
                                                parents=True)
        except DaemonError as exc:
            raise _os_error(exc, request.path) from exc
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copy a file or a directory of this machine to ``target_path`` in the sandbox
        (modes kept; the directories above it made as needed)."""
        source = Path(request.source_path)
        try:
            if source.is_dir():
                await self.sandbox.put_archive_async(request.target_path, _tar_of_dir(source))
            else:
                await self.sandbox.write_file_async(
                    request.target_path, source.read_bytes(), parents=True,
                    mode=stat.S_IMODE(source.stat().st_mode))
        except DaemonError as exc:
            raise _os_error(exc, request.target_path) from exc
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """Close every session (their terminals and what runs on them)."""
        sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            await session.close()
        return CloseResponse()


# ---------------------------------------------------------------------- helpers
def _argv(command, shell: bool) -> List[str]:
    """The argv ``subprocess.run(command, shell=shell)`` runs."""
    if isinstance(command, str):
        return ["/bin/sh", "-c", command] if shell else [command]
    command = [str(part) for part in command]
    if shell:  # the first item is the script, the rest its $0, $1 ...
        return ["/bin/sh", "-c", *command]
    if not command:
        raise ValueError("an empty command")
    return command












def _os_error(exc: DaemonError, path: str) -> Exception:
    """The OSError a local runtime would raise (FileNotFoundError ...), where the daemon
    names an errno; else the DaemonError."""
    number = getattr(errnos, exc.errno, None) if isinstance(exc.errno, str) else None
    if isinstance(number, int):
        return OSError(number, os.strerror(number), path)
    kind = getattr(builtins, exc.type, None)  # the daemon's own kind: FileNotFoundError ...
    if isinstance(kind, type) and issubclass(kind, OSError):
        return kind(exc.message)
    return exc


def _tar_of_dir(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(directory.rglob("*")):
            tar.add(str(entry), arcname=str(entry.relative_to(directory)), recursive=False)
    return buffer.getvalue()
