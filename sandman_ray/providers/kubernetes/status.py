"""What the Kubernetes API server says, read for the pool: its errors as
ProviderErrors whose kind paces the pool (429 throttled, 5xx and timeouts transient,
other 4xx fatal), and why a pod cannot start or is still pending."""

import json
from typing import Optional

from sandman_ray.errors import ProviderError
from sandman_ray.providers.base import fatal, throttled, transient

BAD_IMAGE_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                     "ErrImageNeverPull", "CreateContainerConfigError",
                     "CreateContainerError")


def api_error(exc: BaseException, what: str) -> Exception:
    """A client exception as a ProviderError whose kind paces the pool."""
    from kubernetes.client.exceptions import ApiException
    if isinstance(exc, ApiException):
        reason = status_message(exc)
        if exc.status == 429:
            return throttled("%s: the API server asks to slow down: %s" % (what, reason))
        if exc.status == 0 or exc.status >= 500:
            return transient("%s: API server error %s: %s" % (what, exc.status, reason))
        if exc.status in (401, 403):
            return fatal("%s: the API server refused the provider's credentials (%s): %s "
                         "(see cluster_configs/rbac.yaml)" % (what, exc.status, reason))
        return fatal("%s: the API server refused it (%s): %s" % (what, exc.status, reason))
    import urllib3.exceptions
    if isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError)):
        return transient("%s: the API server is unreachable or slow: %s" % (what, exc))
    return fatal("%s: %s: %s" % (what, type(exc).__name__, exc))


def status_message(exc) -> str:
    try:
        return json.loads(exc.body).get("message") or exc.reason
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)


def retry_after_s(exc) -> float:
    try:
        return max(0.0, float((exc.headers or {}).get("Retry-After", 1)))
    except (TypeError, ValueError):
        return 1.0


def http_status(exc: ProviderError) -> Optional[int]:
    """The HTTP status of the API error behind ``exc``, if it came from one."""
    return getattr(exc.__cause__, "status", None)


def stuck_reason(pod: dict) -> Optional[str]:
    """Why a pod can never start (its image), or None."""
    status = pod.get("status") or {}
    for entry in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (entry.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in BAD_IMAGE_REASONS:
            return "%s: %s" % (waiting["reason"], waiting.get("message", ""))
    return None


def pending_reason(pod: Optional[dict]) -> str:
    if pod is None:
        return "never seen by the watch"
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("status") == "False" and condition.get("reason"):
            return "%s: %s" % (condition["reason"], condition.get("message", ""))
    for entry in status.get("containerStatuses") or []:
        waiting = (entry.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return waiting["reason"]
    return "phase %s" % status.get("phase", "unknown")
