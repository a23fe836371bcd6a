"""The event loop: epoll readiness, timers, callbacks, signals and calls from threads,
and the few primitives the daemon awaits (Future, Task, Event, Lock, wait_for, wait_all).

A small event loop of our own instead of asyncio: importing asyncio costs ~140 ms of
CPU on a small machine (concurrent.futures, logging, inspect ...), paid by every
sandbox start and reset; this loop and the C modules it uses import in ~5 ms.
"""

import os
import time


class CancelledError(BaseException):
    """A task was cancelled (its connection closed)."""


class Timeout(Exception):
    """wait_for ran out of time."""


class Future:
    """A result that arrives later; ``await`` it inside a Task."""

    __slots__ = ("loop", "_state", "_value", "_callbacks")

    def __init__(self, loop):
        self.loop = loop
        self._state = 0  # 0 pending, 1 result, 2 exception
        self._value = None
        self._callbacks = []

    def done(self):
        return self._state != 0

    def result(self):
        if self._state == 2:
            raise self._value
        if self._state == 0:
            raise RuntimeError("future is not done")
        return self._value

    def exception(self):
        return self._value if self._state == 2 else None

    def set_result(self, value):
        self._settle(1, value)

    def set_exception(self, exc):
        self._settle(2, exc)

    def _settle(self, state, value):
        if self._state:
            raise RuntimeError("future already done")
        self._state, self._value = state, value
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self.loop.call_soon(callback, self)

    def add_done_callback(self, callback):
        if self._state:
            self.loop.call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    def remove_done_callback(self, callback):
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def __await__(self):
        if not self._state:
            yield self
        return self.result()

    __iter__ = __await__


class Task(Future):
    """Runs a coroutine: each ``await`` of a pending Future suspends it until the
    Future is done. Cancelling throws CancelledError at the ``await``; the awaited
    Future itself is left alone (others may wait on it too)."""

    __slots__ = ("coro", "waiting")

    def __init__(self, loop, coro):
        Future.__init__(self, loop)
        self.coro = coro
        self.waiting = None
        loop.call_soon(self._step, None, None)

    def _step(self, value, exc):
        if self._state:
            return
        try:
            fut = self.coro.throw(exc) if exc is not None else self.coro.send(value)
        except StopIteration as stop:
            self.set_result(stop.value)
        except BaseException as error:  # CancelledError included: the task is done
            self.set_exception(error)
        else:
            self.waiting = fut
            fut.add_done_callback(self._wakeup)

    def _wakeup(self, fut):
        if fut is not self.waiting:
            return
        self.waiting = None
        if fut._state == 2:
            self._step(None, fut._value)
        else:
            self._step(fut._value, None)

    def cancel(self):
        if self._state:
            return
        if self.waiting is not None:
            self.waiting.remove_done_callback(self._wakeup)
            self.waiting = None
        self.loop.call_soon(self._step, None, CancelledError())


class _Timer:
    __slots__ = ("when", "seq", "callback", "args", "cancelled")

    def __init__(self, when, seq, callback, args):
        self.when, self.seq, self.callback, self.args = when, seq, callback, args
        self.cancelled = False

    def __lt__(self, other):
        return (self.when, self.seq) < (other.when, other.seq)

    def cancel(self):
        self.cancelled = True


