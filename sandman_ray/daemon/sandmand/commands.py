"""Exactly once: a request that carries a ``command_id`` runs once per lease. A retry
with the same id, on any connection of the lease, gets the first run's answer, or waits
for it while it runs; the run goes on when the connection that asked for it closes."""

from .fields import RequestError, bad_request
from .wire import (
    MAX_COMMAND_ID, MAX_KEPT_ANSWER_BYTES, MAX_KEPT_ANSWERS, MAX_REMEMBERED_IDS,
    MAX_RUNNING_COMMANDS, pack)


class Commands:
    """The commands of this lease that carried an id: running ones, finished ones with
    their answers (the last MAX_KEPT_ANSWERS, MAX_KEPT_ANSWER_BYTES of output at most),
    and the ids of older ones, whose retry is refused rather than run again."""

    def __init__(self):
        self.records = {}  # command id -> Record, oldest first
        self.finished = []  # ids of finished records, oldest first
        self.kept_bytes = 0
        self.forgotten = {}  # command id -> None, oldest first

    def claim(self, req, reply):
        """The Record that ``reply`` answers for a new command id, or None when the id
        ran before or runs now: ``reply`` then gets its answer (at once when it is
        known)."""
        cid = req["command_id"]
        if not cid or len(cid) > MAX_COMMAND_ID:
            raise bad_request("field 'command_id' must hold 1 to %d characters" % MAX_COMMAND_ID)
        if cid in self.forgotten:
            raise RequestError("CommandForgotten", "command %r ran long ago and its answer "
                               "is no longer kept; it is not run again" % cid)
        print_ = fingerprint(req)
        record = self.records.get(cid)
        if record is None:
            if len(self.records) - len(self.finished) >= MAX_RUNNING_COMMANDS:
                raise RequestError("LimitExceeded", "%d commands with an id are running"
                                   % MAX_RUNNING_COMMANDS)
            record = self.records[cid] = Record(self, cid, print_)
            return record
        if record.fingerprint != print_:
            raise bad_request("command id %r was given to another request" % cid)
        record.attach(reply)
        return None

    def done(self, record):
        self.finished.append(record.cid)
        self.kept_bytes += record.size
        while self.finished and (len(self.finished) > MAX_KEPT_ANSWERS
                                 or self.kept_bytes > MAX_KEPT_ANSWER_BYTES):
            old = self.records.pop(self.finished.pop(0))
            self.kept_bytes -= old.size
            self.forgotten[old.cid] = None
            if len(self.forgotten) > MAX_REMEMBERED_IDS:
                del self.forgotten[next(iter(self.forgotten))]


class Record:
    """One command id: its answer once known, and the replies that wait for it."""

    __slots__ = ("commands", "cid", "fingerprint", "answer", "waiting", "size")

    def __init__(self, commands, cid, print_):
        self.commands, self.cid, self.fingerprint = commands, cid, print_
        self.answer = None  # the final message without its id, encoded (a msgpack map)
        self.waiting = {}  # replies of retries (a dict: detaching one costs the same)
        self.size = 0

    def attach(self, reply):
        if self.answer is not None:
            reply.send_kept(self.answer)
            return
        self.waiting[reply] = None
        reply.on_cancel = lambda: self._detach(reply)

    def _detach(self, reply):
        self.waiting.pop(reply, None)
        reply.abandon()

    def finish(self, msg):
        """The first run's answer: kept encoded once, its bytes shared by every retry's
        reply (which adds only its own id in front)."""
        self.answer = pack({k: v for k, v in msg.items() if k != "id"})
        self.size = len(self.answer)  # results and errors alike
        waiting, self.waiting = self.waiting, {}
        for reply in waiting:
            reply.send_kept(self.answer)
        self.commands.done(self)


def fingerprint(req):
    """What makes two requests the same command: every field but the request id (the
    interpreter's keyed hash of their encoding, and its length: enough to tell a
    client's own mistake within one daemon's life, and no module to import)."""
    body = pack(_canonical({k: v for k, v in req.items() if k != "id"}))
    return hash(body), len(body)


def _canonical(value):
    if isinstance(value, dict):
        return [[k, _canonical(value[k])] for k in sorted(value, key=repr)]
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value
