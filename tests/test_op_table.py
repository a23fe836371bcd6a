"""The one op table (``sandmand.wire.OPS``): the daemon answers every op of it with a
method of the op's kind, both clients have a method of the same name for each op, taking
the op's fields as its parameters, and a SandboxHandle forwards exactly the public ones."""

import inspect

import pytest

from sandman_ray.client import AsyncDaemonClient, DaemonClient
from sandman_ray.daemon.sandmand import wire
from sandman_ray.daemon.sandmand.daemon import Daemon

STEPS = {step for op in wire.OPS for step in op.steps}
CLIENT_OPS = [op for op in wire.OPS if op.kind != "hello" and op.name not in STEPS]
# what a client method takes beyond its op's fields, and the fields it sets itself
CLIENT_ONLY = {"exec": {"on_output"}, "read_file": {"max_bytes"}, "get_archive": {"max_bytes"},
               "proc_follow": {"stop"}, "watch_dir": {"stop"}}
SET_BY_CLIENT = {"exec": {"stream"}}  # from on_output


def test_names_are_unique_and_steps_are_ops():
    names = [op.name for op in wire.OPS]
    assert len(names) == len(set(names))
    assert STEPS <= set(names)
    assert all(op.kind == "composite" for op in wire.OPS if op.steps)


def test_the_daemon_answers_every_wire_op_with_a_method_of_its_kind():
    wire_ops = {op.name: op for op in wire.OPS if op.kind not in ("hello", "composite")}
    assert set(Daemon.handlers) == set(wire_ops)
    for name, (method, kind, op) in Daemon.handlers.items():
        assert op is wire_ops[name] and kind == op.kind
        assert inspect.iscoroutinefunction(method) == (kind in ("async", "stream")), name


@pytest.mark.parametrize("client", [DaemonClient, AsyncDaemonClient])
@pytest.mark.parametrize("op", CLIENT_OPS, ids=lambda op: op.name)
def test_every_op_has_a_client_method_taking_its_fields(client, op):
    params = inspect.signature(getattr(client, op.name)).parameters
    taken = set(params) - {"self"} - CLIENT_ONLY.get(op.name, set())
    assert taken == set(op.fields) - SET_BY_CLIENT.get(op.name, set())
    without_default = {name for name, p in params.items()
                       if name != "self" and p.default is inspect.Parameter.empty}
    assert without_default == set(op.required)


def test_handles_forward_the_public_ops_to_client_methods():
    from sandman_ray.host import FORWARDED
    assert set(FORWARDED) == {op.name for op in wire.OPS if op.public}
    assert set(FORWARDED) <= {op.name for op in CLIENT_OPS}
