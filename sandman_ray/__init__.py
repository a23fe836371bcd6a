"""sandman-ray: Ray-native sandboxes for agentic reinforcement learning."""

from sandman_ray.client import (
    AsyncDaemonClient, DaemonClient, ExecResult, FileStat, ProcessOutput, ProcessStatus)
from sandman_ray.errors import (
    AcquireTimeout, AuthError, CallTimeout, ConnectionLost, DaemonError, ExecTimeout,
    ProtocolError, ProviderError, SandboxLost, SandmanError)

__version__ = "0.1.0"

__all__ = [
    "AcquireTimeout", "AsyncDaemonClient", "AuthError", "CallTimeout", "ConnectionLost",
    "DaemonClient", "DaemonError", "ExecResult", "ExecTimeout", "FileStat", "ProcessOutput",
    "ProcessStatus", "ProtocolError", "ProviderError", "SandboxLost", "SandmanError",
]
