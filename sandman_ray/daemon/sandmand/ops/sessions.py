"""Shell sessions: a persistent shell per name, whose commands run in the shell itself
(``session_open``, ``run``, ``session_close``, ``session_list``)."""

import os
import time

import _signal as signal  # the C module: signal.py would import enum (~10 ms)

from ..fields import RequestError, env_field, field, number_field
from ..loop import CancelledError, Lock, wait_all
from ..spawn import (
    Capture, PipeReader, cloexec_pipe, descendants, exit_code, spawn, which, write_pipe)
from ..wire import DEFAULT_KILL_GRACE_S, MAX_STREAM_CAP


class SessionOps:
    """The Daemon's session ops (a mixin: the state is the Daemon's, ``self.sessions``)."""

    async def op_session_open(self, req):
        name = field(req, "session", "default")
        if name in self.sessions and self.sessions[name].alive:
            raise RequestError("SessionExists", "session %r is already open" % name)
        env = env_field(req, self.env)
        shell = field(req, "shell") or which("bash", env) or "/bin/sh"
        cwd = field(req, "cwd")
        session = Session(self, name, shell, env, cwd)
        self.sessions[name] = session
        return {"session": name, "shell": shell, "pid": session.pid}

    def op_run(self, req, reply):
        """Callback-driven when the shell is free (the common case): the reply is sent
        from the sentinel's arrival, without a task, as ``exec`` does. A command sent
        while another runs queues behind it in a task."""
        name = field(req, "session", "default")
        cmd = req["cmd"]
        if len(req) == 4 and "session" in req:  # op, id, session, cmd: the common case
            timeout, cap, grace = None, self.default_cap, DEFAULT_KILL_GRACE_S
        else:
            timeout = number_field(req, "timeout", None)
            cap = int(number_field(req, "max_output", self.default_cap, 0, MAX_STREAM_CAP))
            grace = number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60)
        session = self.sessions.get(name)
        if session is None:
            if name != "default":
                raise RequestError("SessionNotFound", "no session named %r" % name)
            session = self.sessions[name] = Session(self, name, which("bash", self.env)
                                                    or "/bin/sh", self.env, None)
        if session.lock.try_acquire():
            session.start(cmd, timeout, cap, grace, reply)
        else:
            task = self.loop.create_task(session.start_when_free(cmd, timeout, cap, grace,
                                                                 reply))
            reply.on_cancel = task.cancel

    async def op_session_close(self, req):
        name = field(req, "session", "default")
        session = self.sessions.pop(name, None)
        if session is None:
            raise RequestError("SessionNotFound", "no session named %r" % name)
        await session.close(number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60))
        return {"session": name, "exit_code": session.exit_code}

    def op_session_list(self, req):
        return [{"session": s.name, "pid": s.pid, "shell": s.shell, "alive": s.alive}
                for s in self.sessions.values()]


