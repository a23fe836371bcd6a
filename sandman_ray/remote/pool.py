"""``sandman_ray.connect``: a pool of a sandman service (``sandman serve``), used from
anywhere with an API key, without Ray.

    pool = sandman_ray.connect("http://127.0.0.1:8470", api_key=KEY)
    with pool.sandbox("builtin:debian") as sb:
        sb.exec("echo hi").stdout

An acquire is one HTTP request to the control plane, sent with a request id: asked
again after a cut connection or a timeout, it gets the same lease, never a second
sandbox. A sandbox's operations go over its own connection to the data plane, which
the service relays to the daemon (remote/channel.py): the methods, results and errors
of a direct ``DaemonClient``. One thread of the pool keeps its leases alive (a lease
the service hears nothing of for ``keepalive_s`` is reclaimed: a client that dies
leaves nothing behind).
"""

import asyncio
import contextlib
import http.client
import json
import ssl
import threading
import time
import uuid
from urllib.parse import quote
from typing import Optional, Set, Union

from sandman_ray.errors import ConnectionLost, LeaseEnded, LeaseNotHeld, SandmanError
from sandman_ray.client.blocking import DaemonClient
from sandman_ray.remote.channel import (
    connect_lease, connect_lease_async, service_error, service_url)
from sandman_ray.forking import (
    SESSION_STATE, check_count, run_to_end, session_state, start_forks)
from sandman_ray.spec import SandboxSpec

RETRY_SLEEP_S = 0.5  # between the tries of a request whose connection failed
KEEP_MAX = 1000  # lease ids in one keepalive request (service/http.py takes no more)
STREAMS = frozenset({"exec_stream"})  # operations whose asyncio form is an async iterator


def _named(name: Optional[str]) -> dict:
    return {} if name is None else {"name": name}


def connect(url: str, api_key: str, *, keepalive_s: float = 30.0,
            context: Optional[ssl.SSLContext] = None, route: str = "front") -> "RemotePool":
    """The pool that the service at ``url`` serves, for the tenant of ``api_key``.
    ``route``: where a sandbox's calls go, "front" (the service's data plane, which
    reaches every node's sandboxes: one address to reach) or "node" (the gateway of the
    sandbox's node, one hop less, for clients that reach the cluster's nodes)."""
    return RemotePool(url, api_key, keepalive_s=keepalive_s, context=context, route=route)


