"""SandboxHandle: the actor through which one client uses one leased sandbox.

Created by the client, so owned by it: the handle dies with its owner (driver, worker
or actor), and a handle whose last reference is dropped is collected; the pool's
watchdog then sees its name gone and reclaims the sandbox. A handle runs on its
sandbox's node (the daemon's unix socket is there), uses ``num_cpus=0`` and one
asyncio connection with many requests in flight. A released handle is kept idle by the
client library and bound to the next lease on the same node, so a steady-state acquire
starts no new actor process.
"""

import time
from typing import Optional

import ray

from sandman_ray.client import AsyncDaemonClient
from sandman_ray.errors import CallTimeout, ConnectionLost, ExecTimeout, SandboxLost, SandmanError
from sandman_ray.pool.metrics import handle_call_latency

# The daemon operations a handle forwards (see sandman_ray.client for their arguments).
FORWARDED = ("ping", "info", "exec", "run", "session_open", "session_close", "session_list",
             "spawn", "proc_status", "proc_list", "proc_output", "proc_wait", "proc_signal",
             "read_file", "write_file", "stat", "list_dir", "mkdir", "remove", "move",
             "get_archive", "put_archive")
TOUCH_EVERY_S = 2.0  # how often a busy handle tells the pool it is in use
# Ray restarts a handle whose process or node died (not one whose owner died or that was
# killed): the new incarnation holds nothing, so calls in flight or queued then are
# retried on it and raise SandboxLost instead of Ray's actor errors.
HANDLE_RESTARTS = 3


class _SandboxHandle:
    def __init__(self, name: str, pool_actor_name: str):
        self.name = name
        self.pool_actor_name = pool_actor_name
        self.lease = None
        self.client: Optional[AsyncDaemonClient] = None
        self.touched = 0.0
        self.pool = None  # (actor name, handle): looked up once per pool
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:  # whatever the old incarnation held is lost: the pool frees it
            self._pool().handle_restarted.remote(name)

    def _pool(self):
        from sandman_ray.pool.actor import NAMESPACE
        if self.pool is None or self.pool[0] != self.pool_actor_name:
            self.pool = (self.pool_actor_name,
                         ray.get_actor(self.pool_actor_name, namespace=NAMESPACE))
        return self.pool[1]

    async def bind(self, lease, register: bool = True) -> str:
        """Take ``lease``: connect to its daemon and, unless the pool was given this
        handle's name with the lease request, register with the pool (which also
        confirms the lease is still open)."""
        from sandman_ray.pool.actor import pool_actor_name
        if self.client is not None:
            self.client.close()
        self.lease, self.client = lease, None
        self.pool_actor_name = pool_actor_name(lease.pool)  # an idle handle serves any pool
        try:
            self.client = await AsyncDaemonClient.connect(lease.address, lease.token)
        except ConnectionLost as exc:
            raise SandboxLost("sandbox %s is gone: %s" % (lease.sandbox_id, exc)) from exc
        if register and not await self._pool().register.remote(lease.lease_id, self.name):
            raise SandboxLost("lease %s of sandbox %s ended before it was taken"
                              % (lease.lease_id, lease.sandbox_id))
        return self.name

    async def release(self) -> bool:
        """End the lease. True: the handle is idle afterwards, ready for another; False:
        it was restarted (perhaps on another node than its sandbox's) and should go."""
        lease, self.lease = self.lease, None
        if self.client is not None:
            self.client.close()
            self.client = None
        if lease is not None:
            await self._pool().release.remote(lease.lease_id)
        return not self.restarted

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def sandbox_id(self) -> Optional[str]:
        return self.lease.sandbox_id if self.lease else None

    async def _call(self, op: str, args, kwargs):
        if self.client is None or self.lease is None:
            if self.restarted:
                raise SandboxLost("handle %s was restarted after its process or Ray node "
                                  "died: its sandbox is lost" % self.name)
            raise SandmanError("handle %s holds no sandbox (released?)" % self.name)
        now = time.monotonic()
        if now - self.touched > TOUCH_EVERY_S:
            self.touched = now
            self._pool().touch.remote(self.lease.lease_id)
        try:
            result = await getattr(self.client, op)(*args, **kwargs)
            handle_call_latency().observe(time.monotonic() - now,
                                          tags={"pool": self.lease.pool, "op": op})
            return result
        except ConnectionLost as exc:
            raise SandboxLost("sandbox %s is gone (%s during %s)"
                              % (self.lease.sandbox_id, exc, op)) from exc
        except CallTimeout as exc:
            raise ExecTimeout("%s on sandbox %s: %s" % (op, self.lease.sandbox_id, exc)) from exc


def _forward(op: str):
    async def method(self, *args, **kwargs):
        return await self._call(op, args, kwargs)
    method.__name__ = op
    method.__doc__ = "Forwarded to the daemon: see DaemonClient.%s." % op
    return method


for _op in FORWARDED:
    setattr(_SandboxHandle, _op, _forward(_op))

SandboxHandle = ray.remote(num_cpus=0, max_restarts=HANDLE_RESTARTS,
                           max_task_retries=-1)(_SandboxHandle)
