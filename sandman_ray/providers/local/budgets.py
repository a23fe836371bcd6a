"""What cgroup v1 counts but does not hold: a sandbox's socket buffers.

Under cgroup v1 a memory group's TCP and UDP buffers are counted apart from its memory
(``memory.kmem.tcp.usage_in_bytes``), and their limit only puts the group's sockets
under pressure: each socket still keeps its minimum buffers, so a sandbox with many
sockets holds what it likes of the host-wide pool (``net.ipv4.tcp_mem``, every
socket's on the node, Ray's among them). Measured here (kernel 6.18): a group limited to
20 MiB held 757 MiB of loopback buffers; a sandbox with ``memory=250Mi`` held 865 MiB.
(cgroup v2 charges socket memory to ``memory.max`` itself; nothing is needed there.)

So the agent holds them: every ``INTERVAL_S`` it reads its own group's TCP usage (the
sum of its sandboxes'), and only when that passes the smallest limit among them does it
read each sandbox's; a sandbox past its memory limit in socket buffers has its
processes killed, as the OOM killer would, but its daemon (and bubblewrap around it),
which answers the commands that died with SIGKILL. A reading per interval costs
~20 µs; the budget is overshot by at most what a sandbox queues in one interval
(~360 MB/s of loopback writes measured here: ~90 MB at 0.25 s).
"""

import asyncio
import logging
import os
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

logger = logging.getLogger(__name__)

INTERVAL_S = 0.25
USAGE = "memory.kmem.tcp.usage_in_bytes"


def socket_bytes(memory_group: Path) -> Optional[int]:
    """The socket buffer bytes a v1 memory group holds (None: not readable)."""
    try:
        with open(memory_group / USAGE) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def over_budget(parent: Path, sandboxes: Iterable) -> list:
    """The sandboxes (of those given: each with ``cgroups`` and ``spec``) whose socket
    buffers pass their memory limit; reads the parent's usage first and stops there
    while it is below every limit."""
    sandboxes = [sb for sb in sandboxes if sb.cgroups is not None and sb.spec.memory]
    if not sandboxes:
        return []
    # the usual round: one file read, and the smallest limit (of a few more sandboxes
    # than those held in v1 memory groups: smaller, never larger)
    total = socket_bytes(parent)
    if total is not None and total <= min(sb.spec.memory for sb in sandboxes):
        return []
    limited = [(sb, sb.cgroups.memory_dir()) for sb in sandboxes
               if sb.cgroups.applied.get("memory") == "cgroup-v1"]
    return [sb for sb, group in limited
            if group is not None and (socket_bytes(group) or 0) > sb.spec.memory]


def enforce(sandbox) -> int:
    """Kill every process of ``sandbox`` but its daemon and the chain that holds it;
    how many were killed."""
    from sandman_ray.providers.janitor import kill
    keep = sandbox.keepers()
    victims = [pid for pid in sandbox.cgroups.members() if pid not in keep]
    kill(victims)
    return len(victims)


async def watch(parent: Path, sandboxes: Callable[[], Dict[str, object]],
                closed: Callable[[], bool]) -> None:
    """The agent's watch over its sandboxes' socket buffers, until ``closed()``."""
    loop = asyncio.get_running_loop()
    while not closed():
        try:
            found = await loop.run_in_executor(None, over_budget, parent,
                                               list(sandboxes().values()))
            for sandbox in found:
                killed = await loop.run_in_executor(None, enforce, sandbox)
                logger.warning("sandbox %s held more socket buffers than its memory limit "
                               "(%d bytes): %d of its processes killed", sandbox.sandbox_id,
                               sandbox.spec.memory, killed)
        except Exception:  # a sandbox removed under the reading: the next round sees
            logger.exception("socket budget watch")
        await asyncio.sleep(INTERVAL_S)


def v1_parent(group: str) -> Optional[Path]:
    """The v1 memory group of an agent's sandboxes (None where memory is not v1)."""
    from sandman_ray.providers.local.cgroups import Cgroups
    if Cgroups.unified() or not os.access(Cgroups.ROOT / "memory", os.W_OK):
        return None
    return Cgroups.ROOT / "memory" / group
