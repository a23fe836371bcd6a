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

import contextlib
import http.client
import json
import ssl
import threading
import time
import uuid
from typing import Optional, Set, Union

from sandman_ray.errors import ConnectionLost, LeaseEnded, LeaseNotHeld, SandmanError
from sandman_ray.remote.channel import connect_lease, service_error, service_url
from sandman_ray.spec import SandboxSpec

RETRY_SLEEP_S = 0.5  # between the tries of a request whose connection failed


def connect(url: str, api_key: str, *, keepalive_s: float = 30.0,
            context: Optional[ssl.SSLContext] = None) -> "RemotePool":
    """The pool that the service at ``url`` serves, for the tenant of ``api_key``."""
    return RemotePool(url, api_key, keepalive_s=keepalive_s, context=context)


class RemoteSandbox:
    """A leased sandbox of a service: every operation of ``DaemonClient`` (``exec``,
    ``run``, ``write_file``, ``read_file``, ``spawn``...), over the data plane;
    ``release()`` gives it back (also on leaving a ``with`` block). A call whose
    connection broke raises ConnectionLost, as a direct one does; the next call
    connects again (the service restarted: the lease is still this client's)."""

    def __init__(self, pool: "RemotePool", lease: dict):
        self.pool, self.lease = pool, lease
        self.lease_id, self.sandbox_id = lease["lease_id"], lease["sandbox_id"]
        self.node_id = lease.get("node_id")
        self.client = self._connect()
        self.broken = False

    def _connect(self):
        return connect_lease(self.lease["data_url"], self.pool.api_key, self.lease_id,
                             context=self.pool.context)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if not callable(getattr(self.client, name)):
            return getattr(self.client, name)

        def call(*args, **kwargs):
            if self.broken:
                self.client.close()
                self.client, self.broken = self._connect(), False
            try:
                return getattr(self.client, name)(*args, **kwargs)
            except ConnectionLost:
                self.broken = True
                raise
        call.__name__ = name
        return call

    def release(self) -> None:
        self.client.close()
        self.pool.release(self.lease_id)

    def __enter__(self) -> "RemoteSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RemotePool:
    """See ``connect``."""

    def __init__(self, url: str, api_key: str, *, keepalive_s: float = 30.0,
                 context: Optional[ssl.SSLContext] = None, timeout: float = 30.0):
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

    # ---- leases
    def acquire(self, spec: Union[SandboxSpec, str, None] = None, *, timeout: float = 60.0,
                keepalive_s: Optional[float] = None,
                request_id: Optional[str] = None) -> RemoteSandbox:
        """A sandbox for ``spec`` (an image name, a SandboxSpec; None: the default),
        within ``timeout`` seconds."""
        body = {"timeout_s": timeout, "keepalive_s": keepalive_s or self.keepalive_s,
                "request_id": request_id or uuid.uuid4().hex}
        if isinstance(spec, SandboxSpec):
            body["spec"] = spec.to_dict()
        elif spec is not None:
            body["image"] = spec
        deadline = time.monotonic() + timeout + self.timeout
        while True:
            try:
                lease = self._request("POST", "/v1/leases", body, timeout=timeout + self.timeout)
                break
            except ConnectionLost:  # asked again with the same request id: the same lease
                if time.monotonic() + RETRY_SLEEP_S > deadline or \
                        self.closed.wait(RETRY_SLEEP_S):  # closed meanwhile: no more tries
                    raise
        with self.lock:
            self.held.add(lease["lease_id"])
            self._keep_keeping()
        try:
            return RemoteSandbox(self, lease)
        except BaseException:
            self.release(lease["lease_id"])
            raise

    @contextlib.contextmanager
    def sandbox(self, spec: Union[SandboxSpec, str, None] = None, **kwargs):
        sb = self.acquire(spec, **kwargs)
        try:
            yield sb
        finally:
            sb.release()

    def release(self, lease_id: str) -> None:
        with self.lock:
            self.held.discard(lease_id)
        try:
            self._request("DELETE", "/v1/leases/%s" % lease_id)
        except (LeaseNotHeld, LeaseEnded):
            pass  # over already

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
            for lease_id in leases:
                try:
                    self._request("POST", "/v1/leases/%s/keepalive" % lease_id)
                except (LeaseEnded, LeaseNotHeld):
                    with self.lock:
                        self.held.discard(lease_id)
                except SandmanError:
                    continue  # the service is away for now: the next round tries again
