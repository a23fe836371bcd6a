"""DockerProvider: sandboxes as containers through the Docker Engine API.

Works against Docker and against Podman's compatible service (``podman system service``).
One ``DockerAgent`` actor per pool and node (``sandman:docker-agent:<pool>:<node id>``)
talks to that node's engine; the pool-side half is shared with the LocalProvider
(``providers/nodes.py``). Each container runs the task image unmodified:

- the daemon bundle is bind-mounted read-only at ``/.sandman`` and the daemon is the
  entrypoint (PID 1 of the container, so it reaps zombies); the image's own entrypoint
  and cmd are not run, its Env, WorkingDir and User are honoured by the engine;
- the daemon listens on a unix socket in a per-sandbox host directory bind-mounted at
  ``/run/sandman`` (``transport="unix"``, for handles on the same node), or on TCP
  published on the node's address (``transport="tcp"``, needs ``network=True``); the
  per-sandbox token is a file in that directory that the daemon removes once read,
  never a label or an env var. The sandbox can write that directory, so the host
  connects to the socket without following a symlink (``client._SocketPath``);
- root inside is not host root (``user_namespace="auto"``): Podman gives each
  container a range of 65536 host ids of its own (``--userns=auto``, from the
  ``containers`` entry of /etc/subuid and /etc/subgid, read through idmapped mounts
  with no copy of the image); Docker does so only with ``userns-remap`` in its daemon
  configuration, and a create says so rather than run as host root;
- ``network=True`` is Podman's slirp4netns (no host loopback, no IPv6) or Docker's
  bridge, with the LocalProvider's filter loaded into the container's network
  namespace before the daemon is reachable (``providers/network.py``): no host or
  cluster address, no private, link-local or metadata range unless
  ``SandboxSpec.network_allow`` names it. Containers get no CAP_NET_ADMIN to undo it;
- no nested user namespaces: ``user.max_user_namespaces`` is 0 inside the container's
  own (``userns.forbid_nested_user_namespaces``), which its root cannot raise;
- ``runtime`` picks the OCI runtime (``runsc``: gVisor); Podman's Docker API takes
  the runtime from its containers.conf rather than from the request, so with Podman
  the engine's default runtime must be the one asked for (``PodmanService(runtime=)``).
  Under runsc, root inside is root of gVisor's kernel, whose sentry runs unprivileged
  on the host; Podman's user namespace is not added there (runsc's gofer, which serves
  the bind mounts, would then lose access to the bundle), and files made inside stay
  in gVisor's memory-backed overlay;
- labels carry the pool, the sandbox id, the node and the agent's incarnation, so the
  pool lists and reconciles by label, and whatever an agent leaves when it dies is
  removed by its janitor (``providers/janitor.py``);
- no network unless the spec asks (``network_mode=none``); cpu, memory and pids limits
  from the spec; a disk limit (``storage_opt size``) where the engine's storage has
  quotas (``disk_quota=True``: overlay on xfs with pquota, btrfs, zfs), else none;
- an image is pulled at most once per node at a time: thirty creates of a cold image
  wait for one pull. Pull failures say which of unknown image, refused credentials or
  unreachable registry it was;
- engine errors are classified for the pool's pacing: 429 throttled; 5xx, timeouts and
  an unreachable engine transient; other 4xx fatal. Every SDK call is blocking and runs
  on the agent's thread pool, at most ``max_engine_calls`` at once per node;
- reset removes the container and creates it again from the same image under the same
  name (engines offer no cheaper way back to the image's state); delete removes the
  container with its anonymous volumes;
- a snapshot is the engine's commit of a sandbox's container: its files, not its
  processes, as the image ``localhost/sandman-snapshot-<pool>-<hash>:<name>`` on that
  node's engine (``engine.snapshot_reference``), labelled ``sandman.pool`` and
  ``sandman.snapshot``. A SandboxSpec takes that reference (or
  ``snapshot:<pool>/<name>``) as its image; its sandboxes start on the snapshot's node,
  and it is never pulled. The image starts like its base (entrypoint, command,
  working directory and user); the daemon bundle and socket directory are bind mounts,
  so not in it. Podman 4 commits a ``--userns=auto`` container's layer with host ids
  (its idmapped mounts): the agent gives the layer's files their ids inside for the
  length of the commit (``engine.commit_container``), so the snapshot's sandboxes,
  each with a range of its own, own their files as the captured sandbox did. Not
  under gVisor, whose files the commit does not see. The pool's shutdown removes its
  snapshots;
- pause and resume are the engine's pause and unpause (the container's cgroup frozen,
  memory kept; measured with Podman under runc and runsc alike). A paused sandbox's
  daemon does not answer until it is resumed.

Measured here with Podman 4.3 (runc): create 13 ms, start 63 ms, daemon listening 21 ms
later; the daemon over the bind-mounted socket answers ``exec true`` in ~1 ms, where the
engine's own exec takes 82-92 ms.
"""
import re
from typing import Optional

