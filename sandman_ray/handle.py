"""SandboxHandle: what ``acquire`` returns.

A ``SandboxHandle`` names one lease on one host and reads like an actor handle:
``ray.get(sb.exec.remote("ls"))``, ``await sb.run.remote("cd /tmp")``. It pickles, so
it can be passed to tasks and actors. When the handle is garbage collected in the
process that acquired it, and was never passed on, its lease is released once the
calls it sent are answered. As on any Ray actor that runs calls side by side, calls
on one handle that are in flight together may run in either order: wait for the result
of one that a later call depends on (``cd`` before ``pwd`` in a session).

Its calls go to the client's ``HandleHost`` on the sandbox's node (sandman_ray.host), or
directly to the daemon where the handle has a direct path (sandman_ray.direct).
"""

import threading
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

import ray

from sandman_ray.client import ExecStream
from sandman_ray.daemon.sandmand.wire import CodecError, pack
from sandman_ray.direct import Direct, Unreachable
from sandman_ray.errors import LeaseEnded, SandboxPaused
from sandman_ray.host import DESCRIBED, FORWARDED, STREAMED
from sandman_ray import control
from sandman_ray.lookup import (
    call_pool, call_pool_async, control_path, control_path_async, forget_control_path,
    forget_named, get_named, get_pool)

if TYPE_CHECKING:
    from sandman_ray.client.operations import _Operations as _Ops
    from sandman_ray.handle_types import AsyncOp, Op, async_op, op
    from sandman_ray.results import (
        ExecResult, FileStat, Listing, ProcessOutput, ProcessStatus)


class _Method:
    """``handle.<op>``: ``.remote(...)`` gives the call's ObjectRef, as on an actor;
    calling it runs the operation directly and returns its result (sandman_ray.direct)
    or, for a handle without a direct path, through the host and waits."""

    __slots__ = ("handle", "op")

    def __init__(self, handle: "SandboxHandle", op: str):
        self.handle, self.op = handle, op

    def __call__(self, *args, **kwargs):
        handle = self.handle
        if self.op in DESCRIBED:
            return getattr(handle, _LOCAL[self.op])
        handle._awake()
        if handle._direct is not None:
            try:
                return handle._direct.call(self.op, args, kwargs)
            except Unreachable:  # nothing was sent: through the host from here on
                handle._direct = None
        return ray.get(self.remote(*args, **kwargs))

    def remote(self, *args, **kwargs):
        handle = self.handle
        method = getattr(handle._host, self.op)
        if self.op in FORWARDED:
            handle._awake()
        if self.op not in FORWARDED:
            return method.remote(handle.lease_id, *args, **kwargs)
        with handle._sent.lock:  # the calls the host counts as begun (_call)
            handle._sent.count += 1
        try:
            # one bytes argument: Ray's cost per call grows with each argument it
            # serializes, ~0.2 ms less than the lease id and a command as two strings
            # (measured here, bench-style: a bare actor call with each). The lease id
            # stays outside the packed part, so the host counts a call whose arguments
            # it then cannot decode (a dict with keys that are not strings).
            packed = handle.lease_id.encode() + b"\0" + pack([args, kwargs])
        except CodecError:  # not plain data (an ObjectRef for Ray to resolve ...)
            return method.remote(handle.lease_id, *args, **kwargs)
        return method.remote(packed)


class _AsyncMethod:
    """``handle.<op>_async``: ``await handle.exec_async("ls")``, the asyncio form of a
    direct call."""

    __slots__ = ("handle", "op")

    def __init__(self, handle: "SandboxHandle", op: str):
        self.handle, self.op = handle, op

    async def __call__(self, *args, **kwargs):
        handle = self.handle
        if self.op in DESCRIBED:
            return getattr(handle, _LOCAL[self.op])
        await handle._awake_async()
        if handle._direct is not None:
            try:
                return await handle._direct.call_async(self.op, args, kwargs)
            except Unreachable:  # nothing was sent: through the host from here on
                handle._direct = None
        return await _Method(handle, self.op).remote(*args, **kwargs)


