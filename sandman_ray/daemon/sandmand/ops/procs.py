"""Background processes: started by ``spawn``, followed by pid, their output kept in
ring buffers (``proc_status``, ``proc_list``, ``proc_output``, ``proc_wait``,
``proc_signal``), streamed as it comes (``proc_follow``), their stdin fed while they
run (``proc_stdin``)."""

import os
import time

import _signal as signal  # the C module: signal.py would import enum (~10 ms)

from ..fields import RequestError, as_bytes, bad_request, env_field, field, number_field
from ..loop import CancelledError, Event, Lock, Timeout, wait_for
from ..spawn import Ring, exit_code, signal_tree, write_and_close, write_pipe
from ..wire import MAX_FINISHED_PROCS, MAX_STREAM_CAP, PROC_RING_BYTES

FOLLOW_EVENT_BYTES = 1024 * 1024  # most output one proc_follow event carries


class ProcessOps:
    """The Daemon's process ops (a mixin: the state is the Daemon's, ``self.procs``)."""

    def op_spawn(self, req):
        cmd = req["cmd"]
        env = env_field(req, self.env)
        cwd = field(req, "cwd")
        stdin = field(req, "stdin", b"")
        stdin_open = field(req, "stdin_open", False)
        if stdin and stdin_open:
            raise bad_request("fields 'stdin' and 'stdin_open' exclude each other: feed an "
                              "open stdin with proc_stdin")
        ring = int(number_field(req, "buffer_bytes", PROC_RING_BYTES, 1, MAX_STREAM_CAP))
        if sum(1 for p in self.procs.values() if p.running) >= 4096:
            raise RequestError("LimitExceeded", "4096 background processes are running")
        proc = Process(cmd, ring, self.loop)
        proc.pid, readers, stdin_w = self._start_command(cmd, env, cwd,
                                                         bool(stdin) or stdin_open,
                                                         proc.heard(proc.out),
                                                         proc.heard(proc.err))
        if stdin:
            self.loop.create_task(write_and_close(self.loop, stdin_w, as_bytes(stdin)))
        elif stdin_open:
            os.set_blocking(stdin_w, False)
            proc.stdin = stdin_w
        self.procs[proc.pid] = proc
        self.loop.create_task(self._follow(proc, self.children.waiting[proc.pid], readers))
        return {"pid": proc.pid}

    async def _follow(self, proc, exited, readers):
        status = await exited
        for reader in readers:
            reader.drain()
            reader.close()
        proc.exit_code, proc.signal = exit_code(status)
        proc.ended = time.time()
        proc.out.eof = proc.err.eof = True
        proc.close_stdin()
        proc.done.set()
        proc.more.set()
        proc.more.clear()
        finished = [p for p in self.procs.values() if not p.running]
        for old in sorted(finished, key=lambda p: p.ended)[:-MAX_FINISHED_PROCS]:
            del self.procs[old.pid]

    def _proc(self, req):
        pid = req["pid"]
        proc = self.procs.get(pid)
        if proc is None:
            raise RequestError("ProcessNotFound", "no background process with pid %d" % pid)
        return proc

    def op_proc_status(self, req):
        return self._proc(req).status()

    def op_proc_list(self, req):
        return [p.status() for p in self.procs.values()]

    def op_proc_output(self, req):
        proc = self._proc(req)
        name = field(req, "stream", "stdout")
        if name not in ("stdout", "stderr"):
            raise bad_request("field 'stream' must be 'stdout' or 'stderr'")
        cursor = field(req, "cursor", 0)
        max_bytes = int(number_field(req, "max_bytes", MAX_STREAM_CAP, 0, MAX_STREAM_CAP))
        return (proc.out if name == "stdout" else proc.err).read(max(0, cursor), max_bytes)

    async def op_proc_wait(self, req):
        proc = self._proc(req)
        timeout = number_field(req, "timeout", None)
        try:
            await wait_for(self.loop, proc.done.wait(), timeout)
        except Timeout:
            pass
        status = proc.status()
        status["timed_out"] = proc.running
        return status

    async def op_proc_follow(self, req, reply):
        """Events ``stdout`` and ``stderr`` with the output from the cursors on, as it
        comes (paced by the client: while the connection's unsent replies are over its
        high-water mark, none is sent), then the status once the process has exited and
        all of it was sent, or once the follow is cancelled (the process goes on);
        ``stdout_cursor``/``stderr_cursor`` there: where to follow from again."""
        proc = self._proc(req)
        # where each stream got to, and the bytes its ring let go before they were sent
        at = [max(0, field(req, "stdout_cursor", 0)), max(0, field(req, "stderr_cursor", 0)), 0]
        try:
            await _follow(proc, reply, at)
        except CancelledError:
            pass
        status = proc.status()
        status.update(stdout_cursor=at[0], stderr_cursor=at[1], dropped=at[2])
        return status

    async def op_proc_stdin(self, req):
        """Write ``data`` to the stdin of a process spawned with ``stdin_open``, then
        close it if ``close``; the bytes written."""
        proc = self._proc(req)
        data = as_bytes(field(req, "data", b""))
        if proc.stdin is None:
            raise RequestError("StdinClosed", "process %d has no open stdin (spawned without "
                               "stdin_open, or it was closed)" % proc.pid)
        try:
            async with proc.stdin_lock:
                try:
                    if data and proc.stdin is not None:
                        await write_pipe(self.loop, proc.stdin, data)
                except OSError as exc:  # EPIPE: it closed its stdin or exited
                    proc.close_pending = True
                    raise RequestError("StdinClosed", "process %d stopped reading its stdin "
                                       "(%s)" % (proc.pid, exc.strerror))
                finally:
                    if field(req, "close", False):
                        proc.close_pending = True
        finally:  # (after the lock: a close waits for the write under way)
            if proc.close_pending:
                proc.close_stdin()
        return {"written": len(data)}

    def op_proc_signal(self, req):
        proc = self._proc(req)
        sig = signal_number(field(req, "signal", "TERM"))
        if proc.running:
            if field(req, "group", True):
                signal_tree(proc.pid, sig, alive=True)
            else:
                os.kill(proc.pid, sig)
        return proc.status()


