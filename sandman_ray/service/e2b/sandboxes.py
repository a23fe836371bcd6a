"""E2B's sandboxes on the service's leases: what E2B's control plane asks (create, list,
get, kill, set a timeout, connect, pause and resume, fork and snapshots) done with the
service's own acquire, release, pause, resume and snapshots, and the state E2B adds to
a lease (its template, metadata, environment variables, end time and envd access
token).

An E2B sandbox is a lease of its tenant on the service's node, named by the lease's id.
It ends at its end time (its ``timeout`` from its creation or last ``set_timeout``):
until then the service keeps its lease alive; after, it gives it back. A service that
dies stops keeping it, and the pool reclaims it within KEEPALIVE_S.
"""

import asyncio
import datetime
import hmac
import os
import secrets
import time
from typing import Dict, Optional

from sandman_ray import touches
from sandman_ray.service.answers import Refusal
from sandman_ray.spec import SandboxSpec, parse_bytes

# The envd version a create answers: the SDK turns on the features of every version up
# to it (e2b's envd/versions.py), which are the features served here: recursive watch
# (0.1.4), stdin of commands (0.3.0), a default user (0.4.0), octet-stream uploads
# (0.5.7). File metadata (0.6.2, extended attributes) is not served.
ENVD_VERSION = "0.5.7"
KEEPALIVE_S = 30.0  # the lease's keepalive; the service renews it while the sandbox lives
RENEW_EVERY_S = 10.0
TIMEOUT_DEFAULT_S = 300  # E2B's, when a create names none
TIMEOUT_MAX_S = 24 * 3600
CREATE_WAIT_S = 120.0  # how long a create waits for a sandbox
TEMPLATES = {"base": "builtin:code"}  # E2B template -> image (``--e2b-template``)
USER = "user"  # E2B's default user; the sandboxes of its templates run as it
USER_SPEC = dict(user="1000:1000", workdir="/home/user")
METADATA_MAX = 64  # entries of a sandbox's metadata or environment
FORKS_MAX = 20  # sandboxes one fork makes, at most (E2B's bound)


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.timezone.utc).isoformat().replace(
        "+00:00", "Z")


def _strings(body: dict, name: str) -> Dict[str, str]:
    value = body.get(name) or {}
    if not isinstance(value, dict) or len(value) > METADATA_MAX or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 256 and len(v) <= 4096
            for k, v in value.items()):
        raise Refusal(400, "", "%s is an object of at most %d string values" % (name, METADATA_MAX))
    return dict(value)