class RemoteSandbox:
    """A leased sandbox of a service: every operation of ``DaemonClient`` (``exec``,
    ``run``, ``write_file``, ``read_file``, ``spawn``...) over the data plane, and each
    as ``<op>_async`` for asyncio (``await sb.exec_async("ls")``, ``async for item in
    sb.exec_stream_async(...)``), as a SandboxHandle has them; ``release()`` (or
    ``await release_async()``) gives it back, also on leaving a ``with`` block. A call
    whose connection broke raises ConnectionLost, as a direct one does; the next call
    connects again (the service restarted: the lease is still this client's)."""

    def __init__(self, pool: "RemotePool", lease: dict):
        self.pool, self.lease = pool, lease
        self.lease_id, self.sandbox_id = lease["lease_id"], lease["sandbox_id"]
        self.sandbox = self.sandbox_id  # as a SandboxHandle names it
        self.node_id = lease.get("node_id")
        self.paused = False
        self.pause_between_steps = False  # the integrations' turns (steps.py): not here
        self.client = None  # the blocking calls' connection, made at the first
        self.aclient = None  # the asyncio calls' connection, on the loop of the first
        self.aloop = None

    @property
    def data_url(self) -> str:
        """Where this sandbox's calls go (the pool's ``route``)."""
        if self.pool.route == "node" and self.lease.get("gateway_url"):
            return self.lease["gateway_url"]
        return self.lease["data_url"]

    def _blocking(self):
        if self.client is None:
            self.client = connect_lease(self.data_url, self.pool.api_key,
                                        self.lease_id, context=self.pool.context)
        return self.client

    async def _async(self):
        loop = asyncio.get_running_loop()
        if self.aclient is None or self.aclient.closed or self.aloop is not loop:
            if self.aclient is not None and self.aloop is loop:
                self.aclient.close()
            self.aclient = await connect_lease_async(
                self.data_url, self.pool.api_key, self.lease_id,
                context=self.pool.context)
            self.aloop = loop
        return self.aclient

    def __getattr__(self, name):
        if name.startswith("_") or not hasattr(DaemonClient, name.removesuffix("_async")):
            raise AttributeError("%s has no operation %r" % (type(self).__name__, name))
        if name.endswith("_async"):
            return self._async_op(name.removesuffix("_async"))

        def call(*args, **kwargs):
            client = self._blocking()
            try:
                return getattr(client, name)(*args, **kwargs)
            except ConnectionLost:
                client.close()
                if self.client is client:
                    self.client = None  # the next call connects again
                raise
        call.__name__ = name
        return call

    def _async_op(self, op: str):
        if op in STREAMS:
            async def stream(*args, **kwargs):
                client = await self._async()
                async for item in getattr(client, op)(*args, **kwargs):
                    yield item
            stream.__name__ = op + "_async"
            return stream

        async def call(*args, **kwargs):
            client = await self._async()
            return await getattr(client, op)(*args, **kwargs)
        call.__name__ = op + "_async"
        return call

    # ---- the lease's own operations (the control plane's), as a SandboxHandle has them
    def pause(self, reclaim: bool = False) -> None:
        """Freeze every process of the sandbox (no CPU; memory kept) until ``resume``;
        calls meanwhile wait."""
        self.pool._request("POST", self._path("pause"), {"reclaim": reclaim})
        self.paused = True

    async def pause_async(self, reclaim: bool = False) -> None:
        await self.pool._request_async("POST", self._path("pause"), {"reclaim": reclaim})
        self.paused = True

    def resume(self) -> None:
        self.pool._request("POST", self._path("resume"), {})
        self.paused = False

    async def resume_async(self) -> None:
        await self.pool._request_async("POST", self._path("resume"), {})
        self.paused = False

    def _path(self, what: str) -> str:
        return "/v1/leases/%s/%s" % (self.lease_id, what)

    def _close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.aclient is not None:
            try:
                self.aclient.close()
            except RuntimeError:  # its loop has closed: cut it from here
                self.aclient.abort()

    def release(self) -> None:
        self._close()
        self.pool.release(self.lease_id)

    async def release_async(self) -> None:
        self._close()
        await self.pool.release_async(self.lease_id)

    def __enter__(self) -> "RemoteSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    async def __aenter__(self) -> "RemoteSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.release_async()


