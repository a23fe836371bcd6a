"""``SandmanEnvironment``: a mini-swe-agent environment whose commands run in a sandbox.

mini-swe-agent loads it by its import path, from a config file::

    environment:
      environment_class: sandman_ray.integrations.minisweagent.SandmanEnvironment
      pool: default                # the sandman pool to lease from (or a service's
                                   # URL, its key in $SANDMAN_API_KEY)
      image: builtin:debian        # or spec: {image: ..., memory: 2Gi, workdir: /testbed}
      cwd: /testbed
      timeout: 60

or from the command line: ``mini --environment-class
sandman_ray.integrations.minisweagent.SandmanEnvironment -c mini.yaml -c
environment.image=docker.io/library/python:3.12``.

An action runs as it would in mini-swe-agent's ``LocalEnvironment``, but in the sandbox:
one ``/bin/sh -c`` per action (``interpreter``), stderr merged into the output, in
``cwd``, with ``env`` over the sandbox's own variables, killed after ``timeout``
seconds; the answer has the same keys and values, a timeout included (a command that
cannot start, in a missing ``cwd`` say, is told with the daemon's words). An action whose
output starts with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` ends the run with its
submission, through mini-swe-agent's own check. The template variables (``system``,
``release``, ``machine`` ..., and the environment's variables) describe the sandbox,
not this machine.

The sandbox is leased when the environment is made (as mini-swe-agent's
``DockerEnvironment`` starts its container) and goes back to the pool on ``close()``
(``cleanup()``, mini-swe-agent's name for it, or the end of a ``with`` block).
mini-swe-agent's own run scripts call neither: an environment dropped without
``close`` gives its lease back when its handle is collected, and the pool reclaims the
sandboxes of a process that dies.

The environment uses the process's Ray, or starts it with ``ray.init()`` (which joins
the cluster ``RAY_ADDRESS`` names, if set). The ``default`` pool is created on first
use if it does not exist; any other pool must exist.
"""

import logging
import subprocess
from typing import Any, Dict, List, Optional

from sandman_ray.integrations import require_python

require_python("minisweagent", "mini-swe-agent 2.4", (3, 10))

from sandman_ray.errors import DaemonError, SandmanError  # noqa: E402
from sandman_ray.handle import SandboxHandle  # noqa: E402
from sandman_ray.integrations.sandboxes import (  # noqa: E402
    MERGE_STDERR, Leases, check_pool, sandbox_spec)
from sandman_ray.integrations.steps import step_done  # noqa: E402
from sandman_ray.spec import SandboxSpec  # noqa: E402

try:
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.utils.serialize import recursive_merge
    from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator, model_validator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "sandman_ray.integrations.minisweagent needs mini-swe-agent (pip install "
        "mini-swe-agent==2.4.6); importing it failed: %s" % exc) from exc

__all__ = ["SandmanEnvironment", "SandmanEnvironmentConfig"]

logger = logging.getLogger(__name__)

# The sandbox facts that LocalEnvironment's template variables take from
# platform.uname(), each read with ``uname -<flag>`` in the sandbox (``unknown``, as
# platform gives it, is blank).
UNAME_FIELDS = (("system", "s"), ("node", "n"), ("release", "r"), ("version", "v"),
                ("machine", "m"), ("processor", "p"))
# Prints the uname fields one per line (an empty line for one uname cannot tell), then
# the variables a command starts with, NUL-separated.
SYSTEM_PROBE = "printf '%%s\\n' %s; cat /proc/self/environ" % " ".join(
    '"$(uname -%s)"' % flag for _, flag in UNAME_FIELDS)
# Output kept per action: the daemon's most per stream (LocalEnvironment keeps all of it;
# past this the end is dropped, and the answer says so).
OUTPUT_KEPT_BYTES = 16 * 1024 * 1024


class SandmanEnvironmentConfig(BaseModel):
    """What ``SandmanEnvironment`` takes (mini-swe-agent's ``environment`` section,
    without ``environment_class``). Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    cwd: str = ""
    """Where commands run unless an execute names a ``cwd``; empty: the sandbox's
    working directory (the spec's ``workdir``, else the image's, else ``/``)."""
    env: Dict[str, str] = {}
    """Variables set for every command, over the sandbox's own."""
    timeout: int = 30
    """Seconds a command may run unless an execute gives a ``timeout``; then it is
    killed with the processes it started."""
    interpreter: List[str] = ["/bin/sh", "-c"]
    """The argv that runs an action, the action appended (``["bash", "-c"]``, say)."""
    pool: str = "default"
    """The sandman pool to lease from (``default`` is created if missing), or a sandman
    service's URL (``https://HOST:PORT``; its API key in $SANDMAN_API_KEY)."""
    image: Optional[str] = None
    """The sandbox image (``builtin:debian`` when neither this nor ``spec`` is set)."""
    spec: Optional[Dict[str, Any]] = None
    """The sandbox as a dict of ``SandboxSpec`` fields (image, cpu, memory, disk, env,
    workdir, network ...), instead of ``image``."""
    acquire_timeout_s: float = 120.0
    """How long making the environment waits for a sandbox."""

    _sandbox_spec: SandboxSpec = PrivateAttr()

    @field_validator("timeout", "acquire_timeout_s")
    @classmethod
    def _positive(cls, value, info):
        if value <= 0:
            raise ValueError("%s must be positive seconds, got %r" % (info.field_name, value))
        return value

    @field_validator("interpreter")
    @classmethod
    def _argv(cls, value):
        if not value or not all(value):
            raise ValueError("interpreter must be a non-empty argv such as "
                             "['/bin/sh', '-c'], got %r" % (value,))
        return value

    @field_validator("env")
    @classmethod
    def _names(cls, value):
        for name in value:
            if not name or "=" in name or "\0" in name:
                raise ValueError("env has an invalid variable name %r" % (name,))
        return value

    @field_validator("pool")
    @classmethod
    def _pool_name(cls, value):
        return check_pool(value)

    @model_validator(mode="after")
    def _one_sandbox_spec(self):
        self._sandbox_spec = sandbox_spec(self.image, self.spec)
        return self

    @property
    def sandbox_spec(self) -> SandboxSpec:
        """The sandbox ``image`` or ``spec`` describes."""
        return self._sandbox_spec


