"""The Daemon: the state every op shares (sessions, processes, connections, the
sandbox's environment), and its lifecycle: listen, accept, serve, stop everything."""

import errno
import os
import sys
import time

import _signal as signal  # the C module: signal.py would import enum (~10 ms)
import _socket            # likewise socket.py

from . import attrs
from .commands import Commands
from .connection import Connection, refuse
from .fields import RequestError, bad_request, env_field, number_field
from .loop import Loop, resolve_once, wait_all
from .ops.exec import ExecOps
from .ops.files import FileOps, open_regular
from .ops.procs import ProcessOps
from .ops.sessions import SessionOps
from .ops.terminals import TerminalOps
from .ops.watches import WatchOps
from .spawn import (
    DEFAULT_PATH, HAS_PIDFD, Children, encode_env, group_exists, kill_all, process_exists, sandbox_pids,
    signal_tree)
from .wire import (
    DEFAULT_KILL_GRACE_S, HELLO_TIMEOUT_S, KILL_SETTLE_S, MAX_UNAUTHENTICATED, OPS,
    PROTOCOL_VERSION)


OS_RELEASE_MAX = 64 * 1024  # what info() reads of /etc/os-release
# Where a container (a cgroup namespace of its own) sees its memory cgroup's counters.
OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")


def oom_kills(path):
    """The OOM kill count in a cgroup's ``memory.events`` (v2) or ``memory.oom_control``
    (v1) at ``path``; None if it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            return _oom_count(fh.read(4096))
    except OSError:
        return None


def _oom_count(text):
    """The ``oom_kill N`` line's count (not ``oom_kill_disable``, ``oom_group_kill``)."""
    at = text.find(b"\noom_kill ") + 1 if not text.startswith(b"oom_kill ") else 0
    if at == 0 and not text.startswith(b"oom_kill "):
        return None
    end = text.find(b"\n", at)
    try:
        return int(text[at + 9:end if end >= 0 else len(text)])
    except ValueError:
        return None


