"""Clients of the sandbox daemon (``sandman_ray/daemon/sandmand/``; its protocol is
``sandman_ray/daemon/docs/protocol.md``).

Every operation is written once, as a *plan*: a generator that yields the requests it
needs and receives their results. ``DaemonClient`` drives plans over a blocking socket
(for scripts, tests and the handle hosts' threads); ``AsyncDaemonClient`` drives the
same plans over asyncio with many requests in flight on one connection (for asyncio
callers and the providers' probes). Both use the daemon's own frame definitions,
codec and op table (``sandmand.wire``): each method is named as the op it sends.

``operations`` holds the plans (``ops_*.py``, over ``plans.py``), ``connection`` reaching a
daemon and reading its replies, ``blocking`` and ``aio`` the two clients.
"""

from sandman_ray.client.aio import AsyncDaemonClient
from sandman_ray.client.blocking import DaemonClient
from sandman_ray.client.operations import (
    MAX_RESULT_BYTES, READ_CHUNK, UPLOAD_CHUNK, Command, ExecStream, OnOutput, tar_of)
from sandman_ray.results import ExecResult, FileStat, Listing, ProcessOutput, ProcessStatus

__all__ = ["AsyncDaemonClient", "DaemonClient", "ExecStream", "tar_of", "Command", "OnOutput",
           "MAX_RESULT_BYTES", "READ_CHUNK", "UPLOAD_CHUNK", "ExecResult", "FileStat",
           "Listing", "ProcessOutput", "ProcessStatus"]
