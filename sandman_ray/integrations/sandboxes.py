"""What the integrations share about their sandboxes: which sandbox a config describes
(``image`` or ``spec``), where they lease it (``Leases``: a pool of this Ray cluster,
or of a sandman service), a task's working directory made ready in it (its files, a
shell there, its setup), and the one rule for how much of a command's output a model
is shown.

verl's tool, SkyRL's env, mini-swe-agent's environment and SWE-ReX's deployment each
take these from here, so that one config means the same sandbox everywhere and a task
is prepared the same way whichever framework runs it.
"""

import os
from typing import Any, Mapping, Optional, Union

import ray

import sandman_ray as sandman
from sandman_ray.client import tar_of
from sandman_ray.errors import SandmanError
from sandman_ray.results import ExecResult
from sandman_ray.spec import SandboxSpec, check_pool_name

# Runs the argv after it with stderr on stdout, one stream in the order written (what a
# terminal or a merged pipe shows); ``exec`` keeps the command the process the daemon
# waits for and kills.
MERGE_STDERR = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]
# The shell session a task's commands run in, opened in its working directory: the
# daemon's default one, which ``run`` uses when no session is named.
SESSION = "default"


def sandbox_spec(image: Optional[str], spec: Optional[Mapping[str, Any]]) -> SandboxSpec:
    """The sandbox a config describes: ``image`` alone, or ``spec`` (a dict of
    SandboxSpec fields); both given, or a bad value, is a ValueError that names it."""
    return SandboxSpec.from_config(image, spec)


API_KEY_VARIABLE = "SANDMAN_API_KEY"  # a service's key, where a config names its URL


def check_pool(pool: Any) -> Any:
    """A config's ``pool``: a pool's name (of this Ray cluster), a service's URL
    (``http(s)://HOST:PORT``; its key in $SANDMAN_API_KEY), or a pool of a service
    (``sandman_ray.connect(...)``); a ValueError that names what is wrong."""
    if isinstance(pool, str) and pool.startswith(("http://", "https://")):
        from sandman_ray.remote.channel import service_url
        service_url(pool)
        return pool
    if callable(getattr(pool, "acquire_async", None)) and callable(getattr(pool, "release", None)):
        return pool
    try:
        return check_pool_name(pool)
    except ValueError as exc:
        raise ValueError("%s (or give a service's URL, http(s)://HOST:PORT, or "
                         "sandman_ray.connect(...)'s pool)" % exc) from None


class Leases:
    """Where an integration leases its sandboxes: ``pool`` (see ``check_pool``). The
    handles either gives have the same methods (``exec``, ``run_async``...); through
    Ray they resume on a call (``auto_resume``), as steps.py expects."""

    def __init__(self, pool: Any):
        pool = check_pool(pool)
        self.remote = None
        if isinstance(pool, str) and pool.startswith(("http://", "https://")):
            from sandman_ray.remote import connect
            key = os.environ.get(API_KEY_VARIABLE)
            if not key:
                raise ValueError("pool %s is a service: its API key goes in $%s"
                                 % (pool, API_KEY_VARIABLE))
            self.remote, self.name = connect(pool, key), pool
        elif isinstance(pool, str):
            self.name = pool
        else:
            self.remote, self.name = pool, pool.url

    def acquire(self, spec: SandboxSpec, timeout: float):
        if self.remote is not None:
            return self.remote.acquire(spec, timeout=timeout)
        ensure_ray()
        return sandman.acquire(spec, pool=self.name, timeout=timeout, auto_resume=True)

    async def acquire_async(self, spec: SandboxSpec, timeout: float):
        if self.remote is not None:
            return await self.remote.acquire_async(spec, timeout=timeout)
        ensure_ray()
        return await sandman.acquire_async(spec, pool=self.name, timeout=timeout,
                                           auto_resume=True)

    def release(self, sandbox) -> None:
        if self.remote is not None:
            sandbox.release()
        else:
            sandman.release(sandbox)

    async def release_async(self, sandbox) -> None:
        if self.remote is not None:
            await sandbox.release_async()
        else:
            await sandman.release_async(sandbox)


def ensure_ray() -> None:
    """The process's Ray, or ``ray.init()`` (which joins the cluster ``RAY_ADDRESS``
    names, if set): an integration is made by a framework that may not have started
    Ray."""
    if not ray.is_initialized():
        ray.init()


def output_text(result: ExecResult) -> str:
    """What a command wrote, stdout then stderr, as text (undecodable bytes replaced)."""
    return (result.stdout + result.stderr).decode("utf-8", "replace")


def clip(text: str, max_chars: int) -> str:
    """``text`` in at most ``max_chars`` characters, plus a note of what was cut: its
    head and its tail, where a command says what it does and how it ended (errors,
    test summaries)."""
    cut = len(text) - max_chars
    if cut <= 0:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return "%s\n[... %d characters cut ...]\n%s" % (text[:head], cut, text[len(text) - tail:])


def _preparing(sandbox_id: str, workdir: str,
               files: Optional[Mapping[str, Union[str, bytes]]], setup: Optional[str],
               timeout_s: float, session: str):
    """The steps that make a task's working directory ready, as (op, args, kwargs) for
    the sandbox; each is sent the step's result. The directory is made, ``files``
    (relative path -> contents) put in it, a shell session opened there, and ``setup``
    run in that session (what it exports stays for the task's commands)."""
    yield "mkdir", (workdir,), {}
    if files:
        yield "put_archive", (workdir, tar_of(dict(files))), {}
    yield "session_open", (session,), {"cwd": workdir}
    if setup:
        result = yield "run", (setup,), {"session": session, "timeout": timeout_s}
        if not result.ok:
            ended = ("timed out after %g s" % timeout_s if result.timed_out else
                     "ended its shell" if result.exit_code is None else
                     "exited %d" % result.exit_code)
            raise SandmanError("the setup command %s in sandbox %s: %s"
                               % (ended, sandbox_id, _tail(result, 500)))


def _tail(result: ExecResult, chars: int) -> str:
    text = output_text(result).strip()
    return text[-chars:] if text else "no output"


def prepare(sandbox, workdir: str, files: Optional[Mapping[str, Union[str, bytes]]] = None,
            setup: Optional[str] = None, timeout_s: float = 600.0,
            session: str = SESSION) -> None:
    """Make a task's working directory ready in ``sandbox`` (a SandboxHandle), with
    direct calls; SandmanError when the setup fails (see ``_preparing``)."""
    steps = _preparing(sandbox.sandbox, workdir, files, setup, timeout_s, session)
    try:
        op, args, kwargs = next(steps)
        while True:
            op, args, kwargs = steps.send(getattr(sandbox, op)(*args, **kwargs))
    except StopIteration:
        pass


async def prepare_async(sandbox, workdir: str,
                        files: Optional[Mapping[str, Union[str, bytes]]] = None,
                        setup: Optional[str] = None, timeout_s: float = 600.0,
                        session: str = SESSION) -> None:
    """``prepare`` for asyncio callers."""
    steps = _preparing(sandbox.sandbox, workdir, files, setup, timeout_s, session)
    try:
        op, args, kwargs = next(steps)
        while True:
            op, args, kwargs = steps.send(await getattr(sandbox, op + "_async")(*args, **kwargs))
    except StopIteration:
        pass


def check_workdir(workdir: Any, setting: str) -> str:
    """``workdir`` if it is an absolute path; a ValueError that names the ``setting``
    it came from otherwise."""
    if not isinstance(workdir, str) or not workdir.startswith("/"):
        raise ValueError("%s must be an absolute path, got %r" % (setting, workdir))
    return workdir