from sandman_ray.providers.docker.agent import DockerAgent
from sandman_ray.providers.docker.engine import (
    default_engine_url, is_snapshot_reference, snapshot_reference)
from sandman_ray.providers.nodes import NodeAgentProvider

DEFAULT_STATE_ROOT = "/tmp/sandman-ray/docker-state"
DEFAULT_CACHE_ROOT = "/tmp/sandman-ray/cache"


class DockerProvider(NodeAgentProvider):
    """Sandboxes as containers of the engine on each Ray node (Docker or Podman).

    base_url: the engine's API address on every node (default ``$DOCKER_HOST``, else
        ``unix:///var/run/docker.sock``); for Podman, the socket of
        ``podman system service``.
    transport: ``unix`` (the daemon's socket in a bind-mounted host directory; handles
        run on the sandbox's node) or ``tcp`` (published on the node's address, with
        the per-sandbox token; needs ``SandboxSpec(network=True)``).
    state_root: where each node keeps its sandboxes' socket directories.
    cache_root: where each node keeps the daemon bundle.
    ready_timeout_s: how long a new container's daemon may take to listen.
    max_engine_calls: most engine API calls in flight at once per node.
    user_namespace: ``auto`` (root inside is a range of host ids: Podman's
        ``--userns=auto``, Docker's ``userns-remap``) or ``host`` (root inside is host
        root: for trusted code only).
    runtime: the OCI runtime (``runsc`` for gVisor), else the engine's default.
    disk_quota: the engine's storage enforces ``storage_opt size`` (overlay on xfs with
        pquota, btrfs, zfs): each sandbox's disk is limited to ``SandboxSpec.disk``.
        Without it a container's disk is not limited.
    """

    supports_reset = True
    supports_snapshots = True
    agent_kind = "docker-agent"

    def __init__(self, base_url: Optional[str] = None, transport: str = "unix",
                 state_root: str = DEFAULT_STATE_ROOT, cache_root: str = DEFAULT_CACHE_ROOT,
                 ready_timeout_s: float = 60.0, max_engine_calls: int = 16,
                 user_namespace: str = "auto", runtime: Optional[str] = None,
                 disk_quota: bool = False):
        super().__init__()
        if user_namespace not in ("auto", "host"):
            raise ValueError("DockerProvider.user_namespace must be 'auto' or 'host', got %r"
                             % (user_namespace,))
        if runtime is not None and (not isinstance(runtime, str) or
                                    not re.fullmatch(r"[A-Za-z0-9_.-]+", runtime)):
            raise ValueError("DockerProvider.runtime must be an OCI runtime's name such as "
                             "'runsc', got %r" % (runtime,))
        if transport not in ("unix", "tcp"):
            raise ValueError("DockerProvider.transport must be 'unix' or 'tcp', got %r"
                             % (transport,))
        if isinstance(max_engine_calls, bool) or not isinstance(max_engine_calls, int) \
                or max_engine_calls < 1:
            raise ValueError("DockerProvider.max_engine_calls must be a positive int, got %r"
                             % (max_engine_calls,))
        self.base_url = base_url or default_engine_url()
        self.transport, self.state_root, self.cache_root = transport, state_root, cache_root
        self.ready_timeout_s, self.max_engine_calls = ready_timeout_s, max_engine_calls
        self.user_namespace, self.runtime, self.disk_quota = user_namespace, runtime, disk_quota

    def agent_class(self):
        return DockerAgent

    def agent_args(self, node_id: str) -> tuple:
        return (self.pool, node_id, self.base_url, self.state_root, self.cache_root,
                self.ready_timeout_s, self.transport, self.max_engine_calls,
                self.user_namespace, self.runtime, self.disk_quota)

    def is_snapshot_image(self, image: str) -> bool:
        """A snapshot's image reference (``localhost/sandman-snapshot-...:<name>``, of
        any pool: another pool's is refused as not this pool's), or
        ``snapshot:<pool>/<name>``."""
        return image.startswith("snapshot:") or is_snapshot_reference(image)

    async def _snapshot_node(self, image: str) -> Optional[str]:
        """As NodeAgentProvider's, with ``snapshot:<pool>/<name>`` read as this pool's
        snapshot reference (the agent does the same when it creates)."""
        if image.startswith("snapshot:"):
            pool, _, name = image[len("snapshot:"):].partition("/")
            if pool == self.pool:
                image = snapshot_reference(pool, name)
        return await super()._snapshot_node(image)
