"""Errors of the public API as themselves.

An error raised in a pool's or an agent's actor (an image that does not exist, an
acquire that timed out) reaches its caller from Ray as a ``RayTaskError`` whose message
is the remote traceback, 40 lines with the error's own message last. The public
functions (``api.py``, ``forks.py``) raise the error itself instead, its message first:
the Ray exception is kept on it as ``ray_error``, and as its ``__cause__`` too (the
remote traceback printed above it) when ``SANDMAN_RAY_TRACEBACK=1`` is set.
"""

import functools
import inspect
import os
from typing import Any, Callable, TypeVar, cast

TRACEBACK_ENV = "SANDMAN_RAY_TRACEBACK"
F = TypeVar("F", bound=Callable[..., Any])


def plain(exc: BaseException) -> BaseException:
    """The error a caller sees for ``exc``: the exception a Ray task raised, through
    any number of Ray's wrappers around it; ``exc`` itself if it is no such wrapper."""
    from ray.exceptions import RayTaskError
    raised = exc
    while isinstance(raised, RayTaskError) and isinstance(getattr(raised, "cause", None),
                                                           BaseException):
        raised = raised.cause
    if raised is exc:
        return exc
    try:
        raised.ray_error = exc
    except AttributeError:  # (an exception that takes no attributes)
        pass
    raised.__traceback__ = None  # (the remote one is in ray_error's message)
    return raised


def plain_errors(fn: F) -> F:
    """``fn`` (a function or a coroutine function) raising ``plain`` errors."""
    def _raise(exc: BaseException):
        err = plain(exc)
        if err is exc:
            raise
        if os.environ.get(TRACEBACK_ENV):
            raise err from exc
        raise err from None

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def waited(*args, **kwargs):
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - raised again, as itself
                _raise(exc)
        return cast(F, waited)

    @functools.wraps(fn)
    def called(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - raised again, as itself
            _raise(exc)
    return cast(F, called)
