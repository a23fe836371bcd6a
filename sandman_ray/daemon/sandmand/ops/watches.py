"""Watching a directory (``watch_dir``): the kernel's inotify events of a directory (and
of its subdirectories, recursively, as they come and go), streamed as events named by
what happened, each with the path relative to the directory."""

import os
import struct

from ..fields import RequestError, field, path_field
from ..loop import CancelledError, Event

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ONLYDIR, IN_ISDIR = 0x4000, 0x8000, 0x01000000, 0x40000000
IN_DONT_FOLLOW = 0x02000000
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE |
        IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, NUL-padded
# what happened, by the first bit of an event's mask that says so
KINDS = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_MODIFY, "write"),
         (IN_DELETE | IN_DELETE_SELF, "remove"), (IN_MOVED_FROM | IN_MOVE_SELF, "rename"),
         (IN_ATTRIB, "chmod"))
MAX_WATCHED_DIRS = 8192  # directories one watch follows at most


class WatchOps:
    """The Daemon's watch op (a mixin)."""

    async def op_watch_dir(self, req, reply):
        """An event ``ready`` once the watch is in place, then events ``create``,
        ``write``, ``remove``, ``rename`` and ``chmod``, each with the path (bytes)
        relative to ``path`` of what they befell, until the watch is cancelled or the
        directory itself is removed; then how many were sent."""
        path = path_field(req)
        if not os.path.isdir(path):
            raise NotADirectoryError(20, "Not a directory", path)
        watcher = Watcher(self.loop, path, field(req, "recursive", False), reply)
        reply.event("ready", b"")  # in place: what happens from now on is told
        try:
            await watcher.ended.wait()
        except CancelledError:
            pass
        finally:
            watcher.close()
        return {"events": watcher.sent, "overflowed": watcher.overflowed}


class Watcher:
    """One inotify instance: the watched directories by watch descriptor."""

    def __init__(self, loop, root, recursive, reply):
        from ..attrs import _call
        if _call is None:
            raise RequestError("Unsupported", "this daemon's Python has no _ctypes: "
                               "directories cannot be watched")
        self.call, self.loop, self.recursive, self.reply = _call, loop, recursive, reply
        self.root = root
        self.fd = _call("inotify_init1", IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise RequestError("LimitExceeded", "no inotify instance could be made (the "
                               "sandbox's limit of instances is reached)")
        self.dirs = {}  # watch descriptor -> the directory, relative to the root
        self.sent = 0
        self.overflowed = False
        self.ended = Event(loop)
        self.reading = True
        try:
            self._add(root, "")
        except BaseException:
            os.close(self.fd)
            raise
        loop.add_reader(self.fd, self._ready)

    def _add(self, path, rel):
        """Watch ``path`` (and, if recursive, the directories below it, breadth first,
        without recursion: a tree may be deeper than Python's stack)."""
        todo = [(path, rel)]
        while todo and len(self.dirs) < MAX_WATCHED_DIRS:
            path, rel = todo.pop(0)
            # below the root, a directory swapped for a symlink is not followed
            wd = self.call("inotify_add_watch", self.fd, os.fsencode(path),
                           MASK | (IN_DONT_FOLLOW if self.dirs else 0))
            if wd < 0:
                if not self.dirs:
                    raise RequestError("LimitExceeded", "%s could not be watched (the limit "
                                       "of watches is reached)" % path)
                continue  # a subdirectory gone meanwhile, or past the limit: not followed
            self.dirs[wd] = rel
            if not self.recursive:
                continue
            try:
                entries = list(os.scandir(path))
            except OSError:
                continue
            todo += [(e.path, os.path.join(rel, e.name)) for e in entries
                     if e.is_dir(follow_symlinks=False)]

    def _ready(self):
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        offset = 0
        while offset + EVENT.size <= len(data):
            wd, mask, _cookie, size = EVENT.unpack_from(data, offset)
            name = data[offset + EVENT.size:offset + EVENT.size + size].rstrip(b"\0")
            offset += EVENT.size + size
            self._event(wd, mask, os.fsdecode(name))
            if self.fd is None:
                return
        writable = self.reply.conn.writable
        if not writable.is_set() and self.reading:  # the client lags: the kernel queues
            self.reading = False
            self.loop.remove_reader(self.fd)
            writable.wait().add_done_callback(self._resume)

    def _resume(self, _ready):
        if not self.reading and self.fd is not None:
            self.reading = True
            self.loop.add_reader(self.fd, self._ready)

    def _event(self, wd, mask, name):
        if mask & IN_Q_OVERFLOW:
            self.overflowed = True
            return
        rel = self.dirs.get(wd)
        if mask & IN_IGNORED:
            self.dirs.pop(wd, None)
            if rel == "":  # the root is gone
                self.ended.set()
            return
        if rel is None:
            return
        where = os.path.join(rel, name) if name else rel
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF) and rel != "":
            return  # a subdirectory's own end: its parent's event names it
        for bits, kind in KINDS:
            if mask & bits:
                if where:
                    self.reply.event(kind, os.fsencode(where))
                    self.sent += 1
                break
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            self._add_new(where)

    def _add_new(self, rel):
        self._add(os.path.join(self.root, rel), rel)

    def close(self):
        if self.fd is not None:
            if self.reading:
                self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None
