"""Request fields, checked against the op table before an op runs, and the errors
answered to the client."""

import errno


class RequestError(Exception):
    """An error answered to the client: ``{"type": kind, "message": str(self)}``."""

    def __init__(self, kind, message):
        Exception.__init__(self, message)
        self.kind = kind


def bad_request(message):
    return RequestError("BadRequest", message)


def error_body(exc):
    if isinstance(exc, RequestError):
        return {"type": exc.kind, "message": str(exc)}
    if isinstance(exc, OSError):
        body = {"type": type(exc).__name__, "message": str(exc)}
        if exc.errno:
            body["errno"] = errno.errorcode.get(exc.errno, str(exc.errno))
        return body
    return {"type": "InternalError", "message": "%s: %s" % (type(exc).__name__, exc)}


def check_fields(req, op):
    """Refuse a request to ``op`` (a wire.Op) with a field its schema does not name, a
    value of a type the field does not take, or a required field absent or null: never
    trust the wire. The ops then read their fields without checking types again."""
    accepts = op.accepts
    for name, value in req.items():
        types = accepts.get(name)
        if types is None or type(value) not in types:
            raise _field_error(op, name, value)
    for name in op.required:
        if name not in req:
            raise bad_request("field %r is required" % name)


def _field_error(op, name, value):
    spec = op.fields.get(name)
    if spec is None:
        return bad_request("%r is not a field of %s (it takes %s)"
                           % (name, op.name, ", ".join(op.fields) or "none"))
    if value is None:
        return bad_request("field %r is required" % name)
    return bad_request("field %r must be %s, got %s"
                       % (name, " or ".join(t.__name__ for t in spec.types),
                          type(value).__name__))


def field(req, name, default=None):
    """``req[name]``, or ``default`` when it is absent or null."""
    value = req.get(name)
    return default if value is None else value


def number_field(req, name, default, low=0.0, high=None):
    value = field(req, name, default)
    if value is None:
        return None
    if value < low or (high is not None and value > high):
        raise bad_request("field %r must be in [%s, %s], got %s" % (name, low, high, value))
    return float(value)


def path_field(req, name="path"):
    path = req[name]
    if not path or "\0" in path:
        raise bad_request("field %r must be a non-empty path without NUL bytes" % name)
    return path


def check_argv(argv):
    """``argv`` (a list from field ``cmd``) if it can be executed: strings without NUL,
    the program's name not empty (an argument may be: ``printf '%s' ''``)."""
    if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv) or not argv[0]:
        raise bad_request("field 'cmd' as a list must be strings without NUL, the first "
                          "one not empty")
    return argv


def env_field(req, base):
    """The sandbox environment with the request's ``env`` merged over it (None unsets)."""
    extra = req.get("env")
    if not extra:
        return base
    env = dict(base)
    for key, value in extra.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise bad_request("env name %r is not a valid variable name" % (key,))
        if value is None:
            env.pop(key, None)
        elif isinstance(value, str) and "\0" not in value:
            env[key] = value
        else:
            raise bad_request("env value of %r must be a string without NUL bytes" % key)
    return env


def as_bytes(data):
    return data.encode("utf-8") if isinstance(data, str) else data
