"""Processes: starting commands (posix_spawn, or vfork through _posixsubprocess), knowing
when they exit, signalling their trees, and the pipes and buffers of their output."""

import errno
import os
import sys

import _signal as signal  # the C module: signal.py would import enum (~10 ms)

from .loop import resolve_once


def exit_code(status):
    """(exit code shell-style, signal number or None) from a waitpid status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


def descendants(pid):
    """Pids of every process below ``pid``, from /proc (children of children too)."""
    children = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: parse after the last ')'
        fields = raw[raw.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def sandbox_pids():
    """The pids of the sandbox's pid namespace (its /proc)."""
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def signal_tree(pid, sig, alive=True):
    """Send ``sig`` to ``pid``'s process group and, while ``pid`` itself is alive (not
    yet reaped), to it and every descendant (some may have left the group with setsid).
    Returns the descendants signalled; missing processes are ignored."""
    # the tree first: once the group is signalled its members die and their children
    # are reparented away from ``pid``, out of reach of a later scan
    targets = descendants(pid) if alive else []
    try:
        os.killpg(pid, sig)
    except OSError:
        pass
    if not alive:
        return []
    for target in [pid] + targets:
        try:
            os.kill(target, sig)
        except OSError:
            pass
    return targets


def which(name, env):
    """Resolve a command name on the PATH of ``env`` (None when not found)."""
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    for directory in env.get("PATH", DEFAULT_PATH).split(":"):
        candidate = os.path.join(directory or ".", name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Characters that mean nothing special to a POSIX shell: a command made only of these
# (and spaces) is a plain argv, so it can be started without a shell in between. The
# words below are shell builtins or reserved words whose effect could differ from a
# binary of the same name, so they always go through the shell.
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./,:@%+ ")
_SHELL_WORDS = frozenset(
    "alias bg break cd command continue echo eval exec exit export false fc fg getopts hash "
    "jobs kill let local printf pwd read readonly return set shift source test times trap "
    "type ulimit umask unalias unset wait . time function select if then else elif fi case "
    "esac for while until do done in".split())


def plain_argv(cmd):
    """The argv of a shell string that needs no shell (``true``, ``ls -la /tmp``), or
    None. Starting it directly saves the shell's own start (~0.1 ms of a ~0.6 ms spawn,
    measured here); a name that is not found still goes through the shell, which reports
    it with its usual message and exit code 127."""
    if not cmd or len(cmd) > 4096 or not _PLAIN.issuperset(cmd):
        return None
    argv = cmd.split()
    if not argv or argv[0] in _SHELL_WORDS:
        return None
    return argv


class Children:
    """Knows when each child we started exits. Where the daemon handles SIGCHLD (as
    PID 1, the reaper of orphans, or without pidfds) ``reap`` learns of every exit; else
    a pidfd per child (Linux 5.3+, Python 3.9+) reports it in the same loop iteration.
    (Both at once cost a pidfd_open, an epoll_ctl and a close per command for nothing:
    SIGCHLD's waitpid(-1) reaped the child first.)
    ``watch(pid, callback)``: the callback gets the wait status synchronously, before the
    future resolves, so a reply can be sent without another loop iteration."""

    def __init__(self, loop):
        self.loop = loop
        self.waiting = {}   # pid -> future of its wait status
        self.callbacks = {}
        self.pidfds = {}
        self.use_pidfds = HAS_PIDFD  # False once SIGCHLD reaps (``reap_on_sigchld``)

    def reap_on_sigchld(self):
        """Learn of exits by SIGCHLD from now on (PID 1 must reap orphans anyway)."""
        self.use_pidfds = False
        self.loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def watch(self, pid, callback=None):
        fut = self.loop.create_future()
        self.waiting[pid] = fut
        if callback is not None:
            self.callbacks[pid] = callback
        if self.use_pidfds:
            try:
                fd = os.pidfd_open(pid)  # novermin (only where HAS_PIDFD)
            except OSError:
                return fut
            self.pidfds[pid] = fd
            self.loop.add_reader(fd, self._pidfd_ready, pid)
        return fut

    def _pidfd_ready(self, pid):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped by reap(); resolved there
        if got == pid:
            self._resolve(pid, status)

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            self._resolve(pid, status)

    def _resolve(self, pid, status):
        fut = self.waiting.pop(pid, None)
        callback = self.callbacks.pop(pid, None)
        if callback is not None:
            callback(status)  # first: a reply waits on it; the bookkeeping below does not
        fd = self.pidfds.pop(pid, None)
        if fd is not None:
            self.loop.close_fd(fd)
        if fut is not None and not fut.done():
            fut.set_result(status)


HAS_PIDFD = hasattr(os, "pidfd_open")


def spawn(argv, env, cwd, stdin_fd, stdout_fd, stderr_fd, daemon):
    """Start ``argv`` in a new session (its own process group) with the given fds as
    0, 1, 2 and every other fd closed. The command name is looked up on the PATH of
    ``env``, as execvp does."""
    if _FORK_EXEC is not None:
        try:
            return _vfork_exec(argv, env, cwd, stdin_fd, stdout_fd, stderr_fd, daemon)
        except _SignatureChanged:
            _disable_vfork()
    if cwd is None or cwd == daemon.workdir:
        actions = [(os.POSIX_SPAWN_DUP2, stdin_fd, 0),
                   (os.POSIX_SPAWN_DUP2, stdout_fd, 1),
                   (os.POSIX_SPAWN_DUP2, stderr_fd, 2)]
        if "/" in argv[0]:
            start, path = os.posix_spawn, argv[0]
        elif env.get("PATH") == daemon.path:
            # glibc searches the daemon's own PATH, which is the sandbox's: same answer
            # as which(), without a stat per directory in Python
            start, path = os.posix_spawnp, argv[0]
        else:
            start, path = os.posix_spawn, which(argv[0], env)
            if path is None:
                raise FileNotFoundError(errno.ENOENT, "command not found", argv[0])
        # Python ignores SIGPIPE and SIGXFSZ; exec keeps ignored signals ignored, so
        # restore the defaults (``yes | head`` must end by SIGPIPE as it does elsewhere)
        return start(path, argv, env, file_actions=actions, setsid=True,
                     setsigdef=_RESTORED_SIGNALS)
    import subprocess
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin_fd, stdout=stdout_fd,
                            stderr=stderr_fd, start_new_session=True, close_fds=True)
    proc.returncode = 0  # Children reaps it; keep Popen from ever waiting on a reused pid
    return proc.pid