class SandmanEnvironment:
    """A mini-swe-agent environment on one leased sandman sandbox (see the module).

    ``self.sandbox`` is the SandboxHandle while the environment is open (None after
    ``close``); use it for what actions do not do, such as putting a repository in
    place before the agent runs.
    """

    def __init__(self, *, config_class: type = SandmanEnvironmentConfig, **kwargs):
        self.config = config_class(**kwargs)
        self._leases = Leases(self.config.pool)
        self.sandbox: Optional[SandboxHandle] = self._leases.acquire(
            self.config.sandbox_spec, self.config.acquire_timeout_s)
        self.sandbox_id = self.sandbox.sandbox
        self._system_vars: Optional[Dict[str, str]] = None
        logger.info("leased sandbox %s from pool %s", self.sandbox_id, self.config.pool)

    # ------------------------------------------------------------------ mini-swe-agent
    def execute(self, action: dict, cwd: str = "", *,
                timeout: Optional[int] = None) -> Dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; answer as LocalEnvironment does:
        ``output`` (stdout and stderr as written), ``returncode`` and
        ``exception_info``, or for a timeout or a command that could not start,
        returncode -1 with the error and an ``extra`` that names it. Raises Submitted
        for the submission marker; raises the SandmanError of a sandbox that is gone
        (the model cannot fix that)."""
        command = action.get("command", "")
        timeout = timeout or self.config.timeout
        try:
            result = self._sandbox().exec(
                [*MERGE_STDERR, *self.config.interpreter, command],
                cwd=cwd or self.config.cwd or None, env=self.config.env or None,
                timeout=timeout, kill_grace_s=0, max_output=OUTPUT_KEPT_BYTES)
        except DaemonError as exc:  # the command could not start: a missing cwd, say
            output = _failed(str(exc), exc.type, "")
        else:
            text = _decoded(result.stdout)
            if result.truncated:
                text += ("\n[output past %d MiB was dropped in the sandbox]"
                         % (OUTPUT_KEPT_BYTES >> 20))
            if result.timed_out:
                expired = subprocess.TimeoutExpired(command, timeout)  # its message
                output = _failed(str(expired), type(expired).__name__, text)
            else:
                # a command killed by signal N: -N, as subprocess reports it
                returncode = -result.signal if result.signal else result.exit_code
                output = {"output": text, "returncode": returncode, "exception_info": ""}
        # mini-swe-agent's own check, so that the marker and the Submitted message are
        # those of the installed version
        LocalEnvironment._check_finished(self, output)
        step_done(self.sandbox)
        return output

    def get_template_vars(self, **kwargs) -> Dict[str, Any]:
        """The config's fields, the sandbox's ``uname`` fields (system, node, release,
        version, machine, processor) and variables, then ``kwargs``: LocalEnvironment's
        variables, read in the sandbox (once per environment)."""
        if self._system_vars is None:
            self._system_vars = self._read_system_vars()
        return recursive_merge(self.config.model_dump(), self._system_vars, kwargs)

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": "%s.%s" % (type(self).__module__, type(self).__name__),
                },
                "sandbox": {"pool": self.config.pool, "sandbox_id": self.sandbox_id},
            }
        }

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Give the sandbox back to the pool (once; later calls do nothing)."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            self._leases.release(sandbox)
            logger.info("released sandbox %s to pool %s", self.sandbox_id, self.config.pool)

    cleanup = close  # the name mini-swe-agent's container environments use

    def __enter__(self) -> "SandmanEnvironment":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _sandbox(self) -> SandboxHandle:
        if self.sandbox is None:
            raise SandmanError("SandmanEnvironment of sandbox %s is closed: its sandbox went "
                               "back to pool %s" % (self.sandbox_id, self.config.pool))
        return self.sandbox

    def _read_system_vars(self) -> Dict[str, str]:
        result = self._sandbox().exec(["/bin/sh", "-c", SYSTEM_PROBE],
                                      timeout=self.config.timeout)
        if not result.ok:
            raise SandmanError("reading uname and the environment in sandbox %s failed "
                               "(exit %s, timed out: %s): %s"
                               % (self.sandbox_id, result.exit_code, result.timed_out,
                                  _decoded(result.stderr)[-500:]))
        *uname, environ = result.stdout.split(b"\n", len(UNAME_FIELDS))
        found = {name: "" if value == b"unknown" else _decoded(value)
                 for (name, _), value in zip(UNAME_FIELDS, uname)}
        for entry in environ.split(b"\0"):
            name, equals, value = _decoded(entry).partition("=")
            if equals:
                found[name] = value
        return found


def _decoded(data: bytes) -> str:
    """Output as LocalEnvironment's text-mode pipe gives it: UTF-8 with undecodable bytes
    replaced, and universal newlines (``\\r\\n`` and ``\\r`` become ``\\n``)."""
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def _failed(error: str, error_type: str, output: str) -> Dict[str, Any]:
    """The answer for a command that timed out or did not start, in LocalEnvironment's
    form."""
    return {
        "output": output,
        "returncode": -1,
        "exception_info": "An error occurred while executing the command: %s" % error,
        "extra": {"exception_type": error_type, "exception": error},
    }
