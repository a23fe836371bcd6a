"""The service's control plane over HTTP: routes, their checks and their errors.

Every route but ``/v1/openapi.json`` and ``/v1/healthz`` needs ``Authorization: Bearer
<API key>``. A body is JSON of at most BODY_MAX bytes. Every refusal is a status and
``{"error": {"type": ..., "message": ...}}``, ``type`` naming the error as the Python
API raises it; another tenant's lease answers 404 exactly as one that never existed.

    POST   /v1/leases               acquire: {"image" | "spec", "timeout_s", "keepalive_s",
                                    "request_id", "node"} -> 201 the lease
    GET    /v1/leases               the tenant's leases
    GET    /v1/leases/{id}          one of them
    DELETE /v1/leases/{id}          release -> 204
    POST   /v1/leases/{id}/keepalive -> 204 (every relayed call keeps it too)
    POST   /v1/keepalive            {"leases": [ids]} -> {"kept": n, "ended": [ids]}
    POST   /v1/leases/{id}/pause    {"reclaim"} -> 204: frozen, memory kept
    POST   /v1/leases/{id}/resume   -> 204
    POST   /v1/leases/{id}/snapshot {"name", "for_fork"} -> 201 the snapshot (its
                                    "image" starts sandboxes of it; "spec" a fork's)
    GET    /v1/snapshots            the tenant's snapshots
    DELETE /v1/snapshots/{name}     -> 204
    GET    /v1/leases/{id}/connect  the data plane (relay.py), on the data port
    GET    /v1/status               the tenant's leases and limits, the pool's counts

The routes call a ``core`` (service/host.py's ServiceHost) that holds the leases.
"""

import json
import math
from typing import Optional

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from sandman_ray.errors import (
    AcquireTimeout, LeaseEnded, LeaseNotHeld, ProviderError, SandboxLost, SandmanError,
    SnapshotInUse)
from sandman_ray.service.answers import BODY_MAX, Refusal, read_at_most, tenant_by_key
from sandman_ray.service.e2b.routes import e2b_path as _e2b_which, routes as _e2b_routes
from sandman_ray.spec import SandboxSpec, number_in

TIMEOUT_MAX_S = 600.0
KEEP_MAX = 1000  # lease ids in one keepalive


def error_response(status: int, kind: str, message: str,
                   retry_after: Optional[float] = None) -> web.Response:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
    return web.json_response({"error": {"type": kind, "message": message}}, status=status,
                             headers=headers)


# the errors of the Python API, as statuses
_STATUS = ((AcquireTimeout, 408), (LeaseNotHeld, 404), (LeaseEnded, 410), (SandboxLost, 410),
           (SnapshotInUse, 409))


