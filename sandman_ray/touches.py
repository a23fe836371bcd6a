"""Touches: a lease in use tells its pool so, off the path of the call that used it.

A pool reclaims a lease that has been idle for its spec's ``idle_timeout_s``; what
counts as use is a call, direct or through the host. Telling the pool once per call
would be a Ray call per call, and even one every TOUCH_EVERY_S per lease is one on
nearly every call when a process spreads its calls over a thousand leases: a Ray call
submitted on the call's own thread cost 0.3-1 ms there (bench/density.py: ``exec
true`` on a random one of 1,000 sandboxes, p50 2.0 ms against 1.0 ms on one sandbox
called again and again). So a call only notes its lease here (a dict entry under a
lock), and a thread of this process sends each pool the leases used since the last
round in one ``touch_many`` call, every TOUCH_EVERY_S while there is any; with nothing
noted the thread waits and costs nothing.
"""

import threading
import time
from typing import Dict, Optional, Tuple

TOUCH_EVERY_S = 1.0  # how often this process tells each pool which of its leases are in use


class Touches:
    """The leases this process used since its last round, per pool."""

    def __init__(self, every_s: float = TOUCH_EVERY_S):
        self.every_s = every_s
        self.lock = threading.Lock()
        self.noted = threading.Condition(self.lock)
        # pool actor id -> (pool handle, {lease id: holder})
        self.pending: Dict[object, Tuple[object, Dict[str, Optional[str]]]] = {}
        self.thread: Optional[threading.Thread] = None

    def note(self, pool, lease_id: str, holder: Optional[str]) -> None:
        """``lease_id`` (held by ``holder``) was used just now; ``pool``: its pool's
        actor handle."""
        key = pool._actor_id
        with self.lock:
            first = not self.pending
            entry = self.pending.get(key)
            if entry is None:
                entry = self.pending[key] = (pool, {})
            entry[1][lease_id] = holder
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="sandman-touches",
                                               daemon=True)
                self.thread.start()
            if first:
                self.noted.notify()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.pending:
                    self.noted.wait()
                # what is noted until the round's end goes in the same call
                end = time.monotonic() + self.every_s
                while time.monotonic() < end:
                    self.noted.wait(end - time.monotonic())
                rounds, self.pending = self.pending, {}
            for pool, leases in rounds.values():
                try:
                    pool.touch_many.remote(list(leases.items()))
                except Exception:  # noqa: BLE001 - the pool is gone: its calls say so
                    pass


_touches = Touches()


def note(pool, lease_id: str, holder: Optional[str]) -> None:
    """This process used ``lease_id`` just now (see ``Touches.note``)."""
    _touches.note(pool, lease_id, holder)