# CPython 3.11+ starts subprocesses with vfork through _posixsubprocess.fork_exec; its
# child resets only the signal handlers that are set, where glibc's posix_spawn makes
# two syscalls for every signal (~45 us of a ~0.8 ms spawn of ``true``, measured
# here). The call below is the one subprocess.py makes in 3.11 to 3.13; an
# interpreter whose signature differs falls back to posix_spawn for good.
try:
    from _posixsubprocess import fork_exec as _FORK_EXEC
except ImportError:  # pragma: no cover - every CPython on Linux has it
    _FORK_EXEC = None
if sys.version_info < (3, 11):
    _FORK_EXEC = None


class _SignatureChanged(Exception):
    pass


def _disable_vfork():
    global _FORK_EXEC
    _FORK_EXEC = None


_exec_candidates = {}  # PATH -> its directories, encoded


def encode_env(env):
    return [("%s=%s" % item).encode("utf-8", "surrogateescape") for item in env.items()]


def _vfork_exec(argv, env, cwd, stdin_fd, stdout_fd, stderr_fd, daemon):
    name = argv[0].encode("utf-8", "surrogateescape")
    if b"/" in name:
        candidates = (name,)
    else:
        path = env.get("PATH", DEFAULT_PATH)
        dirs = _exec_candidates.get(path)
        if dirs is None:
            dirs = _exec_candidates[path] = tuple(
                (d or ".").encode("utf-8", "surrogateescape") + b"/" for d in path.split(":"))
        candidates = [d + name for d in dirs]
    args = [a.encode("utf-8", "surrogateescape") for a in argv]
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            env_list = daemon.env_list if env is daemon.env else encode_env(env)
            pid = _FORK_EXEC(args, candidates, True, (err_w,), cwd, env_list,
                             stdin_fd, -1, -1, stdout_fd, -1, stderr_fd, err_r, err_w,
                             True, True, -1, None, None, None, -1, None, True)
        except TypeError as exc:
            raise _SignatureChanged(str(exc))
        os.close(err_w)
        err_w = -1
        failure = os.read(err_r, 1024)  # empty once exec closed its end: it started
    finally:
        os.close(err_r)
        if err_w != -1:
            os.close(err_w)
    if not failure:
        return pid
    os.waitpid(pid, 0)  # it exits at once after reporting
    _kind, _, rest = failure.partition(b":")
    code, _, where = rest.partition(b":")
    try:
        number = int(code, 16)
    except ValueError:
        number = errno.EIO
    if where == b"noexec":  # before exec: the working directory
        raise OSError(number, os.strerror(number), cwd)
    raise OSError(number, os.strerror(number), argv[0])


_RESTORED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, n))


