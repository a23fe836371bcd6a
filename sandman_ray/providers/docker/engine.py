"""The engine side of the DockerProvider, with no Ray: a client of a node's engine
(Docker, or Podman's compatible service), the facts the provider checks, containers
listed and removed by label, and engine errors classified for the pool's pacing.
The janitor (``providers/janitor.py``) removes a dead agent's containers with it."""

import hashlib
import logging
import os
import re
from typing import List, NamedTuple

from sandman_ray.errors import ProviderError
from sandman_ray.providers.base import fatal, throttled, transient

logger = logging.getLogger(__name__)

API_VERSION = "1.41"            # Docker 20.10+ and Podman 4 speak it


def default_engine_url() -> str:
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def engine_client(base_url: str, pool_size: int = 10):
    """A Docker SDK client that does not talk to the engine until it is used."""
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - the extra is part of the test set-up
        raise fatal("the DockerProvider needs the docker SDK: pip install 'sandman-ray[docker]'"
                    ) from exc
    return docker.DockerClient(base_url=base_url, version=API_VERSION, timeout=300,
                               max_pool_size=pool_size)


class EngineFacts(NamedTuple):
    """What a create needs to know of the engine, asked once per agent."""
    podman: bool
    default_runtime: str
    userns_remap: bool  # Docker's daemon maps every container's root to a range


def engine_facts(engine) -> EngineFacts:
    version, info = engine.version(), engine.info()
    names = [c.get("Name", "") for c in version.get("Components") or []]
    return EngineFacts(podman=any("Podman" in name for name in names),
                       default_runtime=info.get("DefaultRuntime") or "runc",
                       userns_remap=any("name=userns" in option
                                        for option in info.get("SecurityOptions") or []))


def container_name(pool: str, sandbox_id: str) -> str:
    """Engines allow [a-zA-Z0-9_.-]; a short hash of the pool's name keeps two pools
    whose names differ only in other characters apart."""
    return "sandman-%s-%s-%s" % (re.sub(r"[^a-zA-Z0-9_.-]", "-", pool)[:40],
                                 hashlib.sha256(pool.encode()).hexdigest()[:6],
                                 re.sub(r"[^a-zA-Z0-9_.-]", "-", sandbox_id))


def short_name(pool: str, node_id: str) -> str:
    """A pool and node's directory name: fixed length, whatever the pool is called."""
    return "%s-%s" % (hashlib.sha256(pool.encode()).hexdigest()[:8], node_id[:8])


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost of an exception's arguments and causes (requests wraps urllib3,
    which wraps the socket's OSError)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = exc.__cause__ or exc.__context__ or next(
            (a for a in getattr(exc, "args", ()) if isinstance(a, BaseException)), None)
        if inner is None:
            return exc
        exc = inner
    return exc


def engine_error(exc: BaseException, what: str) -> ProviderError:
    """``exc`` from the SDK as a ProviderError whose kind tells the pool how to pace."""
    import docker.errors
    import requests.exceptions
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, requests.exceptions.ConnectionError):
        reason = _root_cause(exc)
        if isinstance(reason, PermissionError):
            return fatal("%s: no permission to use the container engine's socket (is this "
                         "user in the docker group?): %s" % (what, exc))
        if isinstance(reason, FileNotFoundError):
            return fatal("%s: no container engine listens at this address (DockerProvider's "
                         "base_url, or $DOCKER_HOST): %s" % (what, exc))
    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return transient("%s: the container engine is unreachable or busy: %s" % (what, exc))
    if isinstance(exc, docker.errors.APIError):
        code = exc.status_code or 0
        reason = exc.explanation or str(exc)
        if code == 429:
            return throttled("%s: the engine asks to slow down: %s" % (what, reason))
        if code >= 500 or code == 0:
            return transient("%s: engine error %s: %s" % (what, code, reason))
        return fatal("%s: the engine refused it (%s): %s" % (what, code, reason))
    if isinstance(exc, docker.errors.DockerException):
        return transient("%s: %s" % (what, exc))
    return fatal("%s: %s: %s" % (what, type(exc).__name__, exc))


def _no_such_container(exc) -> bool:
    """A NotFound, or the 500 Podman answers for a container removed meanwhile."""
    import docker.errors
    return isinstance(exc, docker.errors.NotFound) or (
        isinstance(exc, docker.errors.APIError) and "no such container" in str(exc).lower())


def list_containers(engine, labels: List[str]) -> List[dict]:
    """The engine's containers (running or not) carrying every ``key=value`` of
    ``labels``, as the list call reports them: one request, no inspect per container
    (which races with removals)."""
    return engine.api.containers(all=True, filters={"label": labels})


def remove_container(engine, name: str) -> bool:
    """Remove a container (running or not) with its anonymous volumes; False if there
    was none. Podman, for a container with a user namespace, can answer 500 "device or
    resource busy" (its shm directory) for a removal that did happen: asked again, it
    says whether the container is gone."""
    import docker.errors
    try:
        engine.api.remove_container(name, force=True, v=True)
        return True
    except docker.errors.APIError as exc:
        if _no_such_container(exc):
            return False
        if "resource busy" not in str(exc):
            raise
    try:
        engine.api.inspect_container(name)
    except docker.errors.APIError as exc:
        if _no_such_container(exc):
            return True
        raise
    engine.api.remove_container(name, force=True, v=True)  # still there: once more
    return True


def remove_containers(engine, labels: List[str], keep=lambda labels: False) -> int:
    """Remove the engine's containers carrying every ``key=value`` of ``labels``, with
    their anonymous volumes, except those whose labels ``keep`` accepts; how many were
    removed. One that cannot be removed (gone meanwhile, engine trouble) is logged."""
    removed = 0
    for container in list_containers(engine, labels):
        if keep(container.get("Labels") or {}):
            continue
        try:
            removed += remove_container(engine, container["Id"])
        except Exception as exc:
            logger.warning("cannot remove container %s: %s", container["Id"][:12], exc)
    return removed


class PullFailed(Exception):
    """The engine's own account of a failed pull."""


# What registries and engines say, matched on whole words (a digest or a port number
# must not read as an HTTP status).
_PULL_FAILURES = (
    (r"toomanyrequests|too many requests|\b429\b", throttled,
     "the registry of image %s asks to slow down"),
    (r"manifest unknown|name unknown|not found|no such image|does not exist|\b404\b", fatal,
     "image %s does not exist in its registry"),
    (r"unauthorized|authentication required|access (to the resource )?is denied|access denied"
     r"|forbidden|\b401\b|\b403\b", fatal,
     "the registry refused to serve image %s (credentials?)"),
    (r"connection refused|no such host|dial tcp|i/o timeout|tls:|network is unreachable"
     r"|server gave http response|lookup |timeout", fatal,
     "the registry of image %s is unreachable"),
)


def pull_error(image: str, exc: BaseException) -> ProviderError:
    """A failed pull, saying which failure it was. An unknown image, refused
    credentials or an unreachable registry are fatal: the engine already retried, and
    every caller waiting for the image should learn why at once. A registry that asks
    to slow down is throttled; an engine that is itself unreachable or busy, or a
    progress stream cut off, is transient."""
    import requests.exceptions
    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                        requests.exceptions.ChunkedEncodingError)):
        return transient("pull %s: the engine's answer broke off: %s" % (image, exc))
    text = str(getattr(exc, "explanation", None) or exc)
    for pattern, kind, message in _PULL_FAILURES:
        if re.search(pattern, text, re.I):
            return kind("%s: %s" % (message % image, text))
    return engine_error(exc, "pull %s" % image)
