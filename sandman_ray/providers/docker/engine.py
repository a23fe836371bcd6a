"""The engine side of the DockerProvider, with no Ray: a client of a node's engine
(Docker, or Podman's compatible service), the facts the provider checks, containers
listed and removed by label, engine errors classified for the pool's pacing, and
snapshots (images committed from containers, listed and removed by label). The
janitor (``providers/janitor.py``) removes a dead agent's containers with it."""

import hashlib
import json
import logging
import os
import re
import stat
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

from sandman_ray.errors import ProviderError
from sandman_ray.providers.base import (
    POOL_LABEL, SANDBOX_LABEL, SnapshotInfo, fatal, throttled, transient)

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


# ---- snapshots: images committed from a pool's containers
#
# A snapshot of pool P named N is the image ``localhost/sandman-snapshot-<p>-<hash>:N``
# on the engine of the node it was taken on, labelled with the pool and the name (the
# labels, not the reference, are what listing trusts). ``<p>`` is P lowercased with
# every run of other characters made one '-' (repositories are lowercase), and
# ``<hash>`` six hex digits of P's sha256, so pools whose names differ only in case or
# punctuation keep apart.

SNAPSHOT_REPOSITORY = "localhost/sandman-snapshot-"
SNAPSHOT_LABEL = "sandman.snapshot"              # the snapshot's name in its pool
SNAPSHOT_BASE_LABEL = "sandman.snapshot.base"    # the image below every snapshot layer
SNAPSHOT_BASE_BYTES_LABEL = "sandman.snapshot.base-bytes"  # that image's size
SNAPSHOT_SOURCE_LABEL = "sandman.snapshot.source"          # the sandbox it was taken of
SNAPSHOT_CREATED_LABEL = "sandman.snapshot.created"        # wall-clock seconds
# a tag, as engines take it; snapshot names must be one
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
_SNAPSHOT_REFERENCE = re.compile(re.escape(SNAPSHOT_REPOSITORY) +
                                 r"[a-z0-9-]+-[0-9a-f]{6}:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")


def check_snapshot_name(name) -> str:
    """A snapshot's name becomes its image's tag: 1 to 128 letters, digits, '_', '.'
    or '-', not starting with '.' or '-'."""
    if not isinstance(name, str) or not _TAG.match(name):
        raise fatal("snapshot name %r: use 1 to 128 letters, digits, '_', '.' or '-', not "
                    "starting with '.' or '-' (it becomes the image's tag)" % (name,))
    return name


def snapshot_reference(pool: str, name: str) -> str:
    """The image reference of the snapshot ``name`` of ``pool``."""
    component = re.sub(r"[^a-z0-9]+", "-", pool.lower()).strip("-")
    return "%s%s-%s:%s" % (SNAPSHOT_REPOSITORY, component,
                           hashlib.sha256(pool.encode()).hexdigest()[:6],
                           check_snapshot_name(name))


def is_snapshot_reference(image: str) -> bool:
    """Whether ``image`` is shaped as a snapshot's reference (of any pool)."""
    return bool(_SNAPSHOT_REFERENCE.match(image))


def snapshot_labels(pool: str, name: str, base: str, base_bytes: int, source: str,
                    created_at: float) -> Dict[str, str]:
    """What a snapshot's image says of itself (see ``snapshot_info``)."""
    return {POOL_LABEL: pool, SNAPSHOT_LABEL: name, SNAPSHOT_BASE_LABEL: base,
            SNAPSHOT_BASE_BYTES_LABEL: str(base_bytes), SNAPSHOT_SOURCE_LABEL: source,
            SNAPSHOT_CREATED_LABEL: "%.3f" % created_at}


def snapshot_info(image: dict, node_id: str) -> Optional[SnapshotInfo]:
    """A SnapshotInfo from an image as the engine lists or inspects it; None for an
    image that is not a snapshot under its own reference (an untagged leftover)."""
    labels = (image.get("Config") or {}).get("Labels") or image.get("Labels") or {}
    pool, name = labels.get(POOL_LABEL), labels.get(SNAPSHOT_LABEL)
    if not pool or not name or not _TAG.match(name):
        return None
    reference = snapshot_reference(pool, name)
    if reference not in (image.get("RepoTags") or []):
        return None
    try:
        base_bytes = int(labels.get(SNAPSHOT_BASE_BYTES_LABEL, "0"))
        created_at = float(labels.get(SNAPSHOT_CREATED_LABEL, "0"))
    except ValueError:
        base_bytes, created_at = 0, 0.0
    return SnapshotInfo(name=name, image=reference, base=labels.get(SNAPSHOT_BASE_LABEL, ""),
                        size_bytes=max(0, int(image.get("Size") or 0) - base_bytes),
                        node_id=node_id, source=labels.get(SNAPSHOT_SOURCE_LABEL, ""),
                        created_at=created_at)


