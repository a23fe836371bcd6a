"""The provider interface the pool uses: create, delete, list by label, locate, reset.

A provider owns the side effects (processes, containers, pods); the pool owns the
decisions. Every failure a provider raises is a ``ProviderError`` whose ``kind`` says
what the pool should do: ``throttled`` (slow down), ``transient`` (retry later, with
jitter) or ``fatal`` (give up on this request and say why).
"""

import abc
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from sandman_ray.errors import ProviderError
from sandman_ray.spec import SandboxSpec

# Labels every provider sets on its sandboxes, so the pool can reconcile after a restart.
POOL_LABEL = "sandman.pool"
SANDBOX_LABEL = "sandman.sandbox"


@dataclass(frozen=True)
class SandboxInfo:
    """Where a sandbox is and how to talk to it.

    sandbox_id: the pool's name for it (unique in the pool).
    address: the daemon's address (``unix:PATH`` or ``tcp:HOST:PORT``), valid on
        ``node_id`` (a unix socket) or anywhere that can reach it (TCP).
    token: the daemon's per-sandbox token.
    node_id: the Ray node the sandbox runs on (None when not on a Ray node).
    labels: the labels it was created with, including POOL_LABEL and SANDBOX_LABEL.
    created_at: wall-clock seconds when it was created (or last reset).
    details: provider-specific facts (image digest, limits applied, timings).
    """

    sandbox_id: str
    address: str
    token: str
    node_id: Optional[str] = None
    labels: Dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    details: Dict[str, object] = field(default_factory=dict)


def throttled(message: str) -> ProviderError:
    return ProviderError(message, "throttled")


def transient(message: str) -> ProviderError:
    return ProviderError(message, "transient")


def fatal(message: str) -> ProviderError:
    return ProviderError(message, "fatal")


class Provider(abc.ABC):
    """Creates and deletes sandboxes. Methods are coroutines: they run on the pool's
    event loop and must never block it (blocking calls go to a thread or to another
    actor)."""

    #: True when ``reset`` returns a sandbox to its initial state faster than a new one.
    supports_reset: bool = False

    @abc.abstractmethod
    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels: Dict[str, str]) -> SandboxInfo:
        """Start a sandbox whose daemon answers. Idempotent per ``sandbox_id``: a retry
        after a timeout returns the existing sandbox instead of a second one."""

    @abc.abstractmethod
    async def delete(self, sandbox_id: str) -> None:
        """Stop the sandbox and remove everything it left; deleting a sandbox that is
        already gone is not an error."""

    @abc.abstractmethod
    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        """Every sandbox this provider runs whose labels include ``labels``."""

    async def endpoint(self, sandbox_id: str) -> SandboxInfo:
        """Where ``sandbox_id`` is now; ``fatal`` ProviderError if it does not exist."""
        for info in await self.list({SANDBOX_LABEL: sandbox_id}):
            return info
        raise fatal("sandbox %s does not exist" % sandbox_id)

    async def probe(self, info: SandboxInfo) -> None:
        """Raise unless the sandbox's daemon answers a ping and a trivial exec: what
        READY means. This default connects from here (a TCP address, or a unix socket
        on this node)."""
        from sandman_ray.client import AsyncDaemonClient
        client = await AsyncDaemonClient.connect(info.address, info.token)
        try:
            await client.ping()
            result = await client.exec("true")
            if result.exit_code != 0:
                raise transient("sandbox %s: `true` exited %s" % (info.sandbox_id, result.exit_code))
        finally:
            client.close()

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """Return the sandbox to the state of a new one (files, processes), keeping its
        id, and answer once its daemon answers."""
        raise fatal("%s cannot reset sandboxes" % type(self).__name__)

    async def close(self) -> None:
        """Release what the provider holds in this process (connections, threads)."""