class RemotePool:
    """See ``connect``."""

    def __init__(self, url: str, api_key: str, *, keepalive_s: float = 30.0,
                 context: Optional[ssl.SSLContext] = None, timeout: float = 30.0,
                 route: str = "front"):
        if route not in ("front", "node"):
            raise ValueError("route is 'front' or 'node', got %r" % (route,))
        self.route = route
        parts = service_url(url)
        self.url, self.api_key, self.keepalive_s = url, api_key, keepalive_s
        self.context, self.timeout, self.parts = context, timeout, parts
        self.held: Set[str] = set()  # the leases its thread keeps alive
        self.lock = threading.Lock()
        self.keeper: Optional[threading.Thread] = None
        self.closed = threading.Event()

    # ---- HTTP
    def _connection(self, timeout: float):
        if self.parts.scheme == "https":
            return http.client.HTTPSConnection(
                self.parts.hostname, self.parts.port or 443, timeout=timeout,
                context=self.context or ssl.create_default_context())
        return http.client.HTTPConnection(self.parts.hostname, self.parts.port or 80,
                                          timeout=timeout)

    def _request(self, method: str, path: str, body: Optional[dict] = None,
                 timeout: Optional[float] = None):
        """The answer's JSON (None for 204); the service's refusal as the Python API's
        error; ConnectionLost when the service cannot be reached."""
        conn = self._connection(timeout or self.timeout)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Authorization": "Bearer " + self.api_key,
                                  "Content-Type": "application/json"})
            answer = conn.getresponse()
            data = answer.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ConnectionLost("the service at %s: %s" % (self.url, exc)) from exc
        finally:
            conn.close()
        if answer.status < 300:
            return json.loads(data) if data else None
        raise service_error(answer.status, data, answer.getheader("Retry-After"))

    async def _request_async(self, method: str, path: str, body: Optional[dict] = None,
                             timeout: Optional[float] = None):
        """``_request`` for asyncio."""
        import aiohttp
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                    total=timeout or self.timeout)) as session:
                async with session.request(
                        method, self.url.rstrip("/") + path, json=body,
                        ssl=self.context if self.parts.scheme == "https" else None,
                        headers={"Authorization": "Bearer " + self.api_key}) as answer:
                    data = await answer.read()
                    status, retry_after = answer.status, answer.headers.get("Retry-After")
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ConnectionLost("the service at %s: %s: %s"
                                 % (self.url, type(exc).__name__, exc)) from exc
        if status < 300:
            return json.loads(data) if data else None
        raise service_error(status, data, retry_after)

    # ---- leases
    def acquire(self, spec: Union[SandboxSpec, str, None] = None, *, timeout: float = 60.0,
                keepalive_s: Optional[float] = None, request_id: Optional[str] = None,
                node: Optional[str] = None) -> RemoteSandbox:
        """A sandbox for ``spec`` (an image name, a SandboxSpec; None: the default),
        within ``timeout`` seconds, on ``node`` (a Ray node's id; None: any). A request
        cut before its answer is sent again with the same request id (``request_id``;
        default a new one): the same lease."""
        body = self._acquire_body(spec, timeout, keepalive_s, request_id, node)
        deadline = time.monotonic() + timeout + self.timeout
        while True:
            try:
                return self._held(self._request("POST", "/v1/leases", body,
                                                 timeout=timeout + self.timeout))
            except ConnectionLost:
                if time.monotonic() + RETRY_SLEEP_S > deadline or \
                        self.closed.wait(RETRY_SLEEP_S):  # closed meanwhile: no more tries
                    raise

    async def acquire_async(self, spec: Union[SandboxSpec, str, None] = None, *,
                            timeout: float = 60.0, keepalive_s: Optional[float] = None,
                            request_id: Optional[str] = None,
                            node: Optional[str] = None) -> RemoteSandbox:
        """``acquire`` for asyncio."""
        body = self._acquire_body(spec, timeout, keepalive_s, request_id, node)
        deadline = time.monotonic() + timeout + self.timeout
        while True:
            try:
                return self._held(await self._request_async("POST", "/v1/leases", body,
                                                             timeout=timeout + self.timeout))
            except ConnectionLost:
                if time.monotonic() + RETRY_SLEEP_S > deadline or self.closed.is_set():
                    raise
                await asyncio.sleep(RETRY_SLEEP_S)

    def _acquire_body(self, spec, timeout: float, keepalive_s: Optional[float],
                      request_id: Optional[str], node: Optional[str]) -> dict:
        body = {"timeout_s": timeout, "keepalive_s": keepalive_s or self.keepalive_s,
                "request_id": request_id or uuid.uuid4().hex}
        if node is not None:
            body["node"] = node
        if isinstance(spec, SandboxSpec):
            body["spec"] = spec.to_dict()
        elif spec is not None:
            body["image"] = spec
        return body

    def _held(self, lease: dict) -> RemoteSandbox:
        with self.lock:
            self.held.add(lease["lease_id"])
            self._keep_keeping()
        return RemoteSandbox(self, lease)

    @contextlib.contextmanager
    def sandbox(self, spec: Union[SandboxSpec, str, None] = None, **kwargs):
        sb = self.acquire(spec, **kwargs)
        try:
            yield sb
        finally:
            sb.release()

    @contextlib.asynccontextmanager
    async def sandbox_async(self, spec: Union[SandboxSpec, str, None] = None, **kwargs):
        sb = await self.acquire_async(spec, **kwargs)
        try:
            yield sb
        finally:
            await sb.release_async()

    def release(self, lease_id: str) -> None:
        with self.lock:
            self.held.discard(lease_id)
        try:
            self._request("DELETE", "/v1/leases/%s" % lease_id)
        except (LeaseNotHeld, LeaseEnded):
            pass  # over already

    async def release_async(self, lease_id: str) -> None:
        with self.lock:
            self.held.discard(lease_id)
        try:
            await self._request_async("DELETE", "/v1/leases/%s" % lease_id)
        except (LeaseNotHeld, LeaseEnded):
            pass

    # ---- snapshots and forks
    def snapshot(self, sb: RemoteSandbox, name: Optional[str] = None) -> str:
        """Capture ``sb``'s files as a snapshot of this tenant's; the image that starts
        sandboxes from it (``acquire(image)``), which no other tenant can start."""
        return self._request("POST", sb._path("snapshot"), _named(name))["image"]

    def snapshots(self) -> list:
        """This tenant's snapshots: name, image, size_bytes, created_at, sandboxes."""
        return self._request("GET", "/v1/snapshots")

    def delete_snapshot(self, name: str) -> None:
        """Delete this tenant's snapshot ``name`` (its name, or its image)."""
        if name.startswith("snapshot:"):
            name = next((i["name"] for i in self.snapshots() if i["image"] == name), name)
        self._request("DELETE", "/v1/snapshots/%s" % quote(name, safe=""))

    def fork(self, sb: RemoteSandbox, n: int, timeout: float = 60.0,
             keep_snapshot: bool = False) -> list:
        """``n`` new sandboxes that start from ``sb``'s files, in the working directory
        and with the exported variables of its default session; all or none
        (``sandman_ray.fork``)."""
        return run_to_end(self.fork_async(sb, n, timeout, keep_snapshot))

    async def fork_async(self, sb: RemoteSandbox, n: int, timeout: float = 60.0,
                         keep_snapshot: bool = False) -> list:
        check_count(n)
        state = session_state(await sb.run_async(SESSION_STATE))
        taken = await self._request_async("POST", sb._path("snapshot"),
                                          {"for_fork": not keep_snapshot})
        spec = SandboxSpec.from_dict(dict(taken["spec"], image=taken["image"]))
        return await start_forks(lambda: self.acquire_async(spec, timeout=timeout), n, state,
                                 lambda fork: fork.release_async())

    def leases(self) -> list:
        return self._request("GET", "/v1/leases")

    def status(self) -> dict:
        return self._request("GET", "/v1/status")

    def close(self) -> None:
        """Give back every lease and stop keeping them."""
        self.closed.set()
        for lease_id in list(self.held):
            self.release(lease_id)

    # ---- keepalives
    def _keep_keeping(self) -> None:
        if self.keeper is None or not self.keeper.is_alive():
            self.keeper = threading.Thread(target=self._keep, daemon=True,
                                           name="sandman-keepalive")
            self.keeper.start()

    def _keep(self) -> None:
        while not self.closed.wait(self.keepalive_s / 3):
            with self.lock:
                leases = list(self.held)
            if not leases:
                return
            for first in range(0, len(leases), KEEP_MAX):  # a request per thousand
                try:
                    answer = self._request("POST", "/v1/keepalive",
                                           {"leases": leases[first:first + KEEP_MAX]})
                except SandmanError:
                    continue  # the service is away for now: the next round tries again
                with self.lock:  # those that ended (reclaimed, released elsewhere)
                    self.held.difference_update(answer.get("ended", ()))
