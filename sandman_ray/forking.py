"""What a fork needs whichever client makes it (forks.py through Ray, remote/pool.py
through the service): its parent's default session's place (working directory and
exported variables), read there and brought to each fork, the forks acquired all or
none, and the blocking form of an asyncio fork. Imports no Ray."""

import asyncio
import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, List, Optional

# what the parent's default session prints of its place: its working directory, then
# its exported variables as the same shell reads them back
SESSION_STATE = "pwd; export -p"


def session_state(result) -> str:
    """The shell lines that bring a new default session to where the parent's is, from
    what SESSION_STATE printed there ("" if it failed)."""
    if result.exit_code != 0:
        return ""
    cwd, _, exports = result.stdout.decode("utf-8", "surrogateescape").partition("\n")
    return "cd -- %s\n%s" % (shlex.quote(cwd), exports)


def replay_error(sandbox: str, result) -> Optional[BaseException]:
    """Why the session of fork ``sandbox`` did not take its parent's place (None: it
    did), from what running ``session_state``'s lines there gave."""
    if isinstance(result, BaseException):
        return result
    if result.exit_code != 0:
        return RuntimeError("fork %s: its session did not take its parent's working "
                            "directory and variables: %s" % (sandbox, result.stderr[-500:]))
    return None


def run_to_end(work):
    """Run coroutine ``work`` to its end from blocking code, also where this thread
    already runs an event loop (a notebook's): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, work).result()


def check_count(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError("fork: n must be an int >= 1, got %r" % (n,))


async def start_forks(acquire: Callable[[], Awaitable], n: int, state: str,
                      release: Callable[[object], Awaitable]) -> List:
    """``n`` sandboxes from ``acquire()``, each one's default session brought to
    ``state`` (``session_state``'s lines; "" for none). All or none: when one cannot
    be acquired or brought there, those acquired are released (``release``) and its
    error is raised."""
    got = await asyncio.gather(*(acquire() for _ in range(n)), return_exceptions=True)
    forks = [sb for sb in got if not isinstance(sb, BaseException)]
    errors = [exc for exc in got if isinstance(exc, BaseException)]
    if not errors and state:
        done = await asyncio.gather(*(sb.run_async(state) for sb in forks),
                                    return_exceptions=True)
        errors = [e for e in (replay_error(sb.sandbox, r) for sb, r in zip(forks, done)) if e]
    if errors:
        await asyncio.gather(*(release(sb) for sb in forks), return_exceptions=True)
        raise errors[0]
    return forks
