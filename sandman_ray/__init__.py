"""sandman-ray: Ray-native sandboxes for agentic reinforcement learning.

    import ray, sandman_ray as sandman
    ray.init()
    sandman.create_pool("default", warm={"builtin:debian": 4})
    with sandman.sandbox() as sb:   # builtin:debian
        ray.get(sb.exec.remote("echo hi"))

From outside the pool's Ray cluster, through its service (``sandman serve``), with no
Ray::

    pool = sandman.connect("http://127.0.0.1:8470", api_key=KEY)
    with pool.sandbox() as sb:
        print(sb.exec("echo hi").stdout)

The names below are imported on first use (``sandman_ray._lazy``): importing one
module of the package does not load Ray.
"""

from typing import TYPE_CHECKING

from sandman_ray._lazy import exports

__version__ = "0.1.0"

_EXPORTS = {
    "sandman_ray.api": ("acquire", "acquire_async", "create_pool", "get_pool", "prefetch",
                        "prepare", "release", "release_async", "sandbox", "shutdown_pool"),
    "sandman_ray.forks": ("delete_snapshot", "fork", "fork_async", "pause", "resume",
                          "set_warm", "snapshot", "snapshots"),
    "sandman_ray.client": ("AsyncDaemonClient", "DaemonClient"),
    "sandman_ray.results": ("ExecResult", "FileStat", "ProcessOutput", "ProcessStatus"),
    "sandman_ray.errors": ("AcquireTimeout", "AuthError", "CallTimeout", "ConnectionLost",
                           "DaemonError", "ExecTimeout", "LeaseEnded", "LeaseNotHeld",
                           "NotSupported", "ProtocolError", "ProviderError",
                           "ResultTooLarge", "SandboxLost", "SandboxPaused", "SandmanError",
                           "ServiceLimit", "SnapshotInUse"),
    "sandman_ray.remote": ("connect",),
    "sandman_ray.providers.docker": ("DockerProvider",),
    "sandman_ray.providers.kubernetes": ("KubernetesProvider",),
    "sandman_ray.providers.local": ("LocalProvider",),
    "sandman_ray.handle": ("SandboxHandle",),
    "sandman_ray.spec": ("ANYWHERE", "PoolConfig", "SandboxSpec"),
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the names above as type checkers and IDEs see them (where each is
    # defined; tests/test_handle_types.py checks the two lists agree)
    from sandman_ray.api import (
        acquire, acquire_async, create_pool, get_pool, prefetch, prepare, release,
        release_async, sandbox, shutdown_pool)
    from sandman_ray.forks import (
        delete_snapshot, fork, fork_async, pause, resume, set_warm, snapshot, snapshots)
    from sandman_ray.client import AsyncDaemonClient, DaemonClient
    from sandman_ray.results import ExecResult, FileStat, ProcessOutput, ProcessStatus
    from sandman_ray.errors import (
        AcquireTimeout, AuthError, CallTimeout, ConnectionLost, DaemonError,
        ExecTimeout, LeaseEnded, LeaseNotHeld, NotSupported, ProtocolError,
        ProviderError, ResultTooLarge, SandboxLost, SandboxPaused, SandmanError,
        ServiceLimit, SnapshotInUse)
    from sandman_ray.remote import connect
    from sandman_ray.providers.docker.provider import DockerProvider
    from sandman_ray.providers.kubernetes.provider import KubernetesProvider
    from sandman_ray.providers.local.provider import LocalProvider
    from sandman_ray.handle import SandboxHandle
    from sandman_ray.spec import ANYWHERE, PoolConfig, SandboxSpec