class _StreamMethod:
    """``handle.exec_stream``: calling it gives an iterator of ``(stream, bytes)``
    chunks and then the ExecResult (``ExecStream``), directly or through the host;
    ``.remote()`` gives Ray's streaming generator of the same items."""

    __slots__ = ("handle", "op")

    def __init__(self, handle: "SandboxHandle", op: str):
        self.handle, self.op = handle, op

    def __call__(self, *args, **kwargs) -> ExecStream:
        handle = self.handle
        handle._awake()
        if handle._direct is not None:
            try:
                return ExecStream(handle._direct.stream(self.op, args, kwargs))
            except Unreachable:  # nothing was sent: through the host from here on
                handle._direct = None
        return ExecStream(_items(self.remote(*args, **kwargs)))

    def remote(self, *args, **kwargs) -> "StreamRefs":
        self.handle._awake()
        return StreamRefs(getattr(self.handle._host, self.op).remote(
            self.handle.lease_id, *args, **kwargs))


class StreamRefs:
    """What ``sb.exec_stream.remote(...)`` returns: Ray's streaming generator
    (``generator``, for ``ray.wait``), iterated as it is, for an ObjectRef per chunk and
    then one of the ExecResult (``for ref in refs`` or ``async for ref in refs``).
    ``cancel()``, or dropping it before its end, kills the command."""

    __slots__ = ("generator",)

    def __init__(self, generator):
        self.generator = generator

    def __iter__(self) -> "StreamRefs":
        return self

    def __next__(self):
        return next(self.generator)

    def __aiter__(self) -> "StreamRefs":
        return self

    async def __anext__(self):
        return await self.generator.__anext__()

    def is_finished(self) -> bool:
        return self.generator.is_finished()

    def cancel(self) -> None:
        """Give the stream up: its command is killed."""
        if not self.generator.is_finished():
            try:
                ray.cancel(self.generator)
            except Exception:  # noqa: BLE001 - it ended meanwhile, or Ray is down
                pass

    def __del__(self):
        try:
            self.cancel()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass


def _items(refs):
    """The values of a streaming generator's refs, as they come; closing this drops
    the generator (its command is killed)."""
    try:
        for ref in refs:
            yield ray.get(ref)
    finally:
        refs.cancel()


class _AsyncStreamMethod:
    """``handle.exec_stream_async``: ``async for item in sb.exec_stream_async(...)``."""

    __slots__ = ("handle", "op")

    def __init__(self, handle: "SandboxHandle", op: str):
        self.handle, self.op = handle, op

    async def __call__(self, *args, **kwargs):
        handle = self.handle
        await handle._awake_async()
        if handle._direct is not None:
            try:
                stream = await handle._direct.open_stream_async(self.op, args, kwargs)
            except Unreachable:
                handle._direct = None
            else:
                async for item in stream:
                    yield item
                return
        refs = _StreamMethod(handle, self.op).remote(*args, **kwargs)
        try:
            async for ref in refs:
                yield await ref
        finally:
            refs.cancel()


# what a described operation answers, from the handle itself
_LOCAL = {"sandbox_id": "sandbox", "node_id": "node"}


class _Sent:
    """How many calls a handle has sent (its finalizer reads it)."""

    __slots__ = ("count", "lock")

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()


