"""Schemathesis, the property-based API fuzzer, against the served OpenAPI document of a
real ``sandman serve`` (test_service.py's ``serving``): every operation with
generated bodies and parameters, valid and not. No answer may be a 5xx (but the 504 of
``/run_code`` that found no room within its timeouts, which SandboxFusion's clients
retry, and which the document names); every answer
conforms to the document (statuses, content types, schemas); every 4xx is a typed
error (SandboxFusion's routes: its own ``detail``). A fuzzing tenant may hold one sandbox at a time (the rest are 429), and an
acquire waits at most 3 s (the generated timeouts are capped so that a run ends).
The check that a body valid by the document is accepted is left out: a SandboxSpec is
checked further than a schema can say (an image's form, a memory size's units), and
such a body is a 400 naming the field."""

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, positive_data_acceptance

from sandman_ray.service.openapi import document
from test_service import serving

SCHEMA = schemathesis.openapi.from_dict(document())


@SCHEMA.hook
def map_body(context, body):
    """An acquire waits at most 3 s, and a program runs at most 1 s (and compiles in
    1 s): a generated timeout of minutes would only wait."""
    if isinstance(body, dict):
        for name, most in (("timeout_s", 3.0), ("compile_timeout", 1.0), ("run_timeout", 1.0)):
            if isinstance(body.get(name), (int, float)) and not isinstance(body[name], bool):
                body[name] = min(body[name], most)
    return body


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory):
    """A service of its own, whose failed keys are not slowed (the fuzzer sends many
    requests without one, from one address)."""
    with serving(tmp_path_factory.mktemp("fuzz"), "--slow-after", "0") as service:
        key = service["store"].create_key("fuzz")
        service["store"].set_tenant("fuzz", max_sandboxes=1)
        yield {"url": service["url"], "key": key}
        from sandman_ray.remote import connect
        pool = connect(service["url"], key)
        for lease in pool.leases():
            pool.release(lease["lease_id"])


@SCHEMA.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx_or_off_the_document(case, fuzzer):
    if case.path.endswith("/run_code") and isinstance(case.body, dict):
        for name in ("compile_timeout", "run_timeout"):  # 10 s each unless given
            if case.body.get(name) is None:
                case.body[name] = 1.0
    response = case.call_and_validate(base_url=fuzzer["url"],
                                      headers={"Authorization": "Bearer " + fuzzer["key"]},
                                      excluded_checks=[positive_data_acceptance,
                                                       not_a_server_error])
    if response.status_code >= 500:  # the one 5xx there is, and only for no room
        assert case.path.endswith("/run_code") and response.status_code == 504, \
            (case.path, response.status_code, response.content[:500])
        assert "no sandbox was free" in json.loads(response.content)["detail"]
    if 400 <= response.status_code < 500:
        answer = json.loads(response.content)
        if case.path.endswith(("/run_code", "/v1/ping")):  # SandboxFusion's own shape
            assert isinstance(answer["detail"], (str, list))
            return
        error = answer["error"]
        assert isinstance(error["type"], str) and isinstance(error["message"], str)