class OomCounter:
    """The sandbox's OOM kill counter, kept open and read again from its start for each
    command (an open and a close per read cost ~25 us of a ~0.9 ms ``exec true``)."""

    def __init__(self, path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.fd = None

    def count(self):
        if self.fd is not None:
            try:
                return _oom_count(os.pread(self.fd, 4096, 0))
            except OSError:
                pass
        return oom_kills(self.path)


class Daemon(ExecOps, SessionOps, ProcessOps, FileOps, TerminalOps, WatchOps):
    """The daemon's state, its lifecycle and the ops of the daemon itself (ping, info,
    shutdown); the other ops come from the mixins of ops/."""

    def __init__(self, token, workdir, default_cap, hello_timeout_s=HELLO_TIMEOUT_S,
                 env=None):
        self.token = token  # the lease's; None while a renew runs
        self.admin_token = None  # the launcher's, for renew (None: no renew)
        self.skeleton = None  # the root the daemon started in, when it runs in --root
        self.settings = attrs.settings()  # what a renew checks no tenant changed
        self.hello_timeout_s = hello_timeout_s
        self.workdir = workdir
        self.default_cap = default_cap
        self.started = time.time()
        # the sandbox's environment, for the commands it starts (``env``: handed over
        # by the launcher, not the daemon's own; else the one it was started with)
        self.base = (dict(env) if env is not None else base_environment(), workdir)
        self._use_env(self.base[0])
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # see _refuse_one
        self.loop = None
        self.children = None
        self.sessions = {}
        self.procs = {}
        self.terminals = {}
        self.next_terminal = 1  # the next terminal's id (per lease)
        self.commands = Commands()  # commands that carried an id (exactly once)
        self.uploads = 0  # open on all connections (each holds its own)
        self.next_upload = 1
        self.server = None
        self.socket_path = None
        self.stopping = None
        self.connections = set()
        self.unauthenticated = 0  # of those, the ones that have not said hello
        self.applied_limits = {}
        self.user = None  # (uid, gid) to drop to once listening
        self.socket_mode = 0o600
        self.oom_counter = None  # an OomCounter: the sandbox's OOM kill count, if any
        self.recv_buffer = bytearray(262144)
        self.recv_view = memoryview(self.recv_buffer)

    def _use_env(self, env):
        """``env`` for the commands started from now on."""
        self.env = dict(env)
        self.env.setdefault("PATH", DEFAULT_PATH)
        self.env_list = encode_env(self.env)  # as a spawn takes it (self.env is replaced,
        self.path = self.env["PATH"]  # never changed in place)
        os.environ["PATH"] = self.path  # what posix_spawnp searches

    # ---- lifecycle
    def run(self, listen, ready_fd):
        """Serve until shutdown, SIGTERM or SIGINT; then stop every process."""
        self.loop = Loop()
        self.stopping = self.loop.create_future()
        self.children = Children(self.loop)
        if os.getpid() == 1 or not HAS_PIDFD:
            # As PID 1 we must reap orphans; without pidfds SIGCHLD is how we learn of
            # exits. Otherwise each child's pidfd suffices, and skipping SIGCHLD saves
            # two loop wake-ups per command.
            self.children.reap_on_sigchld()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.request_stop, 0.5)
        self.children.reap()  # anything that exited before the handler was installed
        address = self._listen(listen)
        if self.user is not None:
            self._drop_privileges()
        if ready_fd is not None:
            os.write(ready_fd, (address + "\n").encode())
            os.close(ready_fd)
        self.loop.run_until(self.stopping)
        self.loop.run_until(self.loop.create_task(self._stop_everything()))

    def _listen(self, listen):
        kind, _, where = listen.partition(":")
        if kind == "fd":
            # a socket its launcher bound and listens on: outside the sandbox's reach,
            # it cannot be moved aside or replaced from inside
            sock = _socket.socket(-1, -1, -1, int(where))
            name = sock.getsockname()
            address = "unix:" + name if isinstance(name, str) else "tcp:%s:%d" % name[:2]
            kind = "unix" if isinstance(name, str) else "tcp"
        elif kind == "unix":
            # Bound and listening under a temporary name, then renamed: whoever sees
            # the socket's path can connect (a launcher outside the sandbox may wait for
            # the path to appear).
            building = where + ".new"
            try:
                os.unlink(building)
            except FileNotFoundError:
                pass
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            old = os.umask(0o077)  # the socket is born 0600: only its owner may connect
            try:
                sock.bind(building)
            finally:
                os.umask(old)
            os.chmod(building, self.socket_mode)
            if self.user is not None:
                os.chown(building, self.user[0], self.user[1])
            sock.listen(1024)
            os.rename(building, where)
            self.socket_path = where
            address = "unix:" + where
        elif kind == "tcp":
            host, _, port = where.rpartition(":")
            sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            sock.bind((host or "127.0.0.1", int(port)))
            bound = sock.getsockname()
            address = "tcp:%s:%d" % (bound[0], bound[1])
        else:
            raise SystemExit("sandmand: --listen must be unix:PATH, tcp:HOST:PORT or fd:N, "
                             "got %r" % listen)
        sock.listen(1024)
        sock.setblocking(False)
        self.server = sock
        self.tcp = kind == "tcp"
        self.loop.add_reader(sock.fileno(), self._accept)
        return address

    def _accept(self):
        while True:
            try:
                fd, _ = self.server._accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._refuse_one():
                    continue
                return  # the client already left, or no one is waiting
            sock = _socket.socket(self.server.family, _socket.SOCK_STREAM, 0, fd)
            if self.unauthenticated >= MAX_UNAUTHENTICATED:
                refuse(sock, "LimitExceeded", "%d connections are waiting to say hello"
                        % self.unauthenticated)
                continue
            if self.tcp:
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            Connection(self, sock)

    def _refuse_one(self):
        """Out of fds: accept one waiting connection on the fd kept spare for this, tell
        it why and close it; whether there was one (accept fails with EMFILE whether or
        not a connection waits). The client learns at once instead of at its hello
        timeout, and the listening socket, left readable, would wake the loop without
        end."""
        if self.spare_fd is None:
            return False
        os.close(self.spare_fd)
        self.spare_fd = None
        try:
            fd, _ = self.server._accept()
        except OSError:
            fd = None
        if fd is not None:
            refuse(_socket.socket(self.server.family, _socket.SOCK_STREAM, 0, fd),
                    "LimitExceeded", "the daemon is out of file descriptors (%d "
                    "connections open)" % len(self.connections))
        self.spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return fd is not None

    def _drop_privileges(self):
        uid, gid = self.user
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    def request_stop(self, grace_s):
        if not self.stopping.done():
            self.stopping.set_result(grace_s)

    async def _stop_everything(self):
        grace = self.stopping.result()
        self.loop.remove_reader(self.server.fileno())
        self.server.close()
        for conn in list(self.connections):
            conn.close()
        pids = [s.pid for s in self.sessions.values() if s.alive]
        pids += [p.pid for p in self.procs.values() if p.running]
        pids += list(self.children.waiting)
        pid1 = os.getpid() == 1
        if pid1:  # forward TERM to everything else that lives in the sandbox
            kill_all(signal.SIGTERM)
        await self.terminate(pids, grace)
        if pid1:
            kill_all(signal.SIGKILL)
        if self.socket_path is not None:
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass

    async def terminate(self, pids, grace_s):
        """TERM the process groups and descendants of ``pids``; KILL what is left after
        the grace. A pid already reaped is only addressed as a process group (which
        keeps its id reserved while any member lives), never as a single pid."""
        waiting = self.children.waiting
        trees = {pid: signal_tree(pid, signal.SIGTERM, alive=pid in waiting) for pid in pids}
        pending = [waiting[p] for p in pids if p in waiting]
        if pending:
            await wait_all(self.loop, pending, grace_s)
        for pid, tree in trees.items():
            for target in tree:
                try:
                    os.kill(target, signal.SIGKILL)
                except OSError:
                    pass
            signal_tree(pid, signal.SIGKILL, alive=pid in waiting)
        # Killed processes that are not our children exit a moment later, and nothing
        # tells us when: look in /proc until they are gone (bounded), so that a caller
        # told "timed out" finds nothing of the command left.
        remaining = [t for tree in trees.values() for t in tree]
        deadline = time.monotonic() + KILL_SETTLE_S
        while remaining and time.monotonic() < deadline:
            remaining = [t for t in remaining if process_exists(t)]
            if remaining:
                await self._tick()
        if os.getpid() == 1:
            # As the sandbox's reaper, also wait for every member of the commands'
            # process groups (each command leads its own), including those forked after
            # the tree was read (a fork bomb), and reap them: until then they hold slots
            # of the sandbox's pids limit, and the next command could not start.
            groups = list(pids)
            deadline = time.monotonic() + KILL_SETTLE_S
            while groups and time.monotonic() < deadline:
                self.children.reap()
                groups = [g for g in groups if group_exists(g)]
                for group in groups:
                    try:
                        os.killpg(group, signal.SIGKILL)
                    except OSError:
                        pass
                if groups:
                    await self._tick()

    async def _tick(self):
        tick = self.loop.create_future()
        self.loop.call_later(0.005, resolve_once, tick)
        await tick

    # ---- the daemon's own ops
    def op_ping(self, req):
        return None

    def op_info(self, req):
        return {
            "pid": os.getpid(), "pid1": os.getpid() == 1,
            "uptime_s": time.time() - self.started,
            "python": sys.version.split()[0],
            "os_release": read_os_release(),
            "hostname": _socket.gethostname(),
            "uid": os.getuid(), "gid": os.getgid(),
            "workdir": self.workdir,
            "cpu_count": os.cpu_count(),
            "limits": dict(read_limits(), applied=self.applied_limits),
            "sessions": sorted(self.sessions),
            "processes": sum(1 for p in self.procs.values() if p.running),
            "protocol": PROTOCOL_VERSION,
        }

    def op_cancel(self, req, conn):
        """Give up a request in flight on this connection: its command is killed."""
        return {"cancelled": conn.cancel(req["target"])}

    async def op_shutdown(self, req):
        grace = number_field(req, "kill_grace_s", DEFAULT_KILL_GRACE_S, 0, 60)
        self.loop.call_soon(self.request_stop, grace)
        return None

    def op_bind(self, req):
        """The lease's own settings, over the sandbox's as it started: ``env`` (names to
        values, over the sandbox's environment) and ``workdir`` (made when missing,
        with its parents) for every command started from now on, until a renew."""
        env = env_field(req, self.base[0])
        workdir = req.get("workdir")
        if workdir is not None and (not workdir.startswith("/") or "\0" in workdir):
            raise bad_request("bind: workdir must be an absolute path, got %r" % workdir)
        workdir = workdir or self.base[1]
        try:
            os.makedirs(workdir, exist_ok=True)
            os.chdir(workdir)
        except OSError as exc:
            raise RequestError("BadRequest", "bind: workdir %s: %s"
                               % (workdir, exc.strerror or exc)) from None
        self.workdir = workdir
        self._use_env(env)
        return {"workdir": workdir}

    async def op_renew(self, req, reply):
        """The sandbox for its next lease, in two steps around the launcher's own work.
        ``quiet``: no lease token is valid any more, every other connection is closed,
        every process of the sandbox but the daemon is killed (and reaped), and every
        session and background process is forgotten; answers how many processes are
        left (0, or the launcher starts the sandbox afresh). ``enter``: the daemon
        moves into ``root`` (a path of the root it started in, where the launcher
        mounted the new writable layer) and takes ``token`` as the lease's."""
        phase = req["phase"]
        if self.skeleton is None:
            raise RequestError("BadRequest", "this daemon was not started with --root: "
                               "it cannot renew its sandbox")
        if phase == "quiet":
            self.token = None
            for conn in list(self.connections):
                if conn is not reply.conn:
                    conn.close()
            pids = [s.pid for s in self.sessions.values() if s.alive]
            pids += [p.pid for p in self.procs.values() if p.running]
            pids += list(self.children.waiting)
            await self.terminate(pids, 0)
            left = await self._kill_the_rest()
            self.sessions.clear()
            for proc in self.procs.values():
                proc.close_stdin()
            self.procs.clear()
            await self.close_terminals()
            # new objects, not emptied ones: what the last lease still finishes (a
            # queued session run draining) goes to its own, forgotten, state
            self.commands = Commands()
            self.terminals = {}
            self.next_terminal = 1
            self.next_upload = 1
            self.workdir = self.base[1]  # a lease's bind is forgotten (``enter`` goes
            self._use_env(self.base[0])  # into the workdir)
            # an op's thread of the last lease still at work would go on in the next
            # tenant's root; what a tenant may set on this process would stay with it
            busy = await self._threads_done()
            changed = attrs.changed(self.settings, attrs.settings())
            return {"left": left + busy + len(changed), "threads": busy, "changed": changed}
        if phase == "enter":
            root, token, admin = req.get("root"), req.get("token"), req.get("admin")
            if not root or not token or not admin:
                raise bad_request("renew enter needs root, token and admin")
            os.fchdir(self.skeleton)
            os.chroot("./" + root.lstrip("/"))  # from the skeleton, not from the root
            try:
                os.chdir(self.workdir)
            except OSError:
                os.chdir("/")
            self.token, self.admin_token = token, admin
            return None
        raise bad_request("renew: phase must be quiet or enter, got %r" % phase)

    async def _threads_done(self):
        """Wait (up to KILL_SETTLE_S) until no op runs on a thread of its own; how many
        still do."""
        import threading
        deadline = time.monotonic() + KILL_SETTLE_S
        while threading.active_count() > 1 and time.monotonic() < deadline:
            await self._tick()
        return threading.active_count() - 1

    async def _kill_the_rest(self):
        """SIGKILL every process of the sandbox but the daemon (and PID 1), until none
        is left or KILL_SETTLE_S passed (a process that forks as it is killed); how
        many are left."""
        me = os.getpid()
        deadline = time.monotonic() + KILL_SETTLE_S
        while True:
            kill_all(signal.SIGKILL)
            self.children.reap()
            others = [pid for pid in sandbox_pids() if pid not in (me, 1)
                      and process_exists(pid)]
            if not others or time.monotonic() >= deadline:
                return len(others)
            await self._tick()

    # ---- the sandbox's OOM kill counter
    def oom_count(self):
        """The sandbox's OOM kill count now (None without a counter)."""
        return None if self.oom_counter is None else self.oom_counter.count()

    def oom_killed_since(self, before):
        """Whether the kernel's OOM killer killed a process of the sandbox since the count
        was ``before``: the command, one of its children, or any other process of the
        sandbox killed meanwhile (the counter is the sandbox's, not the command's)."""
        if before is None:
            return False
        after = self.oom_count()
        return after is not None and after > before