class SandboxHandle:
    """One leased sandbox, used like an actor handle: ``ray.get(sb.exec.remote("ls"))``,
    or called directly: ``sb.exec("ls")``, ``await sb.exec_async("ls")``. Its
    operations are those of ``sandman_ray.client.DaemonClient`` plus ``sandbox_id``
    and ``node_id``, and ``pause``/``resume``. Give it back with
    ``sandman_ray.release``.

    ``auto_resume`` (``acquire(..., auto_resume=True)``): a call on the handle while
    it has its sandbox paused resumes it first; without it such a call raises
    SandboxPaused. A pause is this handle's to know: a copy passed to another process
    does not see it."""

    if TYPE_CHECKING:  # its operations, as type checkers see them (handle_types.py)
        ping = op(_Ops.ping, dict)
        ping_async = async_op(_Ops.ping, dict)
        info = op(_Ops.info, dict)
        info_async = async_op(_Ops.info, dict)
        exec = op(_Ops.exec, ExecResult)
        exec_async = async_op(_Ops.exec, ExecResult)
        session_open = op(_Ops.session_open, dict)
        session_open_async = async_op(_Ops.session_open, dict)
        run = op(_Ops.run, ExecResult)
        run_async = async_op(_Ops.run, ExecResult)
        session_close = op(_Ops.session_close, dict)
        session_close_async = async_op(_Ops.session_close, dict)
        session_list = op(_Ops.session_list, list)
        session_list_async = async_op(_Ops.session_list, list)
        spawn = op(_Ops.spawn, int)
        spawn_async = async_op(_Ops.spawn, int)
        proc_status = op(_Ops.proc_status, ProcessStatus)
        proc_status_async = async_op(_Ops.proc_status, ProcessStatus)
        proc_list = op(_Ops.proc_list, list)
        proc_list_async = async_op(_Ops.proc_list, list)
        proc_output = op(_Ops.proc_output, ProcessOutput)
        proc_output_async = async_op(_Ops.proc_output, ProcessOutput)
        proc_wait = op(_Ops.proc_wait, ProcessStatus)
        proc_wait_async = async_op(_Ops.proc_wait, ProcessStatus)
        proc_follow = op(_Ops.proc_follow, ExecStream)
        proc_follow_async = async_op(_Ops.proc_follow, ExecStream)
        proc_stdin = op(_Ops.proc_stdin, int)
        proc_stdin_async = async_op(_Ops.proc_stdin, int)
        proc_signal = op(_Ops.proc_signal, ProcessStatus)
        proc_signal_async = async_op(_Ops.proc_signal, ProcessStatus)
        pty_open = op(_Ops.pty_open, dict)
        pty_open_async = async_op(_Ops.pty_open, dict)
        pty_write = op(_Ops.pty_write, dict)
        pty_write_async = async_op(_Ops.pty_write, dict)
        pty_read = op(_Ops.pty_read, dict)
        pty_read_async = async_op(_Ops.pty_read, dict)
        pty_resize = op(_Ops.pty_resize, dict)
        pty_resize_async = async_op(_Ops.pty_resize, dict)
        pty_close = op(_Ops.pty_close, dict)
        pty_close_async = async_op(_Ops.pty_close, dict)
        pty_list = op(_Ops.pty_list, list)
        pty_list_async = async_op(_Ops.pty_list, list)
        read_file = op(_Ops.read_file, bytes)
        read_file_async = async_op(_Ops.read_file, bytes)
        write_file = op(_Ops.write_file, int)
        write_file_async = async_op(_Ops.write_file, int)
        stat = op(_Ops.stat, FileStat)
        stat_async = async_op(_Ops.stat, FileStat)
        list_dir = op(_Ops.list_dir, Listing)
        list_dir_async = async_op(_Ops.list_dir, Listing)
        mkdir = op(_Ops.mkdir, dict)
        mkdir_async = async_op(_Ops.mkdir, dict)
        remove = op(_Ops.remove, dict)
        remove_async = async_op(_Ops.remove, dict)
        move = op(_Ops.move, dict)
        move_async = async_op(_Ops.move, dict)
        watch_dir = op(_Ops.watch_dir, ExecStream)
        watch_dir_async = async_op(_Ops.watch_dir, ExecStream)
        get_archive = op(_Ops.get_archive, bytes)
        get_archive_async = async_op(_Ops.get_archive, bytes)
        put_archive = op(_Ops.put_archive, int)
        put_archive_async = async_op(_Ops.put_archive, int)
        exec_stream = op(_Ops.exec_stream, ExecStream)
        exec_stream_async: Callable[..., AsyncIterator[Any]]
        sandbox_id: Op[[], str]
        sandbox_id_async: AsyncOp[[], str]
        node_id: Op[[], Optional[str]]
        node_id_async: AsyncOp[[], Optional[str]]

    def __init__(self, host, lease_id: str, sandbox_id: str, node_id: Optional[str],
                 pool: str, owned: bool = True, host_name: Optional[str] = None,
                 direct: Optional[Direct] = None, auto_resume: bool = False):
        self._host, self.lease_id, self.pool = host, lease_id, pool
        self._host_name = host_name  # the holder the pool knows (release names it)
        self.sandbox, self.node = sandbox_id, node_id
        self.auto_resume, self.paused = auto_resume, False
        self.pause_between_steps = False  # the pool's word (PoolConfig), set by acquire
        self._controller: Optional[str] = None  # who pauses it here (Lease.controller)
        self._sent = _Sent()
        self._direct = direct  # this process's own connections (not passed on)
        # the lease is released when this object is collected, unless it was passed on
        self._finalizer = None
        if owned:
            self._finalizer = weakref.finalize(self, _release_quietly, host, lease_id, pool,
                                               self._sent, direct)
            self._finalizer.atexit = False  # at exit the host dies with this process

    def __getattr__(self, op: str):
        if op in FORWARDED or op in DESCRIBED:
            return _Method(self, op)
        if op in STREAMED:
            return _StreamMethod(self, op)
        base = op[:-len("_async")] if op.endswith("_async") else None
        if base in FORWARDED or base in DESCRIBED:
            return _AsyncMethod(self, base)
        if base in STREAMED:
            return _AsyncStreamMethod(self, base)
        raise AttributeError("SandboxHandle has no operation %r" % op)

    def __reduce__(self):
        # passed to another process: it may use the lease after this object is gone
        if self._finalizer is not None:
            self._finalizer.detach()
        return (_rebuilt, (self._host, self.lease_id, self.sandbox, self.node, self.pool,
                           self._host_name, self.auto_resume, self.pause_between_steps))

    # ---- pauses: the node's controller (Provider.controller) freezes the sandbox's
    # processes for a holder that shows its token, else the pool does (sandman_ray.pause
    # is this)
    def pause(self, reclaim: bool = False) -> None:
        """Freeze every process of the sandbox where it is, its daemon too: no CPU
        while the model thinks, its memory kept; with ``reclaim``, the memory pushed
        out as far as the node can (to swap where it has some; LocalProvider). A paused
        lease is not reclaimed for idleness; its TTL runs on. Pausing a paused sandbox
        does nothing (with ``reclaim``, pushes out again)."""
        if not self._got(self._at_controller(True, reclaim)):
            call_pool(self.pool, "pause", self.lease_id, self._host_name, reclaim)
        self.paused = True

    def resume(self) -> None:
        """Let the paused sandbox's processes run on where they stopped. LeaseEnded for
        a lease that ended meanwhile (its TTL runs while it is paused)."""
        try:
            if not self._got(self._at_controller(False)):
                call_pool(self.pool, "resume", self.lease_id, self._host_name)
        except LeaseEnded:  # no longer this handle's to resume
            self.paused = False
            raise
        self.paused = False

    async def pause_async(self, reclaim: bool = False) -> None:
        if not await self._got_async(self._at_controller(True, reclaim)):
            await call_pool_async(self.pool, "pause", self.lease_id, self._host_name, reclaim)
        self.paused = True

    async def resume_async(self) -> None:
        try:
            if not await self._got_async(self._at_controller(False)):
                await call_pool_async(self.pool, "resume", self.lease_id, self._host_name)
        except LeaseEnded:
            self.paused = False
            raise
        self.paused = False

    def _at_controller(self, pause: bool, *args) -> Optional[tuple]:
        """A pause (or resume) by the sandbox's node controller, with the lease's token,
        when this process holds the token (a direct connection), and the pool told at
        the same time (it spares a paused lease its idle timeout, and says whether the
        lease still holds): what to ask, the controller, and the pool's answer to come;
        None: ask the pool to do it. The controller is asked on its control socket
        (sandman_ray.control) where it has one, else by a Ray call."""
        direct = self._direct
        if self._controller is None or direct is None or direct.ended:
            return None
        controller = get_named(self._controller)
        if controller is None:
            return None
        note = get_pool(self.pool).note_paused.remote(self.lease_id, self._host_name, pause)
        return ("pause" if pause else "resume", (self.sandbox, direct.token) + args,
                controller, note)

    def _got(self, calls: Optional[tuple]) -> bool:
        """Whether the controller did it (False: none, one gone, or a token it no
        longer takes: the pool then does it, or says why not). A resume waits for the
        pool's word too: LeaseEnded for a lease that is over, though its sandbox, not
        yet reset, took the token (a pause done then is undone by the reset)."""
        if calls is None:
            return False
        op, args, controller, note = calls
        try:
            path = control_path(self._controller, controller)
            done = None if path is None else control.ask(path, op, *args)
            if done is None:
                if path is not None:  # gone: asked for again next time
                    forget_control_path(self._controller)
                done = ray.get(getattr(controller, op + "_held").remote(*args))
        except ray.exceptions.RayActorError:
            forget_named(self._controller)
            return False
        if done and op == "resume":
            self._still_held(ray.get(note))
        return done

    async def _got_async(self, calls: Optional[tuple]) -> bool:
        if calls is None:
            return False
        op, args, controller, note = calls
        try:
            path = await control_path_async(self._controller, controller)
            done = None if path is None else await control.ask_async(path, op, *args)
            if done is None:
                if path is not None:
                    forget_control_path(self._controller)
                done = await getattr(controller, op + "_held").remote(*args)
        except ray.exceptions.RayActorError:
            forget_named(self._controller)
            return False
        if done and op == "resume":
            self._still_held(await note)
        return done

    def _still_held(self, why: Optional[str]) -> None:
        if why is not None:
            raise LeaseEnded("lease %s has ended: %s" % (self.lease_id, why), why)

    def _awake(self) -> None:
        """Before a call: the sandbox running, or SandboxPaused."""
        if self.paused:
            if not self.auto_resume:
                raise _paused_error(self)
            self.resume()

    async def _awake_async(self) -> None:
        if self.paused:
            if not self.auto_resume:
                raise _paused_error(self)
            await self.resume_async()

    def _released(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._direct is not None:
            self._direct.close("released by its holder")

    def __repr__(self) -> str:
        return "SandboxHandle(%s, lease %s)" % (self.sandbox, self.lease_id)




def _rebuilt(host, lease_id, sandbox_id, node_id, pool, host_name, auto_resume,
             pause_between_steps) -> SandboxHandle:
    """A handle passed to another process (it owns nothing there)."""
    handle = SandboxHandle(host, lease_id, sandbox_id, node_id, pool, False, host_name,
                           auto_resume=auto_resume)
    handle.pause_between_steps = pause_between_steps
    return handle


def _paused_error(handle: SandboxHandle) -> SandboxPaused:
    return SandboxPaused("sandbox %s is paused by this handle: resume() it first, or "
                         "acquire with auto_resume=True to have a call resume it"
                         % handle.sandbox)


def _release_quietly(host, lease_id: str, pool: str, sent: _Sent,
                     direct: Optional[Direct] = None) -> None:
    """A handle was dropped without ``release``: give its lease back once the calls it
    sent are answered, without waiting here (this runs in the garbage collector)."""
    if direct is not None:
        direct.close("its handle was dropped")
    try:
        if ray.is_initialized():
            host.release.remote(lease_id, pool, sent.count)
    except Exception:  # noqa: BLE001 - the owner's death or the watchdog reclaims it
        pass