def snapshot_base(ran: str, image: dict) -> Tuple[str, int]:
    """(base, its size in bytes) of a snapshot of a sandbox that ran ``image`` (as
    inspected; ``ran``: its reference): the image below every snapshot layer, which is
    ``ran`` itself unless that is a snapshot."""
    labels = (image.get("Config") or {}).get("Labels") or {}
    if labels.get(SNAPSHOT_BASE_LABEL):
        try:
            return labels[SNAPSHOT_BASE_LABEL], int(labels.get(SNAPSHOT_BASE_BYTES_LABEL, "0"))
        except ValueError:
            pass
    return ran, int(image.get("Size") or 0)


def snapshot_images(engine, pool: str) -> List[dict]:
    """The engine's images carrying ``pool``'s snapshot labels, as the list call
    reports them (with any that lost their tag)."""
    images = engine.api.images(filters={"label": ["%s=%s" % (POOL_LABEL, pool)]})
    return [i for i in images if (i.get("Labels") or {}).get(SNAPSHOT_LABEL)]


def commit_changes(labels: Dict[str, str], blank_labels: Iterable[str], container: dict,
                   base: dict) -> List[str]:
    """The Dockerfile instructions of a commit of ``container`` (as inspected):
    ``labels`` set, ``blank_labels`` made empty (an engine cannot drop a label the
    container had), and the entrypoint and command put back to those of ``base`` (the
    image the container ran, as inspected), and its working directory and user where
    the sandbox's spec changed them (an image with no user runs as 0), so the snapshot
    starts as its base did, not as the daemon the provider made the entrypoint. One
    label per instruction: Podman reads a LABEL as a single key=value."""
    config, ran = base.get("Config") or {}, container.get("Config") or {}
    changes = ["LABEL %s=%s" % (key, json.dumps(value)) for key, value in sorted(labels.items())]
    changes += ["LABEL %s=\"\"" % key for key in sorted(blank_labels) if key not in labels]
    changes += ["ENTRYPOINT %s" % json.dumps(config.get("Entrypoint") or []),
                "CMD %s" % json.dumps(config.get("Cmd") or [])]
    if (ran.get("WorkingDir") or "/") != (config.get("WorkingDir") or "/"):
        changes.append("WORKDIR %s" % (config.get("WorkingDir") or "/"))
    if (ran.get("User") or "") != (config.get("User") or ""):
        changes.append("USER %s" % (config.get("User") or "0"))
    # the base's environment: the container's own set each of its variables empty for
    # the daemon (ContainerSpecs.launch_environment)
    for entry in config.get("Env") or ():
        key, _, value = entry.partition("=")
        changes.append("ENV %s=%s" % (key, _dockerfile_quoted(value)))
    return changes


def _dockerfile_quoted(value: str) -> str:
    """``value`` as a Dockerfile instruction reads it back unchanged: in double quotes,
    with its backslashes, quotes and dollars escaped (no variable is expanded)."""
    return '"%s"' % value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")


def commit_container(engine, container: dict, reference: str, changes: List[str]) -> str:
    """Commit the container (``container``: its inspection) to ``reference``; the
    image's id. The container is paused while its writable layer is read, and left
    paused or running as it was.

    Podman 4 maps a ``--userns=auto`` container's image through an idmapped mount, so
    its writable layer holds the host ids of the container's range, and its commit
    copies them as they are: a sandbox started from that image (another range) would
    see its files owned by nobody. In that case the layer's owners are shifted to the
    ids they have inside the container for the length of the commit (the container
    paused meanwhile), then put back exactly."""
    repository, _, tag = reference.rpartition(":")
    layer = _layer_to_shift(container)
    if layer is None:
        return engine.api.commit(container["Id"], repository=repository, tag=tag,
                                 changes=changes, pause=True)["Id"]
    paused_before = bool((container.get("State") or {}).get("Paused"))
    if not paused_before:
        engine.api.pause(container["Id"])
    try:
        changed = _shift_inside(*layer)
        try:
            return engine.api.commit(container["Id"], repository=repository, tag=tag,
                                     changes=changes, pause=False)["Id"]
        finally:
            _shift_back(changed)
    finally:
        if not paused_before:
            engine.api.unpause(container["Id"])


def _id_ranges(pid: int, which: str) -> List[Tuple[int, int, int]]:
    """(inside, outside, count) of each line of /proc/<pid>/{uid,gid}_map."""
    with open("/proc/%d/%s" % (pid, which)) as fh:
        return [tuple(int(field) for field in line.split()) for line in fh if line.strip()]


def _inside(host_id: int, ranges: List[Tuple[int, int, int]]) -> Optional[int]:
    for inside, outside, count in ranges:
        if outside <= host_id < outside + count:
            return inside + host_id - outside
    return None


