"""What a fork needs whichever client makes it (forks.py through Ray, remote/pool.py
through the service): its parent's default session's place (working directory and
exported variables), read there and brought to each fork, and the blocking form of
an asyncio fork. Imports no Ray."""

import asyncio
import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

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
