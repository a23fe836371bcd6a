"""What the service's routes share, whichever protocol they speak: a refusal (its
status and message), a body read to a bound, and a request's tenant by its key."""

from typing import Optional

BODY_MAX = 64 * 1024  # a control-plane request's body


class Refusal(Exception):
    """An answer other than success: its status, error type and message, and the
    seconds after which to try again (429)."""

    def __init__(self, status: int, kind: str, message: str,
                 retry_after: Optional[float] = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.retry_after = \
            status, kind, message, retry_after


async def read_at_most(request, limit: int) -> bytes:
    """The request's body, read to its end or to one byte past ``limit`` (a read of the
    stream gives what has arrived, not always all that was sent)."""
    chunks, size = [], 0
    while size <= limit:
        chunk = await request.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def tenant_by_key(core, verify, request, key: Optional[str]) -> Optional[str]:
    """The tenant of ``key``, else of the request's ``Authorization: Bearer`` key; None
    (and the failure counted against its address) when neither is live."""
    if key is None:
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer "):] if header.startswith("Bearer ") else None
    tenant = verify(key) if key else None
    if tenant is None:
        await core.failed_key(request.remote)
    return tenant
