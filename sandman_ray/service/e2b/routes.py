"""E2B's control plane over HTTP, as its SDK calls it (``E2B_API_URL`` pointed at the
service), with an API key of the service in ``X-API-KEY``. Every refusal is in E2B's
shape, ``{"code": <status>, "message": ...}``.

    POST   /sandboxes, /v2/sandboxes         create {templateID, timeout, metadata,
                                             envVars, allowInternetAccess} -> 201
    GET    /sandboxes, /v2/sandboxes         list (metadata=k%3Dv&..., state=running,paused)
    GET    /sandboxes/{id}                   its detail
    DELETE /sandboxes/{id}                   kill -> 204
    POST   /sandboxes/{id}/timeout           {timeout} -> 204: it ends that long from now
    POST   /sandboxes/{id}/pause             -> 204
    POST   /sandboxes/{id}/resume            {timeout} -> 201
    POST   /sandboxes/{id}/connect, /v2/...  {timeout} -> 200, or 201 when it was resumed
    POST   /sandboxes/{id}/fork              {timeout, count} -> 201 [{sandbox} | {error}]
    POST   /sandboxes/{id}/snapshots         {name} -> 201 {snapshotID, names}
    GET    /snapshots                        the tenant's (sandboxID=, name=)
    DELETE /templates/{snapshot id}          -> 204 (the SDK deletes a snapshot so)

A snapshot's id is a template of its tenant's creates. Forks and snapshots keep files,
not memory. Template builds, volumes, secrets, logs, metrics and network rules are not
served: they answer 501 naming what was asked.
"""

import json
import urllib.parse
from typing import Optional

from aiohttp import web

from sandman_ray.errors import ProviderError, SandmanError, SnapshotInUse
from sandman_ray.service.e2b import envd
from sandman_ray.service.e2b.files import Files
from sandman_ray.service.e2b.processes import Processes
from sandman_ray.service.answers import BODY_MAX, Refusal, read_at_most, tenant_by_key

CONTROL_PREFIXES = ("/sandboxes", "/v2/", "/v3/", "/templates", "/volumes", "/secrets",
                    "/snapshots", "/default-templates", "/teams")
ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
ENVD_PATHS = ("/files", "/health")
NOT_SERVED = (("/templates", "template builds"), ("/v2/templates", "template builds"),
              ("/v3/templates", "template builds"), ("/default-templates", "templates"),
              ("/volumes", "volumes"), ("/secrets", "secrets"),
              ("/teams", "teams"))
SANDBOX_NOT_SERVED = (("logs", "logs"),
                      ("metrics", "metrics"), ("network", "network rules"),
                      ("refreshes", "refreshes (use timeout)"))


def e2b_path(path: str) -> Optional[str]:
    """"control" or "envd" for E2B's paths, else None."""
    if path.startswith(ENVD_PREFIXES) or path in ENVD_PATHS:
        return "envd"
    if path.startswith(CONTROL_PREFIXES):
        return "control"
    return None


def error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


class Late:
    """``core.e2b``, looked up at each use (routes are made before the core starts)."""

    def __init__(self, core):
        self.core = core

    def __getattr__(self, name):
        return getattr(self.core.e2b, name)


