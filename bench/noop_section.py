"""The noop section of bench/run_all.py: a no-op command through the public API
(``ray.get(sb.exec.remote("true"))`` and the session form ``sb.run``), beside: a bare
Ray actor whose method spawns ``true`` itself (the floor of our path: one actor call and
one spawn), a bare actor call, the same bare actor asking the least a daemon can do
(``bench/minimal_daemon.py``) to run ``true`` (what any design that runs the command in
another process costs over the floor), the yardstick of ``.remote()``'s own shape (a
threaded actor asking the minimal daemon and returning an ``ExecResult``) and the same
in the handle host's asyncio form, the daemon
client straight to a sandbox, the handle's direct calls (``sb.exec("true")``,
``sb.run("true")``: the caller's own connection to the daemon) beside the daemon client
on the handle's own sandbox, and SWE-ReX's ``swerex-remote`` server (a host process, no
sandbox) through its ``RemoteRuntime``: ``execute`` and ``run_in_session``. Interleaved
rounds in a shuffled order."""

import asyncio
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

import ray

import sandman_ray as sandman
from sandman_ray import DaemonClient, ExecResult
from sandman_ray.spec import SandboxSpec

import minimal_daemon  # bench/minimal_daemon.py (bench/ is on the path of run_all.py)
from common import ENV, pct, provider

# this module is not importable in Ray's workers: its actors travel by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

YARDSTICK = "threaded actor -> minimal daemon: exec true, an ExecResult (the yardstick)"
ASYNC_YARDSTICK = "asyncio actor -> minimal daemon: exec true, an ExecResult (the host's form)"


@ray.remote(num_cpus=0)
class Bare:
    """The floor of our path: a Ray actor call, and the same call spawning ``true``."""

    def noop(self):
        return None

    def spawn_true(self):
        pid = os.posix_spawn("/bin/true", ["true"], ENV)
        return os.waitpid(pid, 0)[1]

    def minimal_daemon_true(self, address: str):
        """``true`` through bench/minimal_daemon.py, returning its exit code as
        ``spawn_true`` does."""
        if getattr(self, "minimal", None) is None:
            self.minimal = DaemonClient(address, "unused")
        return self.minimal.exec("true").exit_code


YARDSTICK_THREADS = 192  # the threads of the yardstick actor (a handle host's before it was async)


@ray.remote(num_cpus=0, max_concurrency=YARDSTICK_THREADS)
class ResultYardstick:
    """The yardstick of ``.remote()`` exec, of its shape: a threaded actor that asks bench/minimal_daemon.py to run a command and returns the
    ``ExecResult``, the type ``sb.exec.remote`` returns (the int of
    ``Bare.minimal_daemon_true`` is the older yardstick, kept beside it). A daemon
    connection per thread."""

    def __init__(self, address: str):
        self.address, self.local = address, threading.local()

    def exec(self, cmd: str) -> ExecResult:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = DaemonClient(self.address, "unused")
        return client.exec(cmd)


@ray.remote(num_cpus=0)
class AsyncResultYardstick:
    """The yardstick in the handle host's own form: an asyncio actor that skips other
    libraries' serializers, as the host does, and asks bench/minimal_daemon.py through
    one multiplexed connection (``AsyncDaemonClient``), returning the ``ExecResult``.
    Beside ``ResultYardstick`` it shows what the asyncio form costs any actor; beside
    the public API, what the host's code and our daemon add to it."""

    def __init__(self, address: str):
        from sandman_ray.host import _without_foreign_serializers
        _without_foreign_serializers()
        self.address, self.client = address, None

    async def exec(self, cmd: str) -> ExecResult:
        if self.client is None:
            from sandman_ray.client import AsyncDaemonClient
            self.client = await AsyncDaemonClient.connect(self.address, "unused")
        return await self.client.exec(cmd)