class Loop:
    """epoll readiness, timers, callbacks, signals and calls from threads."""

    def __init__(self):
        import select
        from collections import deque
        self.select = select
        self.epoll = select.epoll()
        self.readers, self.writers, self.masks = {}, {}, {}
        self.ready = deque()
        self.timers = []
        self.seq = 0
        self.signal_handlers = {}
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.add_reader(self.wake_r, self._woken)

    # fds
    def _update(self, fd):
        mask = (self.select.EPOLLIN if fd in self.readers else 0) | \
               (self.select.EPOLLOUT if fd in self.writers else 0)
        old = self.masks.get(fd, 0)
        if mask == old:
            return
        if not mask:
            del self.masks[fd]
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):
                pass
        elif old:
            self.masks[fd] = mask
            try:
                self.epoll.modify(fd, mask)
            except FileNotFoundError:  # closed while registered: a new fd of that number
                self.epoll.register(fd, mask)
        else:
            self.masks[fd] = mask
            try:
                self.epoll.register(fd, mask)
            except FileExistsError:
                self.epoll.modify(fd, mask)

    def add_reader(self, fd, callback, *args):
        self.readers[fd] = (callback, args)
        self._update(fd)

    def remove_reader(self, fd):
        if self.readers.pop(fd, None) is not None:
            self._update(fd)

    def close_fd(self, fd):
        """Stop watching ``fd`` and close it, without the epoll_ctl calls that removing it
        first would cost (two fewer syscalls per pipe of a short command): closing the
        last descriptor of a file takes it out of the epoll set. Only for a file no other
        process holds (our pipes' read ends, pidfds); should one still be held (a fork
        between its fork and exec), its events come under a number we no longer watch,
        and every callback here tolerates a spurious readiness."""
        self.readers.pop(fd, None)
        self.writers.pop(fd, None)
        self.masks.pop(fd, None)
        os.close(fd)

    def add_writer(self, fd, callback, *args):
        self.writers[fd] = (callback, args)
        self._update(fd)

    def remove_writer(self, fd):
        if self.writers.pop(fd, None) is not None:
            self._update(fd)

    # callbacks
    def call_soon(self, callback, *args):
        self.ready.append((callback, args))

    def call_soon_threadsafe(self, callback, *args):
        self.ready.append((callback, args))  # deque.append is atomic
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def call_later(self, delay, callback, *args):
        import heapq
        self.seq += 1
        timer = _Timer(time.monotonic() + delay, self.seq, callback, args)
        heapq.heappush(self.timers, timer)
        return timer

    def create_future(self):
        return Future(self)

    def create_task(self, coro):
        return Task(self, coro)

    def run_in_executor(self, _executor, fn, *args):
        """Run a blocking ``fn`` in a thread; the Future settles on the loop."""
        import threading
        fut = self.create_future()

        def work():
            try:
                value = fn(*args)
            except BaseException as exc:
                self.call_soon_threadsafe(_settle, fut, 2, exc)
            else:
                self.call_soon_threadsafe(_settle, fut, 1, value)
        threading.Thread(target=work, daemon=True).start()
        return fut

    # signals
    def add_signal_handler(self, sig, callback, *args):
        import _signal
        self.signal_handlers[sig] = (callback, args)
        _signal.signal(sig, _ignore_signal)
        _signal.set_wakeup_fd(self.wake_w)

    def _woken(self):
        try:
            data = os.read(self.wake_r, 4096)
        except BlockingIOError:
            return
        for sig in set(data):
            handler = self.signal_handlers.get(sig)
            if handler is not None:  # now, not in the next iteration (SIGCHLD: a reply waits)
                try:
                    handler[0](*handler[1])
                except Exception as exc:
                    _log("signal handler %r failed: %s: %s" % (handler[0], type(exc).__name__, exc))

    # running
    def run_until(self, fut):
        import heapq
        ready, timers = self.ready, self.timers
        poll, readers, writers = self.epoll.poll, self.readers, self.writers
        select = self.select
        in_mask = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
        out_mask = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
        while not fut.done():
            if ready:
                timeout = 0
            elif timers:
                timeout = max(0.0, timers[0].when - time.monotonic())
            else:
                timeout = -1
            try:
                events = poll(timeout)
            except InterruptedError:
                events = ()
            for fd, mask in events:
                if mask & in_mask:
                    handler = readers.get(fd)
                    if handler is not None:
                        ready.append(handler)
                if mask & out_mask:
                    handler = writers.get(fd)
                    if handler is not None:
                        ready.append(handler)
            if timers:
                now = time.monotonic()
                while timers and timers[0].when <= now:
                    timer = heapq.heappop(timers)
                    if not timer.cancelled:
                        ready.append((timer.callback, timer.args))
            for _ in range(len(ready)):
                callback, args = ready.popleft()
                try:
                    callback(*args)
                except Exception as exc:  # a bug in one callback must not stop the daemon
                    _log("callback %r failed: %s: %s" % (callback, type(exc).__name__, exc))
        return fut.result()


def resolve_once(fut):
    if not fut.done():
        fut.set_result(None)


def _settle(fut, state, value):
    if not fut.done():
        fut._settle(state, value)


def _log(message):
    try:
        os.write(2, ("sandmand: %s\n" % message).encode("utf-8", "replace"))
    except OSError:
        pass


def _ignore_signal(signum, frame):
    pass  # the wake-up fd carries the signal to the loop


def wait_for(loop, fut, timeout):
    """A Future of ``fut``'s result, or Timeout after ``timeout`` seconds (None: no
    limit). ``fut`` is not cancelled on timeout."""
    if timeout is None:
        return fut
    out = loop.create_future()

    def done(f):
        if not out.done():
            timer.cancel()
            out._settle(f._state, f._value)

    def expire():
        if not out.done():
            fut.remove_done_callback(done)
            out.set_exception(Timeout())
    timer = loop.call_later(timeout, expire)
    fut.add_done_callback(done)
    return out


def wait_all(loop, futs, timeout):
    """A Future that resolves (to None) when every future is done or after
    ``timeout`` seconds, whichever comes first."""
    out = loop.create_future()
    pending = [f for f in futs if not f.done()]
    if not pending:
        out.set_result(None)
        return out
    count = [len(pending)]

    def one(_f):
        count[0] -= 1
        if count[0] == 0 and not out.done():
            timer.cancel()
            out.set_result(None)
    timer = loop.call_later(timeout, lambda: out.done() or out.set_result(None))
    for f in pending:
        f.add_done_callback(one)
    return out


class Event:
    """Set once or more; ``wait()`` is a Future done when the event is set."""

    def __init__(self, loop):
        self.loop = loop
        self.flag = False
        self.waiters = []

    def is_set(self):
        return self.flag

    def set(self):
        self.flag = True
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(True)

    def clear(self):
        self.flag = False

    def wait(self):
        fut = self.loop.create_future()
        if self.flag:
            fut.set_result(True)
        else:
            self.waiters.append(fut)
        return fut


class Lock:
    """First come, first served; ``async with lock``."""

    def __init__(self, loop):
        self.loop = loop
        self.held = False
        self.waiters = []

    async def __aenter__(self):
        if not self.held:
            self.held = True
            return
        fut = self.loop.create_future()
        self.waiters.append(fut)
        try:
            await fut
        except CancelledError:
            if fut.done():
                self._release()  # it was handed to us as we were cancelled
            else:
                self.waiters.remove(fut)
            raise

    async def __aexit__(self, *exc):
        self._release()

    def try_acquire(self):
        """Take the lock if it is free, without waiting; whether it was taken."""
        if self.held:
            return False
        self.held = True
        return True

    def _release(self):
        if self.waiters:
            self.waiters.pop(0).set_result(None)  # the lock passes on, still held
        else:
            self.held = False