def routes(core, verify) -> list:
    """The control plane's routes and envd's (``core``: the ServiceHost, whose
    ``e2b`` holds the sandboxes)."""
    sandboxes = Late(core)

    async def tenant_of(request) -> str:
        tenant = await tenant_by_key(core, verify, request, request.headers.get("X-API-KEY"))
        if tenant is None:
            raise Refusal(401, "", "Invalid API key: give a key of the service in X-API-KEY")
        return tenant

    def answering(handler):
        async def answer(request):
            try:
                return await handler(request, await tenant_of(request))
            except Refusal as no:
                return error(no.status, no.message)
            except ValueError as exc:  # the pool's word on what was asked
                return error(400, str(exc))
            except ProviderError as exc:
                return error(429 if exc.kind == "transient" else 422, str(exc))
            except SnapshotInUse as exc:
                return error(409, str(exc))
            except SandmanError as exc:
                return error(422, "%s: %s" % (type(exc).__name__, exc))
        return answer

    async def body_of(request) -> dict:
        data = await read_at_most(request, BODY_MAX)
        if len(data) > BODY_MAX:
            raise Refusal(413, "", "a body is at most %d bytes" % BODY_MAX)
        try:
            body = json.loads(data or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise Refusal(400, "", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise Refusal(400, "", "the body is a JSON object")
        return body

    @answering
    async def create(request, tenant):
        box = await sandboxes.create(tenant, await body_of(request),
                                     request.headers.get("Idempotency-Key"))
        return web.json_response(box.answer(), status=201)

    @answering
    async def listed(request, tenant):
        metadata = {}
        if request.query.get("metadata"):
            metadata = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in
                        urllib.parse.parse_qsl(request.query["metadata"], keep_blank_values=True)}
        states = request.query.get("state", "running,paused").split(",")
        if request.path == "/sandboxes":  # the first version lists running ones
            states = ["running"]
        return web.json_response(sandboxes.listed(tenant, metadata, states))

    @answering
    async def one(request, tenant):
        return web.json_response(sandboxes.mine(tenant, request.match_info["id"]).detail())

    def no_content(action):
        """A route that does ``action(tenant, sandbox id, body)`` and answers 204."""
        @answering
        async def done(request, tenant):
            await action(tenant, request.match_info["id"], await body_of(request))
            return web.Response(status=204)
        return done

    kill = no_content(lambda tenant, sandbox_id, _: sandboxes.kill(tenant, sandbox_id))
    timeout = no_content(lambda *args: sandboxes.set_timeout(*args))
    pause = no_content(lambda tenant, sandbox_id, _: sandboxes.pause(tenant, sandbox_id))

    @answering
    async def resume(request, tenant):
        box = await sandboxes.resume(tenant, request.match_info["id"], await body_of(request),
                                     running_is_fine=False)
        return web.json_response(box.answer(), status=201)

    @answering
    async def connect(request, tenant):
        box = sandboxes.mine(tenant, request.match_info["id"])
        was_paused = box.paused
        box = await sandboxes.resume(tenant, box.id, await body_of(request),
                                     running_is_fine=True)
        return web.json_response(box.answer(), status=201 if was_paused else 200)

    @answering
    async def fork(request, tenant):
        return web.json_response(await sandboxes.fork(tenant, request.match_info["id"],
                                                      await body_of(request)), status=201)

    @answering
    async def snapshot(request, tenant):
        return web.json_response(await sandboxes.snapshot(
            tenant, request.match_info["id"], await body_of(request)), status=201)

    @answering
    async def snapshots(request, tenant):
        return web.json_response(await sandboxes.snapshots(
            tenant, request.query.get("sandboxID"), request.query.get("name")))

    @answering
    async def delete_snapshot(request, tenant):
        """The SDK deletes a snapshot as the template it is."""
        try:
            await sandboxes.delete_snapshot(tenant, request.match_info["id"])
        except Refusal as no:
            if no.status != 404:
                raise
            return error(404, "snapshot %s not found (template deletion is not served by "
                         "sandman)" % request.match_info["id"])
        return web.Response(status=204)

    def refusing(what: str):
        @answering
        async def refuse(request, tenant):
            return error(501, "%s are not served by sandman (%s %s)" % (
                what, request.method, request.path))
        return refuse

    served = [web.post("/sandboxes", create), web.post("/v2/sandboxes", create),
              web.get("/sandboxes", listed), web.get("/v2/sandboxes", listed),
              web.get("/sandboxes/{id}", one), web.delete("/sandboxes/{id}", kill),
              web.post("/sandboxes/{id}/timeout", timeout),
              web.post("/sandboxes/{id}/pause", pause),
              web.post("/sandboxes/{id}/resume", resume),
              web.post("/sandboxes/{id}/connect", connect),
              web.post("/v2/sandboxes/{id}/connect", connect),
              web.post("/sandboxes/{id}/fork", fork),
              web.post("/sandboxes/{id}/snapshots", snapshot),
              web.get("/snapshots", snapshots), web.delete("/templates/{id}", delete_snapshot)]
    for tail, what in SANDBOX_NOT_SERVED:
        served.append(web.route("*", "/sandboxes/{id}/%s{rest:.*}" % tail, refusing(what)))
        served.append(web.route("*", "/v2/sandboxes/{id}/%s{rest:.*}" % tail, refusing(what)))
    for prefix, what in NOT_SERVED:
        served.append(web.route("*", prefix + "{rest:.*}", refusing(what)))
    return (served + Processes(sandboxes).routes() + Files(sandboxes).routes() +
            [web.get("/health", envd.health(sandboxes))])