def _timeout(body: dict, default: Optional[int] = TIMEOUT_DEFAULT_S) -> Optional[int]:
    value = body.get("timeout", default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= TIMEOUT_MAX_S:
        raise Refusal(400, "", "timeout is a whole number of seconds from 0 to %d" % TIMEOUT_MAX_S)
    return value


class Sandbox:
    """One E2B sandbox: its lease and what E2B adds to it."""

    def __init__(self, tenant: str, lease_id: str, lease, template: str, spec: SandboxSpec,
                 metadata: Dict[str, str], envs: Dict[str, str], timeout_s: int):
        self.tenant, self.lease_id, self.lease = tenant, lease_id, lease
        self.id = lease_id[2:]
        self.template, self.spec, self.metadata, self.envs = template, spec, metadata, envs
        self.token = secrets.token_urlsafe(24)  # envd's X-Access-Token
        self.started = time.time()
        self.end = self.started + timeout_s
        self.paused = False
        self.renewed = 0.0  # when its lease was last kept alive
        self.client = None  # the daemon, once a call needs it (envd.py)
        self.connecting: Optional[asyncio.Future] = None
        self.procs: Dict[int, dict] = {}  # pid -> what envd's List tells of it (processes.py)
        self.watchers: Dict[str, object] = {}  # id -> a polled watch (files.py)

    def answer(self) -> dict:
        """E2B's ``Sandbox``: what a create or a connect answers."""
        return {"templateID": self.template, "sandboxID": self.id, "clientID": "sandman",
                "envdVersion": ENVD_VERSION, "envdAccessToken": self.token}

    def listed(self) -> dict:
        """E2B's ``ListedSandbox``."""
        cpu = self.spec.cpu or os.cpu_count() or 1
        memory = parse_bytes(self.spec.memory)
        return {"templateID": self.template, "sandboxID": self.id, "clientID": "sandman",
                "startedAt": _iso(self.started), "endAt": _iso(self.end),
                "cpuCount": max(1, int(cpu)), "memoryMB": int((memory or 0) // (1 << 20)),
                "diskSizeMB": 0, "state": "paused" if self.paused else "running",
                "envdVersion": ENVD_VERSION, "metadata": self.metadata}

    def detail(self) -> dict:
        """E2B's ``SandboxDetail``."""
        return dict(self.listed(), envdAccessToken=self.token,
                    allowInternetAccess=self.spec.network)

    def token_is(self, token: Optional[str]) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())


class Sandboxes:
    """The service's E2B sandboxes (a part of its ServiceHost, ``host``)."""

    def __init__(self, host, templates: Optional[Dict[str, str]] = None):
        self.host = host
        self.templates = dict(TEMPLATES, **(templates or {}))
        self.by_id: Dict[str, Sandbox] = {}
        self.snapshot_sources: Dict[str, str] = {}  # snapshot -> the sandbox it was of
        self.renewer = asyncio.ensure_future(self._renew())

    def close(self) -> None:
        self.renewer.cancel()
        for box in self.by_id.values():
            if box.client is not None:
                box.client.close()

    # ---- the control plane
    async def create(self, tenant: str, body: dict, request_id: Optional[str]) -> Sandbox:
        known = {"templateID", "timeout", "metadata", "envVars", "allowInternetAccess",
                 "autoPause", "autoPauseMemory", "autoResume", "secure", "network", "mcp",
                 "iam", "volumeMounts"}
        unknown = set(body) - known
        if unknown:
            raise Refusal(400, "", "unknown fields: %s" % ", ".join(sorted(unknown)))
        for name, what in (("mcp", "MCP servers"), ("iam", "IAM tokens"),
                           ("volumeMounts", "volumes"), ("network", "network rules")):
            if body.get(name):
                raise Refusal(400, "", "%s are not served by sandman (field %s)" % (what, name))
        if body.get("autoPause") or body.get("autoResume"):
            raise Refusal(400, "", "auto-pause and auto-resume are not served by sandman: "
                          "pause and connect explicitly")
        template = body.get("templateID")
        image = self.templates.get(template) if isinstance(template, str) else None
        if image is None and isinstance(template, str):  # or one of the tenant's snapshots
            image = next((s["image"] for s in await self.host.snapshots_of(tenant)
                          if s["name"] == template), None)
        if image is None:
            raise Refusal(404, "", "template %r not found: this service serves %s, and the "
                          "tenant's snapshots" % (template, ", ".join(sorted(self.templates))))
        network = body.get("allowInternetAccess")
        if network is not None and not isinstance(network, bool):
            raise Refusal(400, "", "allowInternetAccess is true or false")
        return await self._start(tenant, template, image, _strings(body, "metadata"),
                                 _strings(body, "envVars"), _timeout(body), bool(network),
                                 request_id)

    async def _start(self, tenant: str, template: str, image: str, metadata: Dict[str, str],
                     envs: Dict[str, str], timeout_s: int, network: bool,
                     request_id: Optional[str] = None) -> Sandbox:
        spec = SandboxSpec(image=image, network=network, **USER_SPEC)
        lease = await self.host.acquire(tenant, spec, CREATE_WAIT_S, KEEPALIVE_S, request_id,
                                        self.host.node)
        box = self.by_id.get(lease["lease_id"][2:])
        if box is not None:  # a retry with the same idempotency key
            return box
        served = self.host.served.get(lease["lease_id"])
        if served is None:
            raise Refusal(502, "", "the sandbox was reclaimed before it was answered")
        box = Sandbox(tenant, lease["lease_id"], served[1], template, spec, metadata, envs,
                      timeout_s)
        self.by_id[box.id] = box
        return box

    async def fork(self, tenant: str, sandbox_id: str, body: dict) -> list:
        """``count`` new sandboxes (1 to FORKS_MAX) of the sandbox's files as they are
        now, each with its template's name, metadata and environment: E2B's fork
        results, each a sandbox or an error. Memory is not carried: a fork starts
        afresh from the files, its processes not running."""
        box = self.mine(tenant, sandbox_id)
        count = body.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= FORKS_MAX:
            raise Refusal(400, "", "count is a whole number from 1 to %d" % FORKS_MAX)
        timeout_s = _timeout(body)
        info = await self.host.snapshot(tenant, box.lease_id, None, True)
        started = await asyncio.gather(*(
            self._start(tenant, box.template, info["image"], box.metadata, box.envs,
                        timeout_s, box.spec.network) for _ in range(count)),
            return_exceptions=True)
        if not any(isinstance(result, Sandbox) for result in started):
            try:  # no fork started: its snapshot would wait for one for good
                await self.host.delete_snapshot(tenant, info["name"])
            except Exception:  # noqa: BLE001 - the pool's word; the forks' errors say why
                pass
        out = []
        for result in started:
            if isinstance(result, Sandbox):
                out.append({"sandbox": result.answer()})
            elif isinstance(result, Refusal):
                out.append({"error": {"code": result.status, "message": result.message}})
            else:
                out.append({"error": {"code": 500, "message": "%s: %s" % (
                    type(result).__name__, result)}})
        return out

    async def snapshot(self, tenant: str, sandbox_id: str, body: dict) -> dict:
        """A snapshot of the sandbox's files (E2B's ``SnapshotInfo``), which creates
        name as their template; memory is not kept (E2B's ``filesystem`` mode)."""
        box = self.mine(tenant, sandbox_id)
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise Refusal(400, "", "name is a string")
        info = await self.host.snapshot(tenant, box.lease_id, name, False)
        self.snapshot_sources[info["name"]] = box.id
        return {"snapshotID": info["name"], "names": [info["name"]]}

    async def snapshots(self, tenant: str, sandbox_id: Optional[str],
                        name: Optional[str]) -> list:
        return [{"snapshotID": s["name"], "names": [s["name"]]}
                for s in await self.host.snapshots_of(tenant)
                if not s.get("for_fork") and name in (None, s["name"]) and
                sandbox_id in (None, self.snapshot_sources.get(s["name"]))]

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None:
        await self.host.delete_snapshot(tenant, snapshot_id)
        self.snapshot_sources.pop(snapshot_id, None)

    def mine(self, tenant: str, sandbox_id: str) -> Sandbox:
        box = self.by_id.get(sandbox_id)
        if box is None or box.tenant != tenant:
            raise Refusal(404, "", "sandbox %s not found" % sandbox_id)
        return box

    def listed(self, tenant: str, metadata: Dict[str, str], states) -> list:
        boxes = [b for b in self.by_id.values() if b.tenant == tenant and all(
            b.metadata.get(k) == v for k, v in metadata.items())]
        return [b.listed() for b in sorted(boxes, key=lambda b: b.started)
                if ("paused" if b.paused else "running") in states]

    async def kill(self, tenant: str, sandbox_id: str) -> None:
        box = self.mine(tenant, sandbox_id)
        await self.host.give_back(tenant, box.lease_id)

    async def set_timeout(self, tenant: str, sandbox_id: str, body: dict) -> None:
        box = self.mine(tenant, sandbox_id)
        timeout_s = _timeout(body, None)
        if timeout_s is None:
            raise Refusal(400, "", "timeout is a whole number of seconds from 0 to %d"
                          % TIMEOUT_MAX_S)
        box.end = time.time() + timeout_s

    async def pause(self, tenant: str, sandbox_id: str) -> None:
        box = self.mine(tenant, sandbox_id)
        if box.paused:
            raise Refusal(409, "", "sandbox %s is already paused" % sandbox_id)
        await self.host.pause(tenant, box.lease_id, False)
        box.paused = True

    async def resume(self, tenant: str, sandbox_id: str, body: dict,
                     running_is_fine: bool) -> Sandbox:
        box = self.mine(tenant, sandbox_id)
        timeout_s = _timeout(body, None)
        if box.paused:
            await self.host.resume(tenant, box.lease_id)
            box.paused = False
        elif not running_is_fine:
            raise Refusal(409, "", "sandbox %s is already running" % sandbox_id)
        if timeout_s is not None:  # a connect extends, never shortens
            box.end = max(box.end, time.time() + timeout_s)
        return box

    # ---- the data plane's (envd.py)
    def for_envd(self, sandbox_id: Optional[str], token: Optional[str]) -> Sandbox:
        box = self.by_id.get(sandbox_id or "")
        if box is None or not box.token_is(token):
            raise LookupError("sandbox %s was not found (or not with this access token)"
                              % sandbox_id)
        return box

    async def client_of(self, box: Sandbox):
        """The sandbox's daemon, connected once (its first envd call)."""
        if box.client is not None and not box.client.closed:
            return box.client
        if box.client is not None:  # its connection was lost: a new one
            box.client, box.connecting = None, None
        if box.connecting is None:
            from sandman_ray.client.aio import AsyncDaemonClient
            box.connecting = asyncio.ensure_future(AsyncDaemonClient.connect(
                box.lease.address, box.lease.token, hello_first=False))
        connecting = box.connecting
        try:
            client = await asyncio.shield(connecting)
        except BaseException:
            if box.connecting is connecting and connecting.done():
                box.connecting = None  # the next call tries again
            raise
        if box.client is None:
            box.client = client
        return box.client

    # ---- the pool's word and the clock
    def ended(self, lease_id: str) -> None:
        """The lease ended (given back, reclaimed, or at its end time)."""
        box = self.by_id.pop(lease_id[2:], None)
        if box is None:
            return
        for watch in box.watchers.values():
            if watch is not None:
                watch.stop()
        if box.client is not None:
            box.client.close()

    async def _renew(self) -> None:
        """Keep live sandboxes' leases; give back those past their end time."""
        while True:
            await asyncio.sleep(RENEW_EVERY_S / 10)
            now = time.time()
            for box in list(self.by_id.values()):
                if box.end <= now and not box.paused:
                    try:
                        await self.host.release(box.lease_id, self.host.pool)
                    except Exception:  # noqa: BLE001 - the pool's keepalive ends it anyway
                        pass
                    self.ended(box.lease_id)
                elif now - box.renewed >= RENEW_EVERY_S:
                    box.renewed = now
                    touches.note(self.host._pool(self.host.pool), box.lease_id, self.host.name)