def read_os_release():
    """/etc/os-release (or /usr/lib/os-release) as a dict: at most 64 KiB of it, and
    only from a regular file (the tenant's FIFO in its place is skipped, not waited
    on)."""
    info = {}
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            with open_regular(path) as fh:
                text = fh.read(OS_RELEASE_MAX).decode("utf-8", "replace")
        except (OSError, RequestError):
            continue
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and not key.startswith("#"):
                info[key] = value.strip().strip("'\"")
        break
    return info


def read_limits():
    """What this sandbox is limited by, as seen from inside: rlimits and cgroup files."""
    import resource
    rlimits = {}
    for name in ("AS", "CPU", "NOFILE", "NPROC", "FSIZE", "DATA", "STACK"):
        soft, hard = resource.getrlimit(getattr(resource, "RLIMIT_" + name))
        rlimits[name.lower()] = [None if soft == resource.RLIM_INFINITY else soft,
                                 None if hard == resource.RLIM_INFINITY else hard]
    cgroup = {}
    for key, path in (("memory_max", "/sys/fs/cgroup/memory.max"),
                      ("memory_max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                      ("pids_max", "/sys/fs/cgroup/pids.max"),
                      ("pids_max", "/sys/fs/cgroup/pids/pids.max"),
                      ("cpu_max", "/sys/fs/cgroup/cpu.max"),
                      ("cpu_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us")):
        try:
            with open(path) as fh:
                cgroup.setdefault(key, fh.read().strip())
        except OSError:
            continue
    return {"rlimits": rlimits, "cgroup": cgroup}


def base_environment():
    """The environment the daemon was started with, read from /proc/self/environ: the
    interpreter may have added variables (locale coercion sets LC_CTYPE) that commands
    in the sandbox must not inherit. SANDMAN_* variables (the token) are removed. (A
    launcher that keeps the sandbox's environment out of the daemon's own hands it
    over with --env-fd instead: ``decode_environ``.)"""
    try:
        with open("/proc/self/environ", "rb") as fh:
            return decode_environ(fh.read())
    except OSError:
        env = dict(os.environ)
    for key in [k for k in env if k.startswith("SANDMAN_")]:
        del env[key]
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def decode_environ(raw):
    """An environment from NUL-separated ``KEY=VALUE`` entries (/proc/PID/environ's
    form), SANDMAN_* variables left out, PATH defaulted."""
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key and not key.startswith(b"SANDMAN_"):
            env[os.fsdecode(key)] = os.fsdecode(value)
    env.setdefault("PATH", DEFAULT_PATH)
    return env


# The dispatch table: every op of the wire's table that the daemon answers, with the
# method that answers it, its kind and its schema (checked before the method runs).
Daemon.handlers = {op.name: (getattr(Daemon, "op_" + op.name), op.kind, op)
                   for op in OPS if op.kind not in ("hello", "composite")}
