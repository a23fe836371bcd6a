"""Terminals: a command on a pseudo-terminal of a given size (``pty_open``), its keys
written (``pty_write``), its output read from a ring by cursor (``pty_read``), resized
(``pty_resize``) and closed with every process it started (``pty_close``). A terminal
belongs to the lease, not to a connection: another connection of the lease finds it
again (``pty_list``)."""

import errno
import os
import time

import _signal as signal  # the C module: signal.py would import enum (~10 ms)

from ..fields import (
    RequestError, as_bytes, bad_request, check_argv, env_field, field, number_field)
from ..loop import Event, Lock, Timeout, resolve_once, wait_for
from ..spawn import Ring, descendants, exit_code, sandbox_pids
from ..wire import KILL_SETTLE_S, MAX_STREAM_CAP, MAX_TERMINALS, TERMINAL_RING_BYTES

MAX_CLOSED_TERMINALS = 16  # closed terminals kept, for their last output

MAX_SIDE = 10000  # columns or rows of a terminal


class TerminalOps:
    """The Daemon's terminal ops (a mixin: the state is the Daemon's, ``self.terminals``)."""

    def op_pty_open(self, req):
        cmd = field(req, "cmd") or [self._shell()]
        cols, rows = _size(field(req, "cols", 80), field(req, "rows", 24))
        env = env_field(req, self.env)
        if "TERM" not in env or env["TERM"] is None:
            env = dict(env, TERM="xterm-256color")
        if sum(1 for t in self.terminals.values() if t.master is not None) >= MAX_TERMINALS:
            raise RequestError("LimitExceeded", "%d terminals are open" % MAX_TERMINALS)
        ring = int(number_field(req, "buffer_bytes", TERMINAL_RING_BYTES, 1, MAX_STREAM_CAP))
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else check_argv(list(cmd))
        term = Terminal(self, self.next_terminal, argv, ring)
        self.next_terminal += 1
        term.open(env, field(req, "cwd"), cols, rows, field(req, "stdin", b""))
        self.terminals[term.id] = term
        return {"pty": term.id, "pid": term.pid}

    def forget_closed_terminals(self):
        """Keep the last MAX_CLOSED_TERMINALS closed terminals (their final output)."""
        closed = [t for t in self.terminals.values() if t.master is None]
        for term in closed[:-MAX_CLOSED_TERMINALS]:
            del self.terminals[term.id]

    def _shell(self):
        from ..spawn import which
        return which("bash", self.env) or "/bin/sh"

    def _terminal(self, req):
        term = self.terminals.get(req["pty"])
        if term is None:
            raise RequestError("TerminalNotFound", "no terminal %d" % req["pty"])
        return term

    async def op_pty_write(self, req):
        await self._terminal(req).write(as_bytes(req["data"]))
        return None

    async def op_pty_read(self, req):
        term = self._terminal(req)
        cursor = max(0, field(req, "cursor", 0))
        max_bytes = int(number_field(req, "max_bytes", TERMINAL_RING_BYTES, 0, MAX_STREAM_CAP))
        timeout = number_field(req, "timeout", 0.0, 0, 3600)
        deadline = time.monotonic() + timeout
        while term.ring.start + len(term.ring.data) <= cursor and not term.ring.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await wait_for(self.loop, term.more.wait(), left)
            except Timeout:
                break
        out = term.ring.read(cursor, max_bytes)
        out.update(term.status())
        return out

    def op_pty_resize(self, req):
        term = self._terminal(req)
        cols, rows = _size(req["cols"], req["rows"])
        if term.master is None:
            raise RequestError("TerminalClosed", "terminal %d is closed" % term.id)
        term.resize(cols, rows)
        return term.status()

    async def op_pty_close(self, req):
        term = self._terminal(req)
        grace = number_field(req, "kill_grace_s", 0.5, 0, 60)
        await term.close(grace)
        self.forget_closed_terminals()
        return term.status()

    def op_pty_list(self, req):
        return [t.status() for t in self.terminals.values()]

    async def close_terminals(self):
        for term in list(self.terminals.values()):
            await term.close(0)
        self.terminals.clear()


def _size(cols, rows):
    if not (1 <= cols <= MAX_SIDE and 1 <= rows <= MAX_SIDE):
        raise bad_request("a terminal's cols and rows must be in [1, %d], got %dx%d"
                          % (MAX_SIDE, cols, rows))
    return cols, rows


