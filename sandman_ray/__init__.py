"""sandman-ray: Ray-native sandboxes for agentic reinforcement learning.

    import ray, sandman_ray as sandman
    ray.init()
    sandman.create_pool("default", warm={"builtin:debian": 4})
    with sandman.sandbox() as sb:   # builtin:debian
        ray.get(sb.exec.remote("echo hi"))
"""

from sandman_ray.api import (
    acquire, acquire_async, create_pool, get_pool, release, release_async, sandbox,
    shutdown_pool)
from sandman_ray.client import (
    AsyncDaemonClient, DaemonClient, ExecResult, FileStat, ProcessOutput, ProcessStatus)
from sandman_ray.errors import (
    AcquireTimeout, AuthError, CallTimeout, ConnectionLost, DaemonError, ExecTimeout,
    LeaseEnded, LeaseNotHeld, ProtocolError, ProviderError, ResultTooLarge, SandboxLost,
    SandmanError)
from sandman_ray.providers.docker import DockerProvider
from sandman_ray.providers.kubernetes import KubernetesProvider
from sandman_ray.providers.local import LocalProvider
from sandman_ray.handle import SandboxHandle
from sandman_ray.spec import PoolConfig, SandboxSpec

__version__ = "0.1.0"

__all__ = [
    "AcquireTimeout", "AsyncDaemonClient", "AuthError", "CallTimeout", "ConnectionLost",
    "DaemonClient", "DaemonError", "DockerProvider", "ExecResult", "ExecTimeout", "FileStat",
    "KubernetesProvider", "LeaseEnded", "LeaseNotHeld", "LocalProvider",
    "PoolConfig", "ProcessOutput", "ProcessStatus", "ProtocolError", "ProviderError",
    "ResultTooLarge",
    "SandboxHandle", "SandboxLost", "SandboxSpec", "SandmanError", "acquire", "acquire_async", "create_pool",
    "get_pool", "release", "release_async", "sandbox", "shutdown_pool",
]
