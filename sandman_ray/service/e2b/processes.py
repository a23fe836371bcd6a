"""envd's process service (``/process.Process/...``), made of the daemon's background
processes (``spawn``, ``proc_follow``, ``proc_stdin``, ``proc_signal``) and terminals
(``pty_*``): start, connect, list, input, stdin, signals and a terminal's size."""

import asyncio

from aiohttp import web

from sandman_ray.errors import SandmanError
from sandman_ray.service.e2b import connect
from sandman_ray.service.e2b.connect import RpcError, b64, invalid
from sandman_ray.service.e2b.envd import (
    HOME, EnvdPart, _path, _rpc_error, relay, stream_response)
from sandman_ray.service.e2b.sandboxes import USER

PROC_BUFFER = 4 * 1024 * 1024  # each stream's ring in the daemon: what a reconnect finds
KEEPALIVE = {"event": {"keepalive": {}}}
PROCS_KEPT = 1024  # processes a sandbox's record names before those that ended go


class Processes(EnvdPart):
    """See the module's docstring."""

    def routes(self) -> list:
        process = {"Start": self.start, "Connect": self.connect_process, "List": self.list,
                   "SendInput": self.send_input, "StreamInput": self.stream_input,
                   "SendSignal": self.send_signal, "CloseStdin": self.close_stdin,
                   "Update": self.update}
        return [web.post("/process.Process/" + name, handler)
                for name, handler in process.items()]

    async def start(self, request):
        async def begin(box, client, message):
            config = message.get("process") or {}
            if not isinstance(config, dict):
                raise invalid("process is an object")
            cmd = connect.text(config, "cmd")
            args = config.get("args") or []
            if not cmd or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise invalid("process.cmd is a command and process.args a list of strings")
            envs = config.get("envs") or {}
            if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
                raise invalid("process.envs is an object of strings")
            env = dict(box.envs, HOME=HOME, USER=USER)
            env.update(envs)
            cwd = _path(connect.text(config, "cwd", None) or HOME, "process.cwd")
            argv = [cmd] + args
            # what List tells of it: the config's own fields, not whatever else was sent
            kept = {"cmd": cmd, "args": args, "envs": envs}
            if config.get("cwd") is not None:
                kept["cwd"] = cwd
            if len(box.procs) >= PROCS_KEPT:  # forget those that ended
                alive = {p.pid for p in await client.proc_list() if p.running}
                alive |= {t["pid"] for t in await client.pty_list() if t["running"]}
                for gone in set(box.procs) - alive:
                    del box.procs[gone]
            pty = message.get("pty")
            if pty is not None:
                cols, rows = _size(pty)
                opened = await client.pty_open(argv, cols=cols, rows=rows, cwd=cwd,
                                               env=env, buffer_bytes=PROC_BUFFER)
                pid = opened["pid"]
                box.procs[pid] = {"config": kept, "pty": opened["pty"]}
            else:
                pid = await client.spawn(argv, cwd=cwd, env=env, buffer_bytes=PROC_BUFFER,
                                         stdin_open=bool(message.get("stdin")) or None)
                box.procs[pid] = {"config": kept, "pty": None}
            if message.get("tag"):
                tag = connect.text(message, "tag")
                box.procs[pid]["tag"] = tag[:256]
            return pid
        return await self._stream(request, begin, kill_at_deadline=True)

    async def connect_process(self, request):
        async def find(box, client, message):
            return self._pid_of(box, message.get("process"))
        return await self._stream(request, find, kill_at_deadline=False)

    async def _stream(self, request, begin, kill_at_deadline: bool):
        """A server stream of a process's events: start (its pid), its output as it
        comes, its end. The call's deadline (``Connect-Timeout-Ms``) ends it with
        deadline_exceeded and, for a Start, kills the process, as envd does; a client
        that goes away stops the following only."""
        response = None
        error = None
        try:
            box, client = await self._sandbox(request)  # its token before its body
            message = await connect.stream_request(request)
            deadline = connect.timeout_s(request)
            pid = await begin(box, client, message)
            record = box.procs.get(pid, {})
            response = await stream_response(request)
            await response.write(connect.envelope({"event": {"start": {"pid": pid}}}))
            follow = self._follow_pty(client, record["pty"]) if record.get("pty") else \
                self._follow(client, pid)
            killer = None
            if kill_at_deadline and deadline:  # whether or not its client is still there
                killer = asyncio.get_running_loop().call_later(
                    deadline, lambda: asyncio.ensure_future(self._kill(client, record, pid)))
            try:
                await asyncio.wait_for(relay(response, follow, request, KEEPALIVE), deadline)
            except asyncio.TimeoutError:
                error = RpcError("deadline_exceeded", "the command ran past its timeout "
                                 "(%g s) and was killed" % deadline if kill_at_deadline else
                                 "the connection's timeout (%g s) passed" % deadline)
            else:
                if killer is not None:  # it ended in time
                    killer.cancel()
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            error = _rpc_error(exc)
        if response is None:  # nothing was sent: the whole answer is its error's end
            response = await stream_response(request)
        await response.write(connect.end_of_stream(error))
        await response.write_eof()
        return response

    @staticmethod
    async def _kill(client, record: dict, pid: int) -> None:
        try:
            if record.get("pty"):
                await client.pty_close(record["pty"], kill_grace_s=0)
            else:
                await client.proc_signal(pid, "KILL")
        except SandmanError:  # ended meanwhile, or its sandbox did
            pass

    async def _follow(self, client, pid):
        stream = client.proc_follow(pid)
        try:
            async for item in stream:
                if isinstance(item, tuple):
                    yield {"event": {"data": {item[0]: b64(item[1])}}}
                else:
                    yield {"event": self._end(item)}
        finally:
            await stream.aclose()

    async def _follow_pty(self, client, term: int):
        cursor = 0
        while True:
            got = await client.pty_read(term, cursor, timeout=30.0)
            cursor = got["cursor"]
            if got["data"]:
                yield {"event": {"data": {"pty": b64(got["data"])}}}
            if got.get("eof") or (not got["running"] and not got["data"]):
                if got["running"]:
                    got = await client.pty_close(term)
                yield {"event": self._end(got)}
                return

    @staticmethod
    def _end(status: dict) -> dict:
        code = status.get("exit_code")
        sig = status.get("signal")
        end = {"exited": code is not None and not sig,
               "exitCode": code if code is not None else -1,
               "status": ("signal: %s" % _signal_name(sig)) if sig else
               "exit status %d" % (code or 0)}
        return {"end": end}

    def _pid_of(self, box, selector) -> int:
        if not isinstance(selector, dict):
            raise invalid("process is a selector: {pid} or {tag}")
        if "pid" in selector:
            pid = connect.integer(selector["pid"], "process.pid")
            if pid not in box.procs:
                raise RpcError("not_found", "process with pid %d not found" % pid)
            return pid
        tag = connect.text(selector, "tag")
        for pid, record in box.procs.items():
            if record.get("tag") == tag:
                return pid
        raise RpcError("not_found", "process with tag %r not found" % tag)

    async def list(self, request):
        async def running(box, client, message):
            alive = {p.pid for p in await client.proc_list() if p.running}
            alive |= {t["pid"] for t in await client.pty_list() if t["running"]}
            procs = []
            for pid, record in list(box.procs.items()):
                if pid not in alive:
                    continue
                info = {"config": record["config"], "pid": pid}
                if "tag" in record:
                    info["tag"] = record["tag"]
                procs.append(info)
            return {"processes": procs}
        return await self._unary(request, running)

    async def _input(self, box, client, selector, given) -> None:
        pid = self._pid_of(box, selector)
        if not isinstance(given, dict):
            raise invalid("input is {stdin} or {pty}")
        record = box.procs[pid]
        if "pty" in given:
            if not record.get("pty"):
                raise invalid("process %d has no terminal" % pid)
            await client.pty_write(record["pty"], connect.unb64(given["pty"], "input.pty"))
        elif "stdin" in given:
            await client.proc_stdin(pid, connect.unb64(given["stdin"], "input.stdin"))
        else:
            raise invalid("input is {stdin} or {pty}")

    async def send_input(self, request):
        async def send(box, client, message):
            await self._input(box, client, message.get("process"), message.get("input"))
            return {}
        return await self._unary(request, send)

    async def stream_input(self, request):
        """A client stream: its first message names the process, the next carry input."""
        try:
            box, client = await self._sandbox(request)
            selector = None
            async for message in connect.envelopes(request):
                if "start" in message:
                    selector = (message["start"] or {}).get("process")
                    self._pid_of(box, selector)
                elif "data" in message:
                    if selector is None:
                        raise invalid("the stream's first message is its start")
                    await self._input(box, client, selector, (message["data"] or {}).get("input"))
            error = None
        except Exception as exc:  # noqa: BLE001
            error = _rpc_error(exc)
        body = (b"" if error else connect.envelope({})) + connect.end_of_stream(error)
        return web.Response(body=body, headers={"Content-Type": connect.STREAM_JSON})

    async def send_signal(self, request):
        async def signal(box, client, message):
            pid = self._pid_of(box, message.get("process"))
            asked = message.get("signal")
            sig = {"SIGNAL_SIGKILL": "KILL", "SIGNAL_SIGTERM": "TERM", 9: "KILL",
                   15: "TERM"}.get(asked) if isinstance(asked, (str, int)) else None
            if sig is None:
                raise invalid("signal is SIGNAL_SIGKILL or SIGNAL_SIGTERM")
            record = box.procs[pid]
            if record.get("pty"):
                status = await client.pty_list()
                if not any(t["pty"] == record["pty"] and t["running"] for t in status):
                    raise RpcError("not_found", "process with pid %d not found" % pid)
                await client.pty_close(record["pty"], kill_grace_s=0 if sig == "KILL" else 0.5)
            elif not (await client.proc_signal(pid, sig)).running:
                raise RpcError("not_found", "process with pid %d not found" % pid)
            return {}
        return await self._unary(request, signal)

    async def close_stdin(self, request):
        async def close(box, client, message):
            pid = self._pid_of(box, message.get("process"))
            await client.proc_stdin(pid, close=True)
            return {}
        return await self._unary(request, close)

    async def update(self, request):
        async def resize(box, client, message):
            pid = self._pid_of(box, message.get("process"))
            cols, rows = _size(message.get("pty"))
            record = box.procs[pid]
            if not record.get("pty"):
                raise invalid("process %d has no terminal" % pid)
            await client.pty_resize(record["pty"], cols, rows)
            return {}
        return await self._unary(request, resize)


def _size(pty) -> tuple:
    """(cols, rows) of a PTY message."""
    size = pty.get("size") if isinstance(pty, dict) else None
    if not isinstance(size, dict):
        raise invalid("pty is {size: {cols, rows}}")
    return (connect.integer(size.get("cols") or 80, "pty.size.cols", 1, 1000),
            connect.integer(size.get("rows") or 24, "pty.size.rows", 1, 1000))


def _signal_name(sig) -> str:
    import signal
    try:
        return signal.Signals(sig).name.lower()[3:]
    except ValueError:
        return str(sig)

