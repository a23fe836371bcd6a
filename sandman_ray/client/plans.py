"""What the daemon's operations share (operations.py composes them; the clients
drive them): requests and plans (a generator that yields the requests it needs and
receives their results), the stream of a command's output, and the transport each
client implements."""

from typing import Any, Callable, Dict, Generator, Optional, Sequence, Union

from sandman_ray.results import ExecResult


Command = Union[str, Sequence[str]]
OnOutput = Callable[[str, bytes], None]
# Slack added to a command's own timeout for the client-side wait on its reply.
REPLY_SLACK_S = 30.0
READ_CHUNK = 32 * 1024 * 1024  # the daemon answers at most this much per read_file
UPLOAD_CHUNK = 8 * 1024 * 1024
MAX_RESULT_BYTES = 1 << 30  # read_file and get_archive keep at most this (max_bytes)
STREAM_BUFFER = 8 * 1024 * 1024  # streamed output an asyncio reader may lag by
CANCEL_WAIT_S = 10.0  # a stream given up: how long its end may take to arrive
STOP_POLL_S = 0.2  # how often a blocking stream asks its ``stop`` while no output comes


class ExecStream:
    """What ``exec_stream`` and ``proc_follow`` return on a blocking connection:
    iterate it for ``(stream, bytes)`` chunks and, last, the result (exec_stream's
    ExecResult, a NamedTuple too: tell it by ``isinstance(item, ExecResult)``;
    proc_follow's status), which ``result`` keeps. ``close()`` (or dropping it) before
    the end kills exec_stream's command; a followed process goes on."""

    def __init__(self, frames):
        self._frames = frames
        self.result: Optional[ExecResult] = None

    def __iter__(self) -> "ExecStream":
        return self

    def __next__(self):
        item = next(self._frames)
        if type(item) is not tuple:  # the chunks are plain (stream, bytes) tuples
            self.result = item
        return item

    def close(self) -> None:
        self._frames.close()

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Request:
    """One request of a multi-step plan: the op, its fields, the client-side timeout
    for its reply and, for streaming ops, a callback for its events."""

    __slots__ = ("op", "fields", "timeout", "on_event")

    def __init__(self, op: str, fields: Dict[str, Any], timeout: Optional[float] = None,
                 on_event: Optional[OnOutput] = None):
        self.op, self.fields, self.timeout, self.on_event = op, fields, timeout, on_event


Plan = Generator[Request, Any, Any]


def _present(fields: Dict[str, Any]) -> Dict[str, Any]:
    """The fields that were given (None means "the daemon's default")."""
    return {k: v for k, v in fields.items() if v is not None}


def _reply_timeout(command_timeout: Optional[float], default: Optional[float]) -> Optional[float]:
    if command_timeout is None:
        return None
    return command_timeout + REPLY_SLACK_S if default is None else max(default, command_timeout + REPLY_SLACK_S)


# --------------------------------------------------------------------------- operations


class _Transport:
    """What the operations ask of a client: ``_call`` (one request), ``_run(plan)``
    (a value for the blocking client, an awaitable for the asyncio client) and
    ``_stream``; the clients (blocking.py, aio.py) implement them."""

    default_timeout: Optional[float] = None

    def _call(self, op: str, fields: Dict[str, Any], convert=None, timeout=None,
              on_event=None):  # pragma: no cover - implemented by the transports
        """One request; ``convert`` turns its result into the value returned."""
        raise NotImplementedError

    def _run(self, plan: Plan):  # pragma: no cover - implemented by the transports
        """Several requests, each depending on the last: a generator of Requests."""
        raise NotImplementedError

    def _stream(self, op: str, fields: Dict[str, Any], convert, timeout: Optional[float],
                stop=None):
        raise NotImplementedError  # pragma: no cover - implemented by the transports
