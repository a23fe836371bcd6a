"""The daemon's operations, each written once as a plan for both clients to drive
(``blocking.DaemonClient``, ``aio.AsyncDaemonClient``), and each a method named as its
op in the wire's table (``sandmand.wire.OPS``, whose fields are its parameters):
commands and sessions (``ops_commands.py``), background processes and terminals
(``ops_processes.py``), files (``ops_files.py``), over what they share
(``plans.py``)."""

from sandman_ray.client.ops_commands import _Commands
from sandman_ray.client.ops_files import _Files, tar_of
from sandman_ray.client.ops_processes import _Processes
from sandman_ray.client.plans import (
    CANCEL_WAIT_S, MAX_RESULT_BYTES, READ_CHUNK, REPLY_SLACK_S, STOP_POLL_S, STREAM_BUFFER,
    UPLOAD_CHUNK, Command, ExecStream, OnOutput, Plan, Request)

__all__ = ["CANCEL_WAIT_S", "MAX_RESULT_BYTES", "READ_CHUNK", "REPLY_SLACK_S", "STOP_POLL_S",
           "STREAM_BUFFER", "UPLOAD_CHUNK", "Command", "ExecStream", "OnOutput", "Plan",
           "Request", "tar_of", "_Operations"]


class _Operations(_Commands, _Processes, _Files):
    """Every daemon operation, once. ``_run(plan)`` is the transport: a value for the
    blocking client, an awaitable for the asyncio client."""