class Terminal:
    """A command on a pseudo-terminal: its master side, read into a ring."""

    def __init__(self, daemon, term_id, argv, ring_bytes):
        self.daemon, self.id, self.argv = daemon, term_id, argv
        self.ring = Ring(ring_bytes)
        self.write_lock = Lock(daemon.loop)  # one write at a time, in arrival order
        self.room = None  # the future a write waits on for room in the terminal
        self.tty = None  # the terminal's device number (a process's controlling tty)
        self.more = Event(daemon.loop)  # set when output or the end arrives
        self.master = None
        self.pid = None
        self.cols = self.rows = 0
        self.exit_code = self.signal = None
        self.exited = None  # future of the wait status

    def open(self, env, cwd, cols, rows, stdin):
        master, slave = os.openpty()
        try:
            os.set_inheritable(master, False)
            self.tty = os.fstat(slave).st_rdev
            self.master = master
            self.resize(cols, rows)
            self.pid = _spawn_on_terminal(self.argv, env, cwd, slave)
        except BaseException:
            os.close(master)
            self.master = None
            raise
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        self.exited = self.daemon.children.watch(self.pid, self._ended)
        self.daemon.loop.add_reader(master, self._readable)
        if stdin:
            self.daemon.loop.create_task(self._type(as_bytes(stdin)))

    async def _type(self, data):
        try:
            await self.write(data)
        except RequestError:  # closed first
            pass

    async def write(self, data):
        """Type ``data`` into the terminal, waiting for room as it reads; a close while
        it waits ends it (TerminalClosed), and nothing is written to a later fd."""
        loop = self.daemon.loop
        async with self.write_lock:
            view = memoryview(data)
            while view:
                if self.master is None:
                    raise RequestError("TerminalClosed", "terminal %d is closed" % self.id)
                try:
                    view = view[os.write(self.master, view):]
                except BlockingIOError:
                    self.room = loop.create_future()
                    loop.add_writer(self.master, resolve_once, self.room)
                    try:
                        await self.room
                    finally:
                        self.room = None
                        if self.master is not None:
                            loop.remove_writer(self.master)
                except OSError as exc:
                    if exc.errno != errno.EIO:
                        raise
                    raise RequestError("TerminalClosed",
                                       "terminal %d has no process left" % self.id)

    def resize(self, cols, rows):
        import fcntl
        import struct
        import termios
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.cols, self.rows = cols, rows  # the kernel tells the foreground group (SIGWINCH)

    def _readable(self):
        try:
            chunk = os.read(self.master, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # EIO: no process holds the terminal any more
            chunk = b""
        if chunk:
            self.ring.add(chunk)
        else:
            self.daemon.loop.remove_reader(self.master)
            self.ring.eof = True
        self.more.set()
        self.more.clear()

    def _ended(self, status):
        self.exit_code, self.signal = exit_code(status)
        self.more.set()
        self.more.clear()

    @property
    def running(self):
        return self.exited is not None and not self.exited.done()

    async def close(self, grace_s):
        """Hang up the terminal's command and everything it started (SIGHUP, as a
        terminal that goes away does), close the terminal, then TERM what is left and
        KILL it after ``grace_s``. The tree is read first: a process whose shell dies of
        the hangup is reparented out of its reach."""
        tree = set(descendants(self.pid)) if self.running else set()
        tree.update(self._on_terminal())  # those the leader left behind when it exited
        for target in ([self.pid] if self.running else []) + sorted(tree):
            try:
                os.kill(target, signal.SIGHUP)
            except OSError:
                pass
        if self.master is not None:
            loop = self.daemon.loop
            loop.remove_reader(self.master)
            loop.remove_writer(self.master)
            if self.room is not None and not self.room.done():
                self.room.set_result(None)  # the waiting write ends: TerminalClosed
            os.close(self.master)
            self.master = None
            self.ring.eof = True
            self.more.set()
            self.more.clear()
        # the leader's group, whether or not it was reaped, and what is left of the tree
        await self.daemon.terminate([self.pid], grace_s)
        for target in tree:  # those no longer below it
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        if self.running:
            try:
                await wait_for(self.daemon.loop, self.exited, KILL_SETTLE_S)
            except Timeout:
                pass

    def _on_terminal(self):
        """Pids of the processes of the terminal's session (its leader's pid) whose
        controlling terminal it is (a process that left the session with ``setsid`` is
        not found here). Both must match: another devpts instance's terminal may have
        the same device number."""
        found = []
        for pid in sandbox_pids():
            try:
                with open("/proc/%d/stat" % pid, "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 4 and int(fields[3]) == self.pid and int(fields[4]) == self.tty:
                found.append(pid)
        return found

    def status(self):
        return {"pty": self.id, "pid": self.pid, "cmd": self.argv, "running": self.running,
                "open": self.master is not None, "exit_code": self.exit_code,
                "signal": self.signal, "cols": self.cols, "rows": self.rows,
                "output_bytes": self.ring.start + len(self.ring.data)}


def _spawn_on_terminal(argv, env, cwd, slave):
    """Start ``argv`` as the leader of a new session whose controlling terminal is
    ``slave``, on its fds 0, 1 and 2."""
    import fcntl
    import subprocess
    import termios

    def take_terminal():  # in the child, after setsid: nothing to import there
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, close_fds=True, preexec_fn=take_terminal)
    proc.returncode = 0  # Children reaps it; keep Popen from ever waiting on a reused pid
    return proc.pid
