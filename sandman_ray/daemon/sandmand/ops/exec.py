"""``exec``: a command, once; and the start of a command with pipes, which ``spawn``
shares."""

import os
import time

from ..fields import RequestError, as_bytes, check_argv, env_field, field, number_field
from ..spawn import (
    STREAM_PIPE_BYTES, Capture, PipeReader, cloexec_pipe, exit_code, grow_pipe, plain_argv, spawn,
    write_and_close)
from ..wire import DEFAULT_KILL_GRACE_S, MAX_STREAM_CAP

UNCAPPED = float(1 << 62)  # streamed output: as much as the command writes


class ExecOps:
    """The Daemon's ``exec`` (a mixin: the state is the Daemon's)."""

    def op_exec(self, req, reply):
        """Callback-driven (no task): the reply is sent from the exit notification, so a
        short command costs two loop iterations beyond its own run time."""
        cmd = req["cmd"]
        if len(req) == 3:  # op, id, cmd: every option at its default (the common case)
            timeout = cwd = None
            env, stdin, cap, grace, stream = self.env, b"", self.default_cap, DEFAULT_KILL_GRACE_S, False
        else:
            timeout = number_field(req, "timeout", None)
            cwd = field(req, "cwd")
            env = env_field(req, self.env)
            stdin = field(req, "stdin", b"")
            stream = field(req, "stream", False)
            # streamed output is paced by the client's reading, not kept: no cap unless
            # one is asked for
            cap = number_field(req, "max_output", UNCAPPED if stream else self.default_cap,
                               0, UNCAPPED if stream else MAX_STREAM_CAP)
            cap = int(cap)
            grace = number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60)
        run = ExecRun(self, reply, grace)
        if stream:
            out = Capture(cap, lambda chunk: run.emit("stdout", chunk))
            err = Capture(cap, lambda chunk: run.emit("stderr", chunk))
        else:
            out, err = Capture(cap), Capture(cap)
        run.out, run.err = out, err
        run.pid, run.readers, stdin_w = self._start_command(cmd, env, cwd, bool(stdin),
                                                            out.add, err.add, run.exited,
                                                            big_pipes=stream)
        if stdin:
            self.loop.create_task(write_and_close(self.loop, stdin_w, as_bytes(stdin)))
        if timeout is not None:
            run.timer = self.loop.call_later(timeout, run.time_out)
        reply.on_cancel = run.cancel

    def _start_command(self, cmd, env, cwd, with_stdin, out_sink, err_sink, on_exit=None,
                       big_pipes=False):
        """Start a command given as a shell string or an argv list: a plain string runs
        without a shell when its program exists."""
        if isinstance(cmd, str):
            argv = plain_argv(cmd)
            if argv is not None:
                try:
                    return self._start(argv, env, cwd, with_stdin, out_sink, err_sink, on_exit,
                                       big_pipes)
                except FileNotFoundError:
                    pass
            return self._start(["/bin/sh", "-c", cmd], env, cwd, with_stdin, out_sink,
                               err_sink, on_exit, big_pipes)
        check_argv(cmd)
        try:
            return self._start(list(cmd), env, cwd, with_stdin, out_sink, err_sink, on_exit,
                               big_pipes)
        except FileNotFoundError as exc:
            if cwd is not None and not os.path.isdir(cwd):
                raise
            raise RequestError("FileNotFoundError", "command not found: %r (%s)" % (cmd[0], exc))

    def _start(self, argv, env, cwd, with_stdin, out_sink, err_sink, on_exit=None,
               big_pipes=False):
        """Spawn with pipes for stdout/stderr (and stdin when asked). Returns the pid,
        the pipe readers and the stdin write end (or None); ``on_exit(status)`` is called
        when it exits (``self.children.waiting[pid]`` resolves then too). ``big_pipes``:
        output pipes of STREAM_PIPE_BYTES, read in chunks of that size (streamed output:
        fewer, larger events)."""
        out_r, out_w = cloexec_pipe()
        err_r, err_w = cloexec_pipe()
        chunk = 65536
        if big_pipes:
            chunk = grow_pipe(out_w, STREAM_PIPE_BYTES)
            grow_pipe(err_w, STREAM_PIPE_BYTES)
        in_r, in_w = cloexec_pipe() if with_stdin else (self.devnull, None)
        try:
            pid = spawn(argv, env, cwd, in_r, out_w, err_w, self)
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, in_r):
                if fd != self.devnull:
                    os.close(fd)
        self.children.watch(pid, on_exit)
        readers = [PipeReader(self.loop, out_r, out_sink, chunk),
                   PipeReader(self.loop, err_r, err_sink, chunk)]
        return pid, readers, in_w


class ExecRun:
    """One ``exec`` in flight: answers its request when the command exits. Streamed
    output is paced by the client: while the connection's unsent replies are over its
    high-water mark, the command's pipes are not read (so the command waits on its
    writes) and the reply waits for what is left in them."""

    def __init__(self, daemon, reply, grace):
        self.daemon, self.reply, self.grace = daemon, reply, grace
        self.out = self.err = None
        self.start = time.monotonic()
        self.ooms = daemon.oom_count()
        self.pid = None
        self.readers = ()
        self.timer = None
        self.timed_out = False
        self.killing = None  # the terminate task after a timeout
        self.paused = False  # the client lags: the pipes are not read
        self.status = None  # the exit status, while the reply waits for the client

    def emit(self, name, chunk):
        reply = self.reply
        reply.event(name, chunk)
        writable = reply.conn.writable
        if not writable.is_set() and not self.paused and not reply.done:
            self.paused = True
            for reader in self.readers:
                reader.pause()
            writable.wait().add_done_callback(self._resume)

    def _resume(self, _ready):
        self.paused = False
        for reader in self.readers:
            reader.resume()
        if self.status is not None:
            self.exited(self.status)

    def exited(self, status):
        if self.killing is not None and not self.killing.done():
            # timed out: answer once the whole tree is gone, not when its leader is
            self.killing.add_done_callback(lambda _task: self.exited(status))
            return
        if self.timer is not None:
            self.timer.cancel()
        for reader in self.readers:
            reader.drain()
        if self.paused:  # the client has not taken the output yet: answer after it
            self.status = status
            return
        code, sig = exit_code(status)
        out, err = self.out, self.err
        self.reply.ok({"exit_code": code, "signal": sig, "timed_out": self.timed_out,
                       "duration_s": time.monotonic() - self.start,
                       "oom_killed": self.daemon.oom_killed_since(self.ooms),
                       "stdout": bytes(out.data), "stderr": bytes(err.data),
                       "stdout_truncated": out.truncated, "stderr_truncated": err.truncated,
                       "truncated": out.truncated or err.truncated})
        for reader in self.readers:  # after the reply: closing is not on its path
            reader.close()

    def time_out(self):
        self.timed_out = True
        self.killing = self.daemon.loop.create_task(self.daemon.terminate([self.pid], self.grace))

    def cancel(self):
        """The client went away: stop the command at once."""
        if self.pid in self.daemon.children.waiting:
            self.daemon.loop.create_task(self.daemon.terminate([self.pid], 0))
