"""What the daemon's operations return, as the clients give it (``sandman_ray.client``):
plain values made from the daemon's answers (``from_wire``)."""

from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Union


class ExecResult(NamedTuple):
    """The outcome of one command.

    exit_code: the command's exit status; 128+N when killed by signal N; None when a
        session command was cut short with its shell.
    stdout, stderr: what it printed, up to the output cap (empty when streamed).
    duration_s: wall time from start to exit, measured by the daemon.
    timed_out: the command ran past its timeout and was killed.
    signal: the signal that ended it, if any.
    truncated: some output was over the cap and dropped.
    session_alive: for session commands, whether the shell survived (always True for
        one-shot commands).
    oom_killed: the kernel's OOM killer killed a process of the sandbox while the
        command ran: the command, one of its children (a ``sh -c`` that survives its
        child says exit 0 and still has this set), or another process of the sandbox
        killed meanwhile (the count is the sandbox's memory cgroup's). False where the
        daemon sees no cgroup counter.
    """

    exit_code: Optional[int]
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool = False
    signal: Optional[int] = None
    truncated: bool = False
    session_alive: bool = True
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    @classmethod
    def from_wire(cls, r: Dict[str, Any]) -> "ExecResult":
        return cls(r["exit_code"], r["stdout"], r["stderr"], r["duration_s"], r["timed_out"],
                   r.get("signal"), r.get("truncated", False), r.get("session_alive", True),
                   r.get("oom_killed", False))


@dataclass(frozen=True)
class ProcessStatus:
    """A background process started by ``spawn``.

    pid: its pid inside the sandbox. running: not yet exited. exit_code / signal: how it
    ended. started_at / ended_at: daemon wall-clock times. stdout_bytes / stderr_bytes:
    bytes written so far (cursors for ``output`` run up to these).
    """

    pid: int
    cmd: Any
    running: bool
    exit_code: Optional[int]
    signal: Optional[int]
    started_at: float
    ended_at: Optional[float]
    stdout_bytes: int
    stderr_bytes: int
    timed_out: bool = False

    @classmethod
    def from_wire(cls, r: Dict[str, Any]) -> "ProcessStatus":
        return cls(**{k: r[k] for k in cls.__dataclass_fields__ if k in r})


@dataclass(frozen=True)
class ProcessOutput:
    """A slice of a background process's output.

    data: the bytes from the cursor asked for. cursor: where to continue next time.
    dropped: bytes lost between the cursor asked for and the oldest byte still held by
    the ring buffer. eof: the process has exited and everything was read.
    """

    data: bytes
    cursor: int
    dropped: int
    eof: bool

    @classmethod
    def from_wire(cls, r: Dict[str, Any]) -> "ProcessOutput":
        return cls(r["data"], r["cursor"], r["dropped"], r["eof"])


@dataclass(frozen=True)
class FileStat:
    """A file in the sandbox. type: file, dir, symlink, fifo, socket, char, block or
    other; mode: permission bits; target: a symlink's target."""

    name: Union[str, bytes]  # bytes where the name is not UTF-8
    type: str
    size: int
    mode: int
    mtime: float
    uid: int
    gid: int
    target: Optional[Union[str, bytes]] = None
    path: Optional[Union[str, bytes]] = None

    @classmethod
    def from_wire(cls, r: Dict[str, Any]) -> "FileStat":
        return cls(**{k: r[k] for k in cls.__dataclass_fields__ if k in r})


class Listing(list):
    """A directory's entries (FileStat, names as str, or bytes where a name is not
    UTF-8); ``truncated``: more entries exist than the daemon sent."""

    truncated = False

    @classmethod
    def from_wire(cls, r: Dict[str, Any]) -> "Listing":
        listing = cls(FileStat.from_wire(e) for e in r["entries"])
        listing.truncated = bool(r.get("truncated"))
        return listing