def _layer_to_shift(container: dict):
    """(writable layer directory, uid ranges, gid ranges) when the container's layer
    holds host ids its engine would commit unshifted, else None: an overlay whose
    image layers (below) are owned by ids outside the container's range, as under an
    idmapped mount, while the container has a range of its own. An engine that copies
    the image into the range (no idmapped mounts), Docker's userns-remap (every layer
    in the range) and containers without a user namespace commit the right ids."""
    driver = container.get("GraphDriver") or {}
    data = driver.get("Data") or {}
    pid = (container.get("State") or {}).get("Pid") or 0
    upper, lower = data.get("UpperDir"), (data.get("LowerDir") or "").split(":")[-1]
    if driver.get("Name") != "overlay" or not upper or not lower or not pid:
        return None
    try:
        uids, gids = _id_ranges(pid, "uid_map"), _id_ranges(pid, "gid_map")
        image_root = os.lstat(lower).st_uid
    except OSError as exc:
        raise fatal("commit container %s: cannot read its id mapping or image layers "
                    "(the agent must run as root on the engine's host): %s"
                    % (container.get("Name") or container["Id"][:12], exc)) from exc
    if uids == [(0, 0, 4294967295)] or _inside(image_root, uids) is not None:
        return None
    return upper, uids, gids


def _shift_inside(upper: str, uids, gids) -> list:
    """Give every file of the writable layer ``upper`` owned by an id of the container's
    ranges the id it has inside; what changed, for ``_shift_back``. A chown clears
    set-id bits and drops file capabilities: both are put back (capabilities stay tied
    to the sandbox's own range, so one set inside a sandbox does not apply in the
    sandboxes of its snapshot)."""
    changed = []
    try:
        for path in _walk(upper):
            st = os.lstat(path)
            uid, gid = _inside(st.st_uid, uids), _inside(st.st_gid, gids)
            if uid is None and gid is None:
                continue
            caps = _capabilities(path, st)
            changed.append((path, st, caps))
            _set_owner(path, st, caps, st.st_uid if uid is None else uid,
                       st.st_gid if gid is None else gid)
    except BaseException as exc:  # a RecursionError of a deep tree too: put all back
        _shift_back(changed)
        raise fatal("commit: cannot give the files of the writable layer %s their ids "
                    "inside the container (the agent must run as root on the engine's "
                    "host): %s: %s" % (upper, type(exc).__name__, exc)) from exc
    return changed


def _shift_back(changed: list) -> None:
    """Put every file ``_shift_inside`` changed back as it was; every one is tried."""
    failures = []
    for path, st, caps in reversed(changed):
        try:
            _set_owner(path, st, caps, st.st_uid, st.st_gid)
        except OSError as exc:
            failures.append("%s: %s" % (path, exc))
    if failures:
        raise fatal("commit: %d files of the container's writable layer could not be given "
                    "back their owners (the sandbox may no longer own them): %s"
                    % (len(failures), "; ".join(failures[:5])))


def _walk(top: str):
    """``top`` and every path below it, without following links; iterative (os.walk
    recurses, and a container can make a tree deeper than Python's stack)."""
    yield top
    pending = [top]
    while pending:
        parent = pending.pop()
        with os.scandir(parent) as entries:
            for entry in entries:
                yield entry.path
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)


def _capabilities(path: str, st: os.stat_result) -> Optional[bytes]:
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        return os.getxattr(path, "security.capability", follow_symlinks=False)
    except OSError:
        return None


def _set_owner(path: str, st: os.stat_result, caps: Optional[bytes], uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        os.chmod(path, stat.S_IMODE(st.st_mode))
    if caps is not None:
        os.setxattr(path, "security.capability", caps, follow_symlinks=False)


def remove_snapshot_image(engine, reference: str) -> bool:
    """Remove a snapshot's image; False if there was none. One that containers still
    run from is a fatal error naming them (their sandbox ids)."""
    import docker.errors
    try:
        engine.api.remove_image(reference)
        return True
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as exc:
        if exc.status_code != 409:
            raise
        users = engine.api.containers(all=True, filters={"ancestor": reference})
        names = ", ".join("%s (sandbox %s)" % (
            ((c.get("Names") or ["?"])[0]).lstrip("/"),
            (c.get("Labels") or {}).get(SANDBOX_LABEL) or "not a sandbox") for c in users)
        raise fatal("delete snapshot image %s: containers still run from it: %s; delete "
                    "them first (%s)" % (reference, names or "(the engine names none)",
                                         exc.explanation or exc)) from exc


def remove_snapshot_images(engine, pool: str) -> int:
    """Remove every snapshot image of ``pool`` from the engine (also those that lost
    their tag); how many. Every one is tried; the first failure is then raised."""
    removed, failures = 0, []
    for image in snapshot_images(engine, pool):
        ours = [t for t in image.get("RepoTags") or [] if is_snapshot_reference(t)]
        for reference in ours or [image["Id"]]:
            try:
                removed += remove_snapshot_image(engine, reference)
            except Exception as exc:
                failures.append(exc)
    if failures:
        raise failures[0]
    return removed