class SweRex:
    """SWE-ReX's server (``swerex-remote``) as a host process, and its client."""

    def __init__(self):
        from swerex.runtime.remote import RemoteRuntime
        token, port = secrets.token_hex(8), _free_port()
        server = shutil.which("swerex-remote", path=str(Path(sys.executable).parent))
        if server is None:
            raise SystemExit("swerex-remote is missing: make bench installs it (pip install "
                             "-e '.[bench]')")
        self.proc = subprocess.Popen([server, "--host", "127.0.0.1", "--port", str(port),
                                      "--auth-token", token], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=dict(os.environ, **ENV))
        self.loop = asyncio.new_event_loop()
        self.runtime = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token=token)
        deadline = time.monotonic() + 60
        while not self._alive():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("swerex-remote did not start")
            time.sleep(0.2)
        from swerex.runtime.abstract import CreateBashSessionRequest
        self.loop.run_until_complete(self.runtime.create_session(CreateBashSessionRequest()))

    def _alive(self) -> bool:
        try:
            return bool(self.loop.run_until_complete(self.runtime.is_alive(timeout=2)).is_alive)
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    def execute(self):
        from swerex.runtime.abstract import Command
        result = self.loop.run_until_complete(self.runtime.execute(Command(command="true",
                                                                           shell=True)))
        assert result.exit_code == 0

    def run_in_session(self):
        from swerex.runtime.abstract import BashAction
        result = self.loop.run_until_complete(self.runtime.run_in_session(
            BashAction(command="true", check="silent")))
        assert result.exit_code == 0

    def close(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.loop.close()


class SandmanRex:
    """SWE-ReX's client API on sandman: a SandmanRuntime on the bench's handle (its calls
    are the handle's direct ones), with its default bash session open."""

    def __init__(self, sb):
        from sandman_ray.integrations.swerex import SandmanRuntime
        from swerex.runtime.abstract import CreateBashSessionRequest
        self.loop = asyncio.new_event_loop()
        self.runtime = SandmanRuntime(sb)
        self.loop.run_until_complete(self.runtime.create_session(CreateBashSessionRequest()))

    execute = SweRex.execute
    run_in_session = SweRex.run_in_session

    def close(self):
        self.loop.run_until_complete(self.runtime.close())
        self.loop.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def noop(samples: int, rounds: int = 50) -> dict:
    """Each row in ``rounds`` short blocks, the rows in a new random order each round,
    each block after one untimed call: a slow stretch of the machine falls on every row
    alike, and no row always follows the one that spawns processes (the first call after
    a spawn finds the daemon still cleaning up, and colder caches)."""
    pool = "bench-noop-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={"host": 1})
    direct = provider().bind("bench-direct-" + uuid.uuid4().hex[:6])
    info = asyncio.run(direct.create("direct-" + uuid.uuid4().hex[:8],
                                     SandboxSpec(image="host"), {}))
    client = DaemonClient(info.address, info.token)
    sb = sandman.acquire("host", pool=pool, timeout=120)
    bare = Bare.remote()
    swerex = SweRex()
    minimal_dir = Path(tempfile.mkdtemp(prefix="sandman-bench-"))
    minimal = minimal_daemon.start(minimal_dir / "minimal.sock")
    minimal_addr = "unix:%s" % (minimal_dir / "minimal.sock")
    yardstick = ResultYardstick.remote(minimal_addr)
    async_yardstick = AsyncResultYardstick.remote(minimal_addr)
    # the daemon client on the handle's own sandbox (its lease's address and token):
    # the direct calls' yardstick, the same daemon under the same limits
    same = DaemonClient(sb._direct.address, sb._direct.token)
    ours = SandmanRex(sb)
    try:
        client.run("true")
        ray.get(sb.run.remote("true"))  # both sessions open before timing
        rows: Dict[str, Callable[[], object]] = {
            "public API: exec true": lambda: ray.get(sb.exec.remote("true")),
            "public API: session true": lambda: ray.get(sb.run.remote("true")),
            "bare actor spawning true (floor)": lambda: ray.get(bare.spawn_true.remote()),
            "bare actor call, no work": lambda: ray.get(bare.noop.remote()),
            "bare actor -> minimal daemon: exec true":
                lambda: ray.get(bare.minimal_daemon_true.remote(minimal_addr)),
            YARDSTICK: lambda: ray.get(yardstick.exec.remote("true")),
            ASYNC_YARDSTICK: lambda: ray.get(async_yardstick.exec.remote("true")),
            "daemon client: exec true": lambda: client.exec("true"),
            "daemon client: session true": lambda: client.run("true"),
            "direct: exec true": lambda: sb.exec("true"),
            "direct: session true": lambda: sb.run("true"),
            "daemon client, the handle's sandbox: exec true": lambda: same.exec("true"),
            "daemon client, the handle's sandbox: session true": lambda: same.run("true"),
            "SWE-ReX: execute true": swerex.execute,
            "SWE-ReX: run_in_session true": swerex.run_in_session,
            "SWE-ReX client on SandmanRuntime: execute true": ours.execute,
            "SWE-ReX client on SandmanRuntime: run_in_session true": ours.run_in_session,
        }
        slow = {"SWE-ReX: execute true", "SWE-ReX: run_in_session true",
                "SWE-ReX client on SandmanRuntime: run_in_session true"}
        times: Dict[str, List[float]] = {name: [] for name in rows}
        for fn in rows.values():  # warm up
            for _ in range(20):
                fn()
        order = random.Random(1)  # seeded: the same orders in every run
        names = list(rows)
        for _ in range(rounds):
            order.shuffle(names)
            for name in names:
                fn = rows[name]
                count = max(1, samples // rounds // (5 if name in slow else 1))
                fn()  # untimed: see the docstring
                for _ in range(count):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
    finally:
        minimal.kill()
        minimal.wait()
        shutil.rmtree(minimal_dir, ignore_errors=True)
        swerex.close()
        ours.close()
        client.close()
        same.close()
        sandman.release(sb)
        sandman.shutdown_pool(pool)
        asyncio.run(direct.shutdown())
    out = {name: {"p50_ms": pct(v, 0.5) * 1e3, "p99_ms": pct(v, 0.99) * 1e3, "samples": len(v)}
           for name, v in times.items()}
    p50 = {name: row["p50_ms"] for name, row in out.items()}
    out["ratios"] = {
        "exec / floor": p50["public API: exec true"] / p50["bare actor spawning true (floor)"],
        "minimal daemon / floor": p50["bare actor -> minimal daemon: exec true"]
        / p50["bare actor spawning true (floor)"],
        "exec / minimal daemon": p50["public API: exec true"]
        / p50["bare actor -> minimal daemon: exec true"],
        "exec / ExecResult yardstick": p50["public API: exec true"]
        / p50[YARDSTICK],
        "asyncio / threaded ExecResult yardstick": p50[ASYNC_YARDSTICK] / p50[YARDSTICK],
        "exec / asyncio ExecResult yardstick": p50["public API: exec true"]
        / p50[ASYNC_YARDSTICK],
        "direct exec / daemon client": p50["direct: exec true"]
        / p50["daemon client, the handle's sandbox: exec true"],
        "direct session / daemon client": p50["direct: session true"]
        / p50["daemon client, the handle's sandbox: session true"],
        "SWE-ReX execute / exec": p50["SWE-ReX: execute true"] / p50["public API: exec true"],
        "SWE-ReX run_in_session / session": p50["SWE-ReX: run_in_session true"]
        / p50["public API: session true"],
        "SWE-ReX server / SandmanRuntime, execute": p50["SWE-ReX: execute true"]
        / p50["SWE-ReX client on SandmanRuntime: execute true"],
        "SWE-ReX server / SandmanRuntime, run_in_session": p50["SWE-ReX: run_in_session true"]
        / p50["SWE-ReX client on SandmanRuntime: run_in_session true"],
        "SandmanRuntime run_in_session / direct session":
            p50["SWE-ReX client on SandmanRuntime: run_in_session true"]
            / p50["direct: session true"]}
    return out


def noop_rows(noop: dict) -> List[tuple]:
    rows = []
    for name, row in noop.items():
        if name != "ratios":
            rows.append(("noop", name, "%.3f ms" % row["p50_ms"], "p99 %.3f ms" % row["p99_ms"]))
    ratios = (("exec true: public API / floor", "exec / floor", "%.2fx", "target <= 1.25x"),
              ("exec true: bare actor -> minimal daemon / floor", "minimal daemon / floor",
               "%.2fx", "any daemon's least"),
              ("exec true: public API / bare actor -> minimal daemon", "exec / minimal daemon",
               "%.2fx", "the int yardstick"),
              ("exec true: public API / threaded actor -> minimal daemon, ExecResult",
               "exec / ExecResult yardstick", "%.2fx", "target <= 1.10x"),
              ("exec true: asyncio / threaded actor -> minimal daemon, ExecResult",
               "asyncio / threaded ExecResult yardstick", "%.2fx", "the asyncio form's own cost"),
              ("exec true: public API / asyncio actor -> minimal daemon, ExecResult",
               "exec / asyncio ExecResult yardstick", "%.2fx",
               "the host's code and our daemon over its form"),
              ("exec true: direct / daemon client, the handle's sandbox",
               "direct exec / daemon client", "%.2fx", "target <= 1.10x"),
              ("session true: direct / daemon client, the handle's sandbox",
               "direct session / daemon client", "%.2fx", "target <= 1.15x"),
              ("SWE-ReX execute / public API exec", "SWE-ReX execute / exec", "%.1fx",
               "target >= 1.5x"),
              ("SWE-ReX run_in_session / public API session",
               "SWE-ReX run_in_session / session", "%.1fx", "target >= 50x"),
              ("SWE-ReX's client: its own server / SandmanRuntime, execute",
               "SWE-ReX server / SandmanRuntime, execute", "%.1fx", ""),
              ("SWE-ReX's client: its own server / SandmanRuntime, run_in_session",
               "SWE-ReX server / SandmanRuntime, run_in_session", "%.1fx", ""),
              ("SandmanRuntime run_in_session / direct session",
               "SandmanRuntime run_in_session / direct session", "%.1fx",
               "a terminal, bash -n first"))
    for label, key, fmt, note in ratios:
        rows.append(("noop", label, fmt % noop["ratios"][key], note))
    return rows
