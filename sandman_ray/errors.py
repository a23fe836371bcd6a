"""One exception hierarchy for everything sandman-ray raises."""

from typing import Optional


class SandmanError(Exception):
    """Base of every sandman-ray error."""


class ProtocolError(SandmanError):
    """The peer broke the wire protocol (bad frame, wrong version, unexpected reply)."""


class AuthError(ProtocolError):
    """The daemon refused the hello: wrong or missing token."""


class ConnectionLost(SandmanError):
    """The connection to a daemon closed while a request was in flight, or could not be
    opened."""


class CallTimeout(SandmanError, TimeoutError):
    """A request got no reply within the client-side timeout."""


class DaemonError(SandmanError):
    """The daemon answered a request with an error.

    ``type`` is the daemon's error kind (``FileNotFoundError``, ``BadRequest``,
    ``SessionClosed`` ...), ``errno`` its symbolic errno when the cause was an OSError,
    ``op`` the request that failed.
    """

    def __init__(self, type: str, message: str, op: str = "", errno: Optional[str] = None):
        super().__init__("%s: %s%s" % (type, message, " (op %s)" % op if op else ""))
        self.type = type
        self.message = message
        self.op = op
        self.errno = errno

    def __reduce__(self):  # pickled by Ray when it crosses a task or actor call
        return (type(self), (self.type, self.message, self.op, self.errno))


class ExecTimeout(SandmanError, TimeoutError):
    """A command ran past its timeout; ``result`` holds what it printed until then."""

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result

    def __reduce__(self):
        return (type(self), (self.args[0], self.result))


class SandboxLost(SandmanError):
    """The sandbox or its daemon is gone (deleted, crashed, its node removed)."""


class SandboxPaused(SandmanError):
    """A call on a handle whose sandbox it paused, and whose lease does not resume it
    on a call (``acquire(..., auto_resume=True)``): ``resume()`` it first."""


class ResultTooLarge(SandmanError):
    """A file or archive read from a sandbox is larger than the caller's ``max_bytes``:
    refused rather than held in memory."""


class LeaseEnded(SandboxLost):
    """The lease this handle names is over (released, reclaimed for its TTL or for
    idleness, ended by a pool restart or shutdown): its sandbox may already serve
    someone else, so nothing more runs through this handle. ``reason`` says why."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.args[0], self.reason))


def lease_lost(exc: Exception, op: str, sandbox_id: str, lease_id: str,
               reason: Optional[str]) -> SandboxLost:
    """The error of a call ``op`` whose daemon stopped answering its lease (``exc``:
    what the connection raised), the one rule for a handle's host and its direct
    path: LeaseEnded when the lease ended (``reason``: why, from the pool or the
    handle; a daemon that refuses the lease's token was started again for another),
    else SandboxLost."""
    if reason is None and isinstance(exc, AuthError):
        reason = "sandbox %s no longer takes this lease's token" % sandbox_id
    if reason is not None:
        return LeaseEnded("lease %s has ended: %s" % (lease_id, reason), reason)
    return SandboxLost("sandbox %s is gone (%s during %s)" % (sandbox_id, exc, op))


class LeaseNotHeld(SandmanError):
    """A call that acts on a lease (release, touch, register) came from someone who
    does not hold it, and was refused."""


class AcquireTimeout(SandmanError, TimeoutError):
    """No sandbox could be leased within the acquire timeout."""


class ProviderError(SandmanError):
    """A provider operation failed. ``kind`` is ``throttled``, ``transient`` or
    ``fatal``: the pool slows down on the first, retries the second, gives up on the
    third."""

    def __init__(self, message: str, kind: str = "fatal"):
        if kind not in ("throttled", "transient", "fatal"):
            raise ValueError("ProviderError kind must be throttled, transient or fatal, not %r" % kind)
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):
        return (type(self), (self.args[0], self.kind))


def throttled(message: str) -> ProviderError:
    """A ProviderError of a provider that asks to be called less often (the pool slows
    its creates)."""
    return ProviderError(message, "throttled")


def transient(message: str) -> ProviderError:
    """A ProviderError that asking again may mend (the pool retries it)."""
    return ProviderError(message, "transient")


def fatal(message: str) -> ProviderError:
    """A ProviderError that asking again will not mend."""
    return ProviderError(message, "fatal")


class NotSupported(ProviderError):
    """The provider (or this sandbox's kind) cannot do what was asked: a snapshot of a
    pod, a pause under gVisor. The message names what it would need. Always fatal:
    asking again changes nothing."""

    def __init__(self, message: str, kind: str = "fatal"):
        super().__init__(message, "fatal")


class SnapshotInUse(SandmanError):
    """A snapshot cannot be deleted while sandboxes leased from it still run; the
    message names their leases."""


class ServiceLimit(SandmanError):
    """The service refused for now (HTTP 429): the tenant holds or waits for its most
    sandboxes, or acquires faster than its creates per second, or the pool is busy;
    ``retry_after`` is the seconds the service asked to wait."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):
        return (type(self), (self.args[0], self.retry_after))