async def _follow(proc, reply, at):
    """Send ``proc``'s output from the cursors of ``at`` on, until it has exited and
    all of it was sent."""
    while True:
        sent = False
        for i, ring in enumerate((proc.out, proc.err)):
            chunk = ring.read(at[i], FOLLOW_EVENT_BYTES)
            at[2] += chunk["dropped"]
            at[i] = chunk["cursor"]
            if chunk["data"]:
                reply.event(("stdout", "stderr")[i], chunk["data"])
                sent = True
        writable = reply.conn.writable
        if not writable.is_set():
            await writable.wait()
        elif not sent:
            if not proc.running:
                return
            await proc.more.wait()


class Process:
    """A background process started by ``spawn``; output kept in ring buffers."""

    def __init__(self, cmd, ring_bytes, loop):
        self.cmd = cmd
        self.pid = None
        self.out, self.err = Ring(ring_bytes), Ring(ring_bytes)
        self.started = time.time()
        self.ended = None
        self.exit_code = None
        self.signal = None
        self.done = Event(loop)
        self.more = Event(loop)  # set when output or the end arrives
        self.stdin = None  # the write end of an open stdin (spawn's stdin_open)
        self.stdin_lock = Lock(loop)  # one write at a time: chunks never interleave
        self.close_pending = False  # closed once the write under way ends

    def heard(self, ring):
        """The sink of one stream's output: kept in ``ring``, followers told."""
        def sink(chunk):
            ring.add(chunk)
            self.more.set()
            self.more.clear()
        return sink

    def close_stdin(self):
        """Close the open stdin (after the write under way, if one is)."""
        self.close_pending = True
        if self.stdin is not None and not self.stdin_lock.held:
            os.close(self.stdin)
            self.stdin = None

    @property
    def running(self):
        return not self.done.is_set()

    def status(self):
        return {"pid": self.pid, "cmd": self.cmd, "running": self.running,
                "exit_code": self.exit_code, "signal": self.signal,
                "started_at": self.started, "ended_at": self.ended,
                "stdout_bytes": self.out.start + len(self.out.data),
                "stderr_bytes": self.err.start + len(self.err.data)}


def signal_number(value):
    if isinstance(value, int) and not isinstance(value, bool):
        sig = value
    elif isinstance(value, str):
        name = value.upper()
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if not isinstance(sig, int):
            raise bad_request("unknown signal %r" % value)
    else:
        raise bad_request("field 'signal' must be a name or a number")
    if not 1 <= int(sig) < 65:
        raise bad_request("signal %r out of range" % value)
    return int(sig)
