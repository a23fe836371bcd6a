"""The OpenAPI 3.1 document of the service's control plane (service/http.py), served at
``/v1/openapi.json``; ``tests/test_service.py`` checks it against the routes."""

from sandman_ray.spec import SandboxSpec

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["type", "message"],
    "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
_LEASE = {"type": "object", "required": ["lease_id", "sandbox_id", "connect", "keepalive_s"],
          "properties": {"lease_id": {"type": "string"}, "sandbox_id": {"type": "string"},
                         "node_id": {"type": ["string", "null"]}, "pool": {"type": "string"},
                         "keepalive_s": {"type": "number"}, "leased_at": {"type": "number"},
                         "data_url": {"type": "string", "description":
                                      "the service's data plane (the front): it reaches "
                                      "every lease, relaying onward to its node"},
                         "gateway_url": {"type": ["string", "null"], "description":
                                         "the data plane of the lease's node: one hop "
                                         "less, for clients that reach the nodes"},
                         "connect": {"type": "string", "description":
                                     "the data plane's path on the data URL: GET with "
                                     "Upgrade: sandman-daemon/2"}}}


def _errors(*statuses) -> dict:
    return {str(s): {"description": "an error", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for s in statuses}


_FIELDS = {  # SandboxSpec's fields as JSON; the server checks the rest (spec.py)
    "image": {"type": "string"}, "cpu": {"type": ["number", "null"], "exclusiveMinimum": 0},
    "memory": {"type": ["string", "integer", "null"]}, "pids": {"type": ["integer", "null"]},
    "disk": {"type": ["string", "integer", "null"]},
    "env": {"type": "object", "additionalProperties": {"type": "string"}},
    "workdir": {"type": ["string", "null"]}, "network": {"type": "boolean"},
    "network_allow": {"type": "array", "items": {"type": "string"}},
    "user": {"type": ["string", "null"]}, "ttl_s": {"type": ["number", "null"]},
    "idle_timeout_s": {"type": ["number", "null"]},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "capabilities": {"type": "array", "items": {"type": "string"}},
    "ptys": {"type": "integer"}, "nofile": {"type": ["integer", "null"]}}


def _spec_schema() -> dict:
    fields = SandboxSpec.__dataclass_fields__
    return {"type": "object", "additionalProperties": False,
            "description": "SandboxSpec's fields (sandman_ray.spec)",
            "properties": {name: _FIELDS.get(name, {}) for name in fields}}


_object = {"application/json": {"schema": {"type": "object"}}}


def _body(properties: dict) -> dict:
    return {"content": {"application/json": {"schema": {
        "type": "object", "additionalProperties": False, "properties": properties}}}}


def document() -> dict:
    lease_id = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    json_lease = {"application/json": {"schema": {"$ref": "#/components/schemas/Lease"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "sandman service", "version": "1"},
        "components": {
            "securitySchemes": {"key": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": _ERROR, "Lease": _LEASE, "SandboxSpec": _spec_schema()}},
        "security": [{"key": []}],
        "paths": {
            "/v1/leases": {
                "post": {"summary": "acquire a sandbox", "requestBody": {"content": {
                    "application/json": {"schema": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "image": {"type": "string"},
                            "spec": {"$ref": "#/components/schemas/SandboxSpec"},
                            "timeout_s": {"type": "number", "minimum": 0.001,
                                          "maximum": 600},
                            "keepalive_s": {"type": "number", "minimum": 5, "maximum": 3600},
                            "request_id": {"type": "string", "minLength": 1,
                                           "maxLength": 128},
                            "node": {"type": "string", "minLength": 1, "maxLength": 128,
                                     "description": "a Ray node's id: the lease is "
                                     "placed there (default: any node)"}}}}}},
                         "responses": dict({"201": {"description": "the lease",
                                                    "content": json_lease}},
                                           **_errors(400, 401, 403, 408, 413, 422, 429, 503))},
                "get": {"summary": "the tenant's leases", "responses": dict(
                    {"200": {"description": "leases", "content": {"application/json": {
                        "schema": {"type": "array",
                                   "items": {"$ref": "#/components/schemas/Lease"}}}}}},
                    **_errors(401))}},
            "/v1/leases/{id}": {
                "get": {"summary": "one lease", "parameters": [lease_id], "responses": dict(
                    {"200": {"description": "the lease", "content": json_lease}},
                    **_errors(401, 404, 410))},
                "delete": {"summary": "release", "parameters": [lease_id], "responses": dict(
                    {"204": {"description": "released"}}, **_errors(401, 404, 410))}},
            "/v1/leases/{id}/keepalive": {
                "post": {"summary": "keep a lease alive", "parameters": [lease_id],
                         "responses": dict({"204": {"description": "kept"}},
                                           **_errors(401, 404, 410, 503))}},
            "/v1/keepalive": {
                "post": {"summary": "keep many leases alive", "requestBody": {"content": {
                    "application/json": {"schema": {
                        "type": "object", "additionalProperties": False, "required": ["leases"],
                        "properties": {"leases": {"type": "array", "maxItems": 1000,
                                                  "items": {"type": "string", "minLength": 1,
                                                            "maxLength": 64}}}}}}},
                         "responses": dict({"200": {"description": "how many were kept, and "
                                                    "the ids that are not the tenant's leases",
                                                    "content": _object}},
                                           **_errors(400, 401, 413, 503))}},
            "/v1/leases/{id}/pause": {
                "post": {"summary": "freeze the lease's sandbox (memory kept)",
                         "parameters": [lease_id], "requestBody": _body({
                             "reclaim": {"type": "boolean"}}),
                         "responses": dict({"204": {"description": "paused"}},
                                           **_errors(400, 401, 404, 410, 422, 503))}},
            "/v1/leases/{id}/resume": {
                "post": {"summary": "let a paused sandbox run again", "parameters": [lease_id],
                         "requestBody": _body({}),
                         "responses": dict({"204": {"description": "running"}},
                                           **_errors(400, 401, 404, 410, 503))}},
            "/v1/leases/{id}/snapshot": {
                "post": {"summary": "the lease's files as a snapshot of the tenant's",
                         "parameters": [lease_id], "requestBody": _body({
                             "name": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,53}$"},
                             "for_fork": {"type": "boolean"}}),
                         "responses": dict({"201": {"description": "the snapshot: its image "
                                                    "starts sandboxes of it",
                                                    "content": _object}},
                                           **_errors(400, 401, 404, 410, 422, 503))}},
            "/v1/snapshots": {"get": {"summary": "the tenant's snapshots", "responses": dict(
                {"200": {"description": "snapshots", "content": {"application/json": {
                    "schema": {"type": "array", "items": {"type": "object"}}}}}},
                **_errors(401, 503))}},
            "/v1/snapshots/{name}": {
                "delete": {"summary": "delete a snapshot of the tenant's", "parameters": [
                    {"name": "name", "in": "path", "required": True,
                     "schema": {"type": "string"}}],
                    "responses": dict({"204": {"description": "deleted"}},
                                      **_errors(401, 404, 409, 503))}},
            "/v1/status": {"get": {"summary": "the tenant's leases and limits, the pool's "
                                              "counts", "responses": dict(
                {"200": {"description": "status", "content": {"application/json": {
                    "schema": {"type": "object"}}}}}, **_errors(401, 503))}},
            "/v1/openapi.json": {"get": {"summary": "this document", "security": [],
                                         "responses": {"200": {"description": "OpenAPI"}}}},
            "/v1/healthz": {"get": {"summary": "the service answers", "security": [],
                                    "responses": {"200": {"description": "ok"}}}},
            **_fusion_paths(),
        }}


_DETAIL = {"type": "object", "required": ["detail"],
           "properties": {"detail": {"type": ["string", "array"]}}}
_RESULT = {"type": ["object", "null"], "properties": {
    "status": {"enum": ["Finished", "TimeLimitExceeded", "Error"]},
    "execution_time": {"type": ["number", "null"]}, "return_code": {"type": ["integer", "null"]},
    "stdout": {"type": "string"}, "stderr": {"type": "string"}}}


def _fusion_paths() -> dict:
    """SandboxFusion's routes (service/fusion.py), in its own shapes."""
    from sandman_ray.service.fusion import LANGUAGES
    key = {"name": "key", "in": "path", "required": True, "schema": {"type": "string"}}
    detail = {"description": "refused", "content": {"application/json": {"schema": _DETAIL}}}
    run = {"summary": "SandboxFusion's run_code: one program in a sandbox lent for it alone",
           "requestBody": {"content": {"application/json": {"schema": {
               "type": "object", "required": ["code", "language"], "properties": {
                   "code": {"type": "string"}, "language": {"enum": sorted(LANGUAGES)},
                   "compile_timeout": {"type": ["number", "null"], "exclusiveMinimum": 0,
                                       "maximum": 300},
                   "run_timeout": {"type": ["number", "null"], "exclusiveMinimum": 0,
                                   "maximum": 300},
                   "memory_limit_MB": {"type": ["integer", "null"]},
                   "stdin": {"type": ["string", "null"]},
                   "files": {"type": ["object", "null"],
                             "additionalProperties": {"type": ["string", "null"]}},
                   "fetch_files": {"type": ["array", "null"], "items": {"type": "string"},
                                   "maxItems": 100}}}}}},
           "responses": {"200": {"description": "the verdict", "content": {
               "application/json": {"schema": {"type": "object", "properties": {
                   "status": {"enum": ["Success", "Failed", "SandboxError"]},
                   "message": {"type": "string"}, "compile_result": _RESULT,
                   "run_result": _RESULT, "files": {"type": "object"}}}}}},
               "401": detail, "413": detail, "422": detail, "429": detail,
               # the tenant at its limit, and no room within the request's timeouts: a
               # gateway's timeout, which SandboxFusion's clients retry
               "504": detail}}
    ping = {"summary": "SandboxFusion's ping", "responses": {
        "200": {"description": "pong", "content": {"text/plain": {"schema": {"type": "string"}}}},
        "401": detail}}
    return {"/run_code": {"post": run}, "/v1/ping": {"get": ping},
            "/fusion/{key}/run_code": {"post": dict(run, security=[], parameters=[key])},
            "/fusion/{key}/v1/ping": {"get": dict(ping, security=[], parameters=[key])}}