class Session:
    """A long-lived shell. Each command is followed by a ``printf`` of a random
    sentinel and the exit code to stdout, so the shell itself says when the command
    ended: no prompt scraping, no polling. By then everything the command wrote to
    stderr is in the stderr pipe, which is read to its end without waiting. The
    command runs in the shell's own context (``command eval``), so cwd, variables and
    functions persist; its stdin is /dev/null.

    bash reads its commands from the pipe one byte at a time, and opening /dev/null
    for each command costs as much again: what the shell reads per command is kept
    short, and bash keeps /dev/null open on fd 253 (``STDIN_FD``) to lend to each
    command. Other shells (sh, ash) accept only one-digit fds, and open /dev/null, as
    bash does under an open-file limit of 253 or less."""

    def __init__(self, daemon, name, shell, env, cwd):
        self.daemon, self.name, self.shell = daemon, name, shell
        self.lock = Lock(daemon.loop)
        self.exit_code = None
        self.current = None
        in_r, self.stdin = cloexec_pipe()
        os.set_blocking(self.stdin, False)
        out_r, out_w = cloexec_pipe()
        err_r, err_w = cloexec_pipe()
        bash = shell.endswith("bash")
        argv = [shell, "--noprofile", "--norc"] if bash else [shell]
        # an fd at or over the open-file limit cannot be opened (SC_OPEN_MAX: the limit)
        keep = bash and os.sysconf("SC_OPEN_MAX") > STDIN_FD
        self.stdin_redirect = "<&%d" % STDIN_FD if keep else "</dev/null"
        try:
            if keep:  # in the pipe before any command, so first when the shell reads
                os.write(self.stdin, b"exec %d</dev/null\n" % STDIN_FD)
            self.pid = spawn(argv, env, cwd, in_r, out_w, err_w, daemon)
        except BaseException:
            for fd in (self.stdin, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        self.exited = daemon.children.watch(self.pid)
        self.exited.add_done_callback(self._on_exit)
        self.readers = [PipeReader(daemon.loop, out_r, lambda c: self._feed(0, c)),
                        PipeReader(daemon.loop, err_r, lambda c: self._feed(1, c))]

    @property
    def alive(self):
        return not self.exited.done()

    def _on_exit(self, fut):
        self.exit_code = exit_code(fut.result())[0]
        for reader in self.readers:
            reader.drain()
            reader.close()
        os.close(self.stdin)
        if self.current is not None and not self.current.finished.done():
            self.current.flush()
            self.current.done(False)

    def _feed(self, index, chunk):
        run = self.current
        if run is None or run.finished.done():
            return  # output of background jobs, not of a command
        if index == 1:
            run.err.add(chunk)
        elif run.feed(chunk):
            # the command is over, so all its stderr is in the pipe: read it now (a
            # pipe holds at most 1 MiB unless CAP_SYS_RESOURCE, dropped in sandboxes)
            self.readers[1].drain(max_reads=32)
            run.done(True)

    def start(self, cmd, timeout, cap, grace, reply):
        """Run ``cmd`` (the lock is held, and passed to the SessionRun that answers)."""
        try:
            if not self.alive:
                raise RequestError("SessionClosed", "session %r has exited (code %s)"
                                   % (self.name, self.exit_code))
            run = self.begin(cmd, cap)
        except BaseException:
            self.lock._release()
            raise
        SessionRun(self, run, reply, timeout, grace)

    async def start_when_free(self, cmd, timeout, cap, grace, reply):
        """A command sent while another runs: waits for the shell, then as ``start``."""
        try:
            await self.lock.__aenter__()
        except CancelledError:  # the client went away while it waited
            reply.abandon()
            return
        try:
            self.start(cmd, timeout, cap, grace, reply)
        except Exception as exc:
            reply.fail(exc)

    def begin(self, cmd, cap):
        """Hand ``cmd`` to the shell; returns its _SessionCommand."""
        run = self.current = _SessionCommand(self.daemon.loop, cap)
        run.ooms = self.daemon.oom_count()
        # $? on the second line is the status of the eval
        script = ("command eval %s %s\ncommand printf '%s%%d\\n' $?\n"
                  % (shell_quote(cmd), self.stdin_redirect, run.sentinel_text)).encode()
        try:
            written = os.write(self.stdin, script)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            self.current = None
            raise RequestError("SessionClosed", "the shell of session %r is gone: %s"
                               % (self.name, exc))
        if written < len(script):  # the pipe is full: the rest goes as the shell reads
            self.daemon.loop.create_task(self._write_rest(script[written:]))
        return run

    async def _write_rest(self, data):
        try:
            await write_pipe(self.daemon.loop, self.stdin, data)
        except OSError:
            pass  # the shell is gone: its exit ends the command

    def result(self, run, finished, timed_out):
        return {"exit_code": run.exit_code if finished else None,
                "oom_killed": self.daemon.oom_killed_since(run.ooms),
                "stdout": bytes(run.out.data), "stderr": bytes(run.err.data),
                "stdout_truncated": run.out.truncated,
                "stderr_truncated": run.err.truncated,
                "truncated": run.out.truncated or run.err.truncated,
                "timed_out": timed_out, "duration_s": time.monotonic() - run.start,
                "session_alive": self.alive}

    async def _interrupt(self, run, grace):
        """Stop the running command but keep the shell: TERM, then KILL, the shell's
        descendants; if the shell itself is busy (a builtin loop), kill the session."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in descendants(self.pid):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            await wait_all(self.daemon.loop, [run.finished], grace)
            if run.finished.done():
                return run.finished.result()
        await self.daemon.terminate([self.pid], 0)
        await self.exited
        return False

    async def close(self, grace):
        if self.alive:
            await self.daemon.terminate([self.pid], grace)
            await self.exited


class SessionRun:
    """A session command started without a task: answers when the shell writes its
    sentinels, or interrupts it on timeout. The session's lock is held until the
    command is over, even when the client went away, so the next command never reads
    this one's output."""

    def __init__(self, session, run, reply, timeout, grace):
        self.session, self.run, self.reply, self.grace = session, run, reply, grace
        self.timer = None
        self.interrupting = False
        run.on_done = self.finished
        if timeout is not None:
            self.timer = session.daemon.loop.call_later(timeout, self.time_out)

    def finished(self, finished):
        if self.interrupting:
            return  # the interrupt answers once the shell is settled
        if self.timer is not None:
            self.timer.cancel()
        self.answer(finished, False)

    def time_out(self):
        self.interrupting = True
        task = self.session.daemon.loop.create_task(self.session._interrupt(self.run, self.grace))
        task.add_done_callback(self._interrupted)

    def _interrupted(self, task):
        if task.exception() is not None:
            self._free()
            self.reply.fail(task.exception())
        else:
            self.answer(task.result(), True)

    def answer(self, finished, timed_out):
        self._free()
        self.reply.ok(self.session.result(self.run, finished, timed_out))

    def _free(self):
        """The shell is free for the next command."""
        self.session.current = None
        self.session.lock._release()


class _SessionCommand:
    """Output of one session command; stdout ends at the sentinel written by the shell."""

    def __init__(self, loop, cap):
        # 64 random bits per command: output cannot end a command by accident, not
        # even by printing the sentinels of earlier commands
        self.sentinel_text = _random_hex16()
        self.sentinel = self.sentinel_text.encode()
        self.out, self.err = Capture(cap), Capture(cap)
        self.pending = bytearray()  # stdout held back while it may hold the sentinel
        self.exit_code = None
        self.start = time.monotonic()
        self.ooms = None  # the sandbox's OOM kill count when it started
        self.finished = loop.create_future()
        self.on_done = None  # called with the outcome before ``finished`` is set

    def done(self, finished):
        if not self.finished.done():
            if self.on_done is not None:
                self.on_done(finished)
            self.finished.set_result(finished)

    def feed(self, chunk):
        """Take a chunk of stdout; True once the sentinel and exit code are in."""
        buf = self.pending
        buf += chunk
        at = buf.find(self.sentinel)
        if at < 0:
            keep = len(self.sentinel) - 1
            if len(buf) > keep:
                self.out.add(bytes(buf[:len(buf) - keep]))
                del buf[:len(buf) - keep]
            return False
        end = buf.find(b"\n", at)
        if end < 0:
            return False  # the exit code has not fully arrived yet
        self.exit_code = int(buf[at + len(self.sentinel):end] or b"0")
        self.out.add(bytes(buf[:at]))
        del buf[:]
        return True

    def flush(self):
        """The shell is gone: what was held back while looking for the sentinel is output."""
        self.out.add(bytes(self.pending))
        del self.pending[:]


_random_pool = []


def _random_hex16():
    """64 random bits as 16 hex digits; drawn from the OS 256 at a time."""
    if not _random_pool:
        block = os.urandom(2048).hex()
        _random_pool.extend(block[i:i + 16] for i in range(0, 4096, 16))
    return _random_pool.pop()


STDIN_FD = 253  # bash sessions: /dev/null, lent to each command as its stdin


def shell_quote(text):
    return "'" + text.replace("'", "'\\''") + "'"