def cloexec_pipe():
    return os.pipe2(os.O_CLOEXEC)


class Capture:
    """Bytes of one output stream, kept up to ``cap``; the rest is counted and dropped.
    With ``emit`` the kept bytes are handed on as they come instead of stored."""

    __slots__ = ("cap", "data", "total", "kept", "emit")

    def __init__(self, cap, emit=None):
        self.cap = cap
        self.data = bytearray()
        self.total = 0
        self.kept = 0
        self.emit = emit

    def add(self, chunk):
        self.total += len(chunk)
        room = self.cap - self.kept
        if room > 0:
            piece = chunk[:room]
            self.kept += len(piece)
            if self.emit is None:
                self.data += piece
            else:
                self.emit(piece)

    @property
    def truncated(self):
        return self.total > self.kept


class Ring:
    """The last ``cap`` bytes of a stream, addressed by absolute byte offsets."""

    __slots__ = ("cap", "data", "start", "eof")

    def __init__(self, cap):
        self.cap = cap
        self.data = bytearray()
        self.start = 0
        self.eof = False

    def add(self, chunk):
        self.data += chunk
        excess = len(self.data) - self.cap
        if excess > 0:
            del self.data[:excess]
            self.start += excess

    def read(self, cursor, max_bytes):
        dropped = max(0, self.start - cursor)
        cursor = max(cursor, self.start)
        offset = cursor - self.start
        chunk = bytes(self.data[offset:offset + max_bytes])
        return {"data": chunk, "cursor": cursor + len(chunk), "dropped": dropped,
                "eof": self.eof and offset + len(chunk) >= len(self.data)}


STREAM_PIPE_BYTES = 1024 * 1024  # the pipes of a streamed command's output


def grow_pipe(fd, size):
    """Ask for a pipe buffer of ``size`` bytes (an unprivileged process gets up to
    /proc/sys/fs/pipe-max-size); the size it has."""
    try:
        import fcntl
        return fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except (OSError, ImportError):
        return 65536


F_SETPIPE_SZ = 1031  # Linux's; fcntl names it from Python 3.10


class PipeReader:
    """Reads a non-blocking pipe and hands each chunk to ``sink``; ``pause`` stops
    reading until ``resume``."""

    __slots__ = ("loop", "fd", "sink", "closed", "paused", "chunk")

    def __init__(self, loop, fd, sink, chunk=65536):
        self.loop, self.fd, self.sink, self.chunk = loop, fd, sink, chunk
        self.closed = self.paused = False
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._ready)

    def pause(self):
        if not self.closed and not self.paused:
            self.paused = True
            self.loop.remove_reader(self.fd)

    def resume(self):
        if not self.closed and self.paused:
            self.paused = False
            self.loop.add_reader(self.fd, self._ready)

    def _ready(self):
        """Hand one chunk to ``sink``; False when the pipe has nothing now, or ended."""
        if self.closed:  # a readiness queued in the iteration that drained and closed it:
            return False  # its descriptor number may belong to another file by now
        try:
            chunk = os.read(self.fd, self.chunk)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        if chunk:
            self.sink(chunk)
            return True
        self.close()
        return False

    def drain(self, max_reads=256):
        """Read what is already in the pipe (the writer has exited) without waiting."""
        for _ in range(max_reads):
            if self.closed or self.paused or not self._ready():
                return

    def close(self):
        if not self.closed:
            self.closed = True
            self.loop.close_fd(self.fd)


async def write_pipe(loop, fd, data):
    """Write all of ``data`` to a non-blocking pipe, waiting for room without blocking
    the loop. OSError (EPIPE: the reader is gone) propagates."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(fd, resolve_once, ready)
            try:
                await ready
            finally:
                loop.remove_writer(fd)


async def write_and_close(loop, fd, data):
    """Feed a command's stdin, then close it; a command that exits without reading
    it all just ends the write."""
    os.set_blocking(fd, False)
    try:
        await write_pipe(loop, fd, data)
    except OSError:
        pass
    finally:
        os.close(fd)


def group_exists(pgid):
    """True while any process, a zombie included, is in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def process_exists(pid):
    """True while ``pid`` exists. A zombie counts as gone unless we are PID 1: then we
    are its reaper (the loop reaps it between two looks) and, until we do, it still
    holds a slot of the sandbox's pids limit."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            raw = fh.read()
    except OSError:
        return False
    zombie = raw[raw.rfind(b")") + 2:raw.rfind(b")") + 3] == b"Z"
    return not zombie or os.getpid() == 1


def kill_all(sig):
    try:
        os.kill(-1, sig)  # every process we may signal but ourselves
    except OSError:
        pass