def app(core, verify) -> web.Application:
    """The control plane's aiohttp application; ``verify(key)``: its tenant or None."""

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except Refusal as no:
            return error_response(no.status, no.kind, no.message, no.retry_after)
        except web.HTTPException as exc:  # aiohttp's own: 404 of a route, 405, 413
            if exc.status < 400:
                raise
            if fusion_path(request.path):
                answer = web.json_response({"detail": exc.reason}, status=exc.status)
            elif e2b_path(request.path):
                answer = web.json_response({"code": exc.status, "message": "%s: %s %s" % (
                    exc.reason, request.method, request.path)}, status=exc.status)
            else:
                answer = error_response(exc.status, type(exc).__name__[4:] or "HTTPError",
                                        exc.reason)
            if "Allow" in exc.headers:  # a 405 says which methods are (RFC 9110)
                answer.headers["Allow"] = exc.headers["Allow"]
            return answer
        except RequestPayloadError as exc:  # a body its Content-Encoding does not unpack
            return error_response(400, "ValidationError", "the body could not be read: %s"
                                  % exc)
        except ProviderError as exc:
            kind = 429 if exc.kind == "transient" else 422
            return error_response(kind, "ProviderError", str(exc),
                                  5.0 if kind == 429 else None)
        except ValueError as exc:  # the pool's word on what was asked
            return error_response(400, "ValidationError", str(exc))
        except SandmanError as exc:
            for cls, status in _STATUS:
                if isinstance(exc, cls):
                    return error_response(status, cls.__name__, str(exc))
            return error_response(422, type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - Ray's word that the pool cannot answer
            if not type(exc).__module__.startswith("ray."):
                raise
            return error_response(503, "PoolUnavailable", "the pool did not answer: %s"
                                  % str(exc).splitlines()[0][:300], 5.0)

    @web.middleware
    async def auth(request, handler):
        if request.path in ("/v1/openapi.json", "/v1/healthz") or fusion_path(request.path) \
                or e2b_path(request.path):
            return await handler(request)  # no key, or another protocol's (its own keys)
        header = request.headers.get("Authorization", "")
        tenant = verify(header[len("Bearer "):]) if header.startswith("Bearer ") else None
        if tenant is None:
            await core.failed_key(request.remote)
            raise Refusal(401, "Unauthorized", "no valid API key (Authorization: Bearer ...)")
        request["tenant"] = tenant
        return await handler(request)

    async def acquire(request):
        body = _fields(await _body(request),
                       {"image", "spec", "timeout_s", "keepalive_s", "request_id", "node"})
        spec = _spec(body)
        timeout_s = _number(body, "timeout_s", 60.0, 0.001, TIMEOUT_MAX_S)
        keepalive_s = _number(body, "keepalive_s", 30.0, 5.0, 3600.0)
        request_id = body.get("request_id")
        if request_id is not None and (not isinstance(request_id, str)
                                       or not 1 <= len(request_id) <= 128):
            raise Refusal(400, "ValidationError", "request_id is a string of 1 to 128 characters")
        node = body.get("node")
        if node is not None and (not isinstance(node, str) or not 1 <= len(node) <= 128):
            raise Refusal(400, "ValidationError", "node is a Ray node's id")
        lease = await core.acquire(request["tenant"], spec, timeout_s, keepalive_s, request_id,
                                   node)
        return web.json_response(lease, status=201)

    async def leases(request):
        return web.json_response(core.leases_of(request["tenant"]))

    async def one(request):
        return web.json_response(core.lease_of(request["tenant"], request.match_info["id"]))

    async def release(request):
        await core.give_back(request["tenant"], request.match_info["id"])
        return web.Response(status=204)

    async def keepalive(request):
        await core.keep(request["tenant"], request.match_info["id"])
        return web.Response(status=204)

    async def keep_many(request):
        body = _fields(await _body(request), {"leases"})
        ids = body.get("leases")
        if not isinstance(ids, list) or len(ids) > KEEP_MAX or \
                not all(isinstance(i, str) and 0 < len(i) <= 64 for i in ids):
            raise Refusal(400, "ValidationError", "leases is a list of at most %d lease ids"
                          % KEEP_MAX)
        return web.json_response(await core.keep_many(request["tenant"], ids))

    async def pause(request):
        body = _fields(await _body(request), {"reclaim"})
        reclaim = body.get("reclaim", False)
        if not isinstance(reclaim, bool):
            raise Refusal(400, "ValidationError", "reclaim is true or false")
        await core.pause(request["tenant"], request.match_info["id"], reclaim)
        return web.Response(status=204)

    async def resume(request):
        _fields(await _body(request), set())
        await core.resume(request["tenant"], request.match_info["id"])
        return web.Response(status=204)

    async def snapshot(request):
        body = _fields(await _body(request), {"name", "for_fork"})
        name, for_fork = body.get("name"), body.get("for_fork", False)
        if name is not None and not isinstance(name, str) or not isinstance(for_fork, bool):
            raise Refusal(400, "ValidationError", "name is a string, for_fork true or false")
        return web.json_response(await core.snapshot(
            request["tenant"], request.match_info["id"], name, for_fork), status=201)

    async def snapshots(request):
        return web.json_response(await core.snapshots_of(request["tenant"]))

    async def delete_snapshot(request):
        await core.delete_snapshot(request["tenant"], request.match_info["name"])
        return web.Response(status=204)

    async def status(request):
        return web.json_response(await core.status_of(request["tenant"]))

    async def openapi(request):
        from sandman_ray.service.openapi import document
        return web.json_response(document())

    async def healthz(request):
        return web.json_response({"ok": True})

    application = web.Application(middlewares=[errors, auth], client_max_size=BODY_MAX)
    application.add_routes(fusion_routes(core, verify))
    application.add_routes(_e2b_routes(core, verify))
    application.add_routes([
        web.post("/v1/leases", acquire), web.get("/v1/leases", leases),
        web.get("/v1/leases/{id}", one), web.delete("/v1/leases/{id}", release),
        web.post("/v1/leases/{id}/keepalive", keepalive), web.get("/v1/status", status),
        web.post("/v1/keepalive", keep_many), web.post("/v1/leases/{id}/pause", pause),
        web.post("/v1/leases/{id}/resume", resume),
        web.post("/v1/leases/{id}/snapshot", snapshot), web.get("/v1/snapshots", snapshots),
        web.delete("/v1/snapshots/{name}", delete_snapshot),
        web.get("/v1/openapi.json", openapi), web.get("/v1/healthz", healthz)])
    return application


FUSION_PATHS = ("/run_code", "/v1/ping")  # SandboxFusion's, with Authorization: Bearer


def e2b_path(path: str) -> bool:
    """Whether ``path`` is one of E2B's routes (service/e2b: its shapes, its keys)."""
    return _e2b_which(path) is not None


def fusion_path(path: str) -> bool:
    """Whether ``path`` is one of SandboxFusion's routes (its own shapes, its own keys)."""
    return path in FUSION_PATHS or path.startswith("/fusion/")


def fusion_routes(core, verify) -> list:
    """SandboxFusion's routes (service/fusion.py): ``/fusion/<API key>/run_code`` and
    ``/fusion/<API key>/v1/ping`` for clients that send no headers of their own, and
    ``/run_code`` and ``/v1/ping`` with ``Authorization: Bearer``. Every refusal is in
    SandboxFusion's shape, ``{"detail": ...}``."""
    from sandman_ray.service import fusion

    def refused(status: int, detail) -> web.Response:
        return web.json_response({"detail": detail}, status=status)

    async def tenant_of(request) -> Optional[str]:
        return await tenant_by_key(core, verify, request, request.match_info.get("key"))

    async def ping(request):
        if await tenant_of(request) is None:
            return refused(401, "no valid API key")
        return web.Response(text="pong")

    async def run_code(request):
        tenant = await tenant_of(request)
        if tenant is None:
            return refused(401, "no valid API key")
        if request.content_length is not None and request.content_length > fusion.REQUEST_MAX:
            return refused(413, "a request is at most %d bytes" % fusion.REQUEST_MAX)
        data = await read_at_most(request, fusion.REQUEST_MAX)
        if len(data) > fusion.REQUEST_MAX:
            return refused(413, "a request is at most %d bytes" % fusion.REQUEST_MAX)
        try:
            asked = fusion.parse(json.loads(data))
        except (ValueError, UnicodeDecodeError):
            return refused(422, [{"loc": ["body"], "msg": "not JSON", "type": "json_invalid"}])
        except fusion.Invalid as no:
            return refused(no.status, no.detail)
        try:
            return web.json_response(await core.run_code(tenant, asked))
        except Refusal as no:
            return refused(no.status, no.message)
        except SandmanError as exc:  # no sandbox for it: the pool's word
            return web.json_response(fusion.answer("SandboxError", "%s: %s" % (
                type(exc).__name__, exc)))

    return [web.post("/fusion/{key}/run_code", run_code), web.get("/fusion/{key}/v1/ping", ping),
            web.post(FUSION_PATHS[0], run_code), web.get(FUSION_PATHS[1], ping)]


async def _body(request) -> dict:
    if request.content_length is not None and request.content_length > BODY_MAX:
        raise Refusal(413, "PayloadTooLarge", "a body is at most %d bytes" % BODY_MAX)
    try:
        body = json.loads(await request.read() or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise Refusal(400, "ValidationError", "the body is not JSON") from None
    if not isinstance(body, dict):
        raise Refusal(400, "ValidationError", "the body is a JSON object")
    return body


def _fields(body: dict, known: set) -> dict:
    unknown = set(body) - known
    if unknown:
        raise Refusal(400, "ValidationError", "unknown fields: %s" % ", ".join(sorted(unknown)))
    return body


def _spec(body: dict) -> SandboxSpec:
    if "spec" in body and "image" in body:
        raise Refusal(400, "ValidationError", "give image or spec, not both")
    try:
        if "spec" in body:
            if not isinstance(body["spec"], dict):
                raise ValueError("spec is a JSON object of SandboxSpec's fields")
            return SandboxSpec.from_dict(body["spec"])
        image = body.get("image")
        if image is not None and not isinstance(image, str):
            raise ValueError("image is a string")
        return SandboxSpec(image=image) if image else SandboxSpec()
    except (TypeError, ValueError) as exc:
        raise Refusal(400, "ValidationError", str(exc)) from None


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if not number_in(value, low, high):
        raise Refusal(400, "ValidationError", "%s is a number of seconds from %g to %g"
                      % (name, low, high))
    return float(value)
