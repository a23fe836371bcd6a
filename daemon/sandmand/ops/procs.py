"""Background processes: started by ``spawn``, followed by pid, their output kept in
ring buffers (``proc_status``, ``proc_list``, ``proc_output``, ``proc_wait``,
``proc_signal``)."""

import os
import time

import _signal as signal  # the C module: signal.py would import enum (~10 ms)

from ..fields import RequestError, as_bytes, bad_request, env_field, field, number_field
from ..loop import Event, Timeout, wait_for
from ..spawn import Ring, exit_code, signal_tree, write_and_close
from ..wire import MAX_FINISHED_PROCS, MAX_STREAM_CAP, PROC_RING_BYTES


class ProcessOps:
    """The Daemon's process ops (a mixin: the state is the Daemon's, ``self.procs``)."""

    def op_spawn(self, req):
        cmd = req["cmd"]
        env = env_field(req, self.env)
        cwd = field(req, "cwd")
        stdin = field(req, "stdin", b"")
        ring = int(number_field(req, "buffer_bytes", PROC_RING_BYTES, 1, MAX_STREAM_CAP))
        if sum(1 for p in self.procs.values() if p.running) >= 4096:
            raise RequestError("LimitExceeded", "4096 background processes are running")
        proc = Process(cmd, ring, self.loop)
        proc.pid, readers, stdin_w = self._start_command(cmd, env, cwd, bool(stdin),
                                                         proc.out.add, proc.err.add)
        if stdin:
            self.loop.create_task(write_and_close(self.loop, stdin_w, as_bytes(stdin)))
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
        proc.done.set()
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

    def op_proc_signal(self, req):
        proc = self._proc(req)
        sig = signal_number(field(req, "signal", "TERM"))
        if proc.running:
            if field(req, "group", True):
                signal_tree(proc.pid, sig, alive=True)
            else:
                os.kill(proc.pid, sig)
        return proc.status()


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
