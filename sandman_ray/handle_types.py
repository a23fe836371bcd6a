"""The types of a SandboxHandle's operations, for type checkers and IDEs.

A handle's operations are the daemon client's (``client/operations.py``), reached at
run time through ``SandboxHandle.__getattr__``. ``handle.py`` declares each of them for
type checkers only (under ``TYPE_CHECKING``) with ``op`` and ``async_op`` below: the
parameters are taken from the client's method itself, so the two cannot drift, and
the result is the one the handle gives. Called directly, ``sb.exec(...)`` returns an
ExecResult; ``sb.exec.remote(...)`` an ObjectRef of one; ``await sb.exec_async(...)``
the ExecResult. ``tests/test_handle_types.py`` checks that every operation is declared
and that a type checker reads them.
"""

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Type, TypeVar

if TYPE_CHECKING:  # (ParamSpec is Python 3.10's; type checkers read it on any)
    from typing_extensions import Concatenate, ParamSpec

    import ray

    P = ParamSpec("P")
else:
    P = TypeVar("P")
R = TypeVar("R")


class Op(Generic[P, R]):  # type: ignore[misc]
    """``sb.<op>``: called, the result; ``.remote(...)``, an ObjectRef of it."""

    if TYPE_CHECKING:
        def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

        def remote(self, *args: P.args, **kwargs: P.kwargs) -> "ray.ObjectRef[R]": ...


class AsyncOp(Generic[P, R]):  # type: ignore[misc]
    """``sb.<op>_async``: awaited, the result."""

    if TYPE_CHECKING:
        def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]: ...


if TYPE_CHECKING:
    def op(method: "Callable[Concatenate[Any, P], Any]", returns: Type[R]) -> Op[P, R]: ...

    def async_op(method: "Callable[Concatenate[Any, P], Any]",
                 returns: Type[R]) -> AsyncOp[P, R]: ...
