"""The bash session of ``SandmanRuntime`` (sandman_ray.integrations.swerex): an
interactive ``bash`` on one of the sandbox's terminals, as SWE-ReX's ``pexpect``
session is, read by cursor (the daemon keeps a terminal's output in a ring).

The terminal does not echo (as pexpect's ``echo=False``, so neither does bash's
readline). A command is checked first with ``bash -n`` (``BashIncorrectSyntaxError``)
and typed as one line, ``eval`` of the command quoted ``$'...'`` (a multi-line command
gives one prompt); the prompt carries the session's marker, the command's number and
its exit code, so one read ends a command with its exit code, and a prompt left over
from an interrupt is never taken for the next command's. The output is what the
terminal shows: stdout and stderr in the order written, control sequences removed,
``\r\n`` as ``\n``. A write and the first read of its output are sent together.
"""

import asyncio
import codecs
import re
import secrets
from typing import Any, List, Optional, Tuple

from sandman_ray.errors import DaemonError

from swerex.exceptions import (
    BashIncorrectSyntaxError, CommandTimeoutError, NoExitCodeError, NonZeroExitCodeError)
from swerex.runtime.abstract import (
    BashAction, BashInterruptAction, BashObservation, CreateBashSessionRequest,
    CreateBashSessionResponse)

# What ends a command's output on the terminal: the prompt, which carries the session's
# marker, the number of the command it follows and its exit code.
PROMPT = "__SANDMAN_%s_${__sandman_n}_$?__"
# A pty_read waits at most this long in the daemon; a longer wait reads again.
READ_WAIT_S = 30.0
# The terminal's output kept in the sandbox for reading (the daemon's ring).
TERMINAL_BYTES = 8 * 1024 * 1024
# SWE-ReX's terminal: pexpect's default size.
COLS, ROWS = 80, 24
# SIGKILLs the process group of each stopped child of $1 (bash), and prints the groups.
_KILL_STOPPED = (
    'for d in /proc/[0-9]*; do read -r _ _ state parent group _ < "$d/stat" 2>/dev/null '
    '|| continue; [ "$parent" = "$1" ] && [ "$state" = T ] && kill -9 -"$group" '
    '2>/dev/null && echo "$group"; done; exit 0')
# Exits 1 while a child of $1 (bash) in one of the groups after it is left, in any
# state (a zombie until bash reaps it).
_IN_GROUPS = (
    'bash=$1; shift; for d in /proc/[0-9]*; do read -r _ _ _ parent group _ < "$d/stat" '
    '2>/dev/null || continue; [ "$parent" = "$bash" ] || continue; for g; do '
    '[ "$group" = "$g" ] && exit 1; done; done; exit 0')
# Control sequences a terminal program writes (colours, cursor moves, bracketed paste).
_CONTROL = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")


class _Timeout(Exception):
    """No expected output in time."""


class BashSession:
    """An interactive bash on one of the sandbox's terminals, read by cursor (the
    daemon keeps its output in a ring), and what of that output is not yet taken."""

    def __init__(self, sandbox, request: CreateBashSessionRequest):
        self.sandbox, self.request = sandbox, request
        self.marker = secrets.token_hex(4)
        # any of this session's prompts: (command number, exit code)
        self.prompts = re.compile(r"__SANDMAN_%s_(\d+)_(\d+)__" % self.marker)
        self.pty: Optional[int] = None
        self.pid: Optional[int] = None  # bash's, in the sandbox
        self.cursor = 0
        self.pending = ""  # read, not yet part of an answer
        self.decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
        self.eof = False
        self.number = 0  # of the last command sent as one
        self.lock = asyncio.Lock()  # one action at a time

    async def start(self) -> CreateBashSessionResponse:
        # the terminal does not echo what is typed (as pexpect's echo=False), so neither
        # does bash's readline; what is typed once it says so is not shown
        ready = "__SANDMAN_%s_READY__" % self.marker
        opened = await self.sandbox.pty_open_async(
            ["/bin/sh", "-c", "stty -echo 2>/dev/null; printf '%s'; exec bash" % ready],
            cols=COLS, rows=ROWS, env={"PS1": "", "PS2": "", "PS0": ""},
            buffer_bytes=TERMINAL_BYTES)
        self.pty, self.pid = opened["pty"], opened["pid"]  # the pid is bash's (exec)
        try:
            await self._expect([ready], self.request.startup_timeout)
        except _Timeout as exc:
            raise CommandTimeoutError("the terminal of bash session %s did not start within "
                                      "%g s" % (self.request.session,
                                                self.request.startup_timeout)) from exc
        steps = ["source " + _quoted(path) for path in self.request.startup_source]
        # history expansion off (no "!" in a command is taken for an event), and
        # bracketed paste (readline would end each line with "\r" and a newline of its
        # own while the terminal does not echo)
        steps += ["set +H", "bind 'set enable-bracketed-paste off' 2>/dev/null",
                  "__sandman_n=0", "export PS1='%s' PS2='' PS0=''" % (PROMPT % self.marker)]
        typed = self._type(" ; ".join(steps) + "\n")
        try:
            before, _ = await self._expect([], self.request.startup_timeout, typed=typed)
        except _Timeout as exc:
            raise CommandTimeoutError("the bash session %s did not start within %g s"
                                      % (self.request.session, self.request.startup_timeout)
                                      ) from exc
        return CreateBashSessionResponse(output=_clean(before))

    async def run(self, action) -> BashObservation:
        async with self.lock:
            if isinstance(action, BashInterruptAction):
                return await self._interrupt(action)
            if action.is_interactive_command or action.is_interactive_quit:
                return await self._interactive(action)
            observation = await self._normal(action)
        if action.check == "raise" and observation.exit_code != 0:
            message = "Command %r failed with exit code %s. Here is the output:\n%r" % (
                action.command, observation.exit_code, observation.output)
            raise NonZeroExitCodeError("%s: %s" % (action.error_msg, message)
                                       if action.error_msg else message)
        return observation

    async def _normal(self, action: BashAction) -> BashObservation:
        await self._check_syntax(action.command)
        self.number += 1
        typed = self._type("__sandman_n=%d; eval %s\n" % (self.number, _ansi_c(action.command)))
        try:
            before, found = await self._expect(action.expect, action.timeout,
                                               number=self.number, typed=typed)
        except _Timeout as exc:
            raise CommandTimeoutError("timeout after %s seconds while running command %r"
                                      % (action.timeout, action.command)) from exc
        output = _clean(before)
        if isinstance(found, int):  # an expected string, before the command ended
            if action.check == "raise":
                raise NoExitCodeError("command %r is still running (it printed %r): no "
                                      "exit code yet" % (action.command, action.expect[found]))
            return BashObservation(output=output, exit_code=None,
                                   expect_string=action.expect[found])
        exit_code = None if action.check == "ignore" else found[1]
        return BashObservation(output=output, exit_code=exit_code, expect_string=PROMPT)

    async def _interactive(self, action: BashAction) -> BashObservation:
        """A line typed into the program that runs on the terminal (no exit code)."""
        typed = self._type(action.command + "\n")
        try:
            before, found = await self._expect(action.expect, action.timeout, typed=typed)
        except _Timeout as exc:
            raise CommandTimeoutError("timeout after %s seconds while running command %r"
                                      % (action.timeout, action.command)) from exc
        output = _clean(before)
        if action.is_interactive_quit:
            # back at bash: the program may have left the terminal echoing
            token = secrets.token_hex(4)
            typed = self._type("stty -echo; echo '__SANDMAN_QUIT_%s'\n" % token)
            try:
                await self._expect(["__SANDMAN_QUIT_%s" % token], 1.0, typed=typed)
                await self._expect([], 1.0)
            except _Timeout as exc:
                raise CommandTimeoutError("bash did not come back after %r" % action.command
                                          ) from exc
        else:
            output = output.lstrip().removeprefix(action.command).strip()
        return BashObservation(output=output, exit_code=0, expect_string=_matched(action, found))

    async def _interrupt(self, action: BashInterruptAction) -> BashObservation:
        """Ctrl-C up to ``n_retry`` times, each waiting ``timeout`` for bash; then
        Ctrl-Z and a SIGKILL of the stopped job."""
        output = ""
        for _ in range(action.n_retry):
            typed = self._type("\x03")
            try:
                before, found = await self._expect(action.expect, action.timeout, typed=typed)
            except _Timeout:
                continue
            return BashObservation(output=(output + _clean(before)).strip(), exit_code=0,
                                   expect_string=_matched(action, found))
        try:
            before, found = await self._expect(action.expect, action.timeout,
                                               typed=self._type("\x1a"))
        except _Timeout as exc:
            raise CommandTimeoutError("failed to interrupt session %s" % action.session) from exc
        await self._kill_stopped(max(action.timeout, 1.0))
        return BashObservation(output=(output + _clean(before)).strip(), exit_code=0,
                               expect_string=_matched(action, found))

    async def _kill_stopped(self, timeout: float) -> None:
        """SIGKILL the job Ctrl-Z stopped (every process group of bash's stopped
        children), from beside bash rather than by its ``kill %1``, and wait (up to
        ``timeout`` s) until bash has reaped it. bash, idle at its prompt meanwhile,
        says ``Killed`` before the next command's prompt, as it does in SWE-ReX's
        session (where a command's own ``kill`` raced bash's reaping: the word came
        with either command)."""
        killed = await self.sandbox.exec_async(["/bin/sh", "-c", _KILL_STOPPED, "sh",
                                                str(self.pid)])
        groups = killed.stdout.decode().split()
        deadline = asyncio.get_running_loop().time() + timeout
        while groups and asyncio.get_running_loop().time() < deadline:
            left = await self.sandbox.exec_async(["/bin/sh", "-c", _IN_GROUPS, "sh",
                                                  str(self.pid), *groups])
            if left.exit_code == 0:
                return

    async def _check_syntax(self, command: str) -> None:
        checked = await self.sandbox.exec_async(["bash", "-n"], stdin=command.encode() + b"\n")
        if checked.exit_code != 0:
            stdout, stderr = as_text(checked.stdout), as_text(checked.stderr)
            raise BashIncorrectSyntaxError(
                "Error (exit code %s) while checking bash command \n%r\n---- Stderr ----\n%s"
                "\n---- Stdout ----\n%s" % (checked.exit_code, command, stderr, stdout),
                extra_info={"bash_stdout": stdout, "bash_stderr": stderr})

    def _type(self, text: str) -> "asyncio.Future":
        """Type ``text`` into the terminal; the write is under way when this returns
        (``_expect`` reads meanwhile, and waits for it)."""
        typed = asyncio.ensure_future(self.sandbox.pty_write_async(self.pty, text.encode()))
        typed.add_done_callback(_retrieved)  # its error is raised by the read that waits
        return typed

    async def _expect(self, strings: List[str], timeout: Optional[float],
                      number: Optional[int] = None,
                      typed: Optional["asyncio.Future"] = None) -> Tuple[str, Any]:
        """The output up to the first of ``strings`` (regular expressions, as pexpect
        takes them) or of this session's prompts (the prompt of command ``number``
        only, when given), taken: (the output before it, the index of the string or the
        prompt's (number, exit code)). _Timeout after ``timeout`` s (None: no limit).
        ``typed``: a write under way, whose answer is awaited with the first read's."""
        patterns = [re.compile(s, re.DOTALL) for s in strings]
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            return await self._reading(patterns, number, loop, deadline, typed)
        finally:
            if typed is not None and not typed.done():  # it is typed, whatever comes first
                await asyncio.wait([typed])

    async def _reading(self, patterns, number, loop, deadline, typed):
        while True:
            found = self._search(patterns, number)
            if found is not None:
                return found
            if self.eof:
                raise CommandTimeoutError("the bash session ended (its terminal closed)")
            left = READ_WAIT_S if deadline is None else deadline - loop.time()
            if left <= 0:
                raise _Timeout()
            read = await self.sandbox.pty_read_async(self.pty, self.cursor,
                                                     timeout=min(left, READ_WAIT_S))
            if typed is not None:  # its answer came first: requests are answered in turn
                await typed
                typed = None
            self.cursor = read["cursor"]
            self.pending += self.decoder.decode(read["data"])
            self.eof = read["eof"]

    def _search(self, patterns, number: Optional[int]):
        best = None  # (start, end, what)
        for index, pattern in enumerate(patterns):
            match = pattern.search(self.pending)
            if match and (best is None or match.start() < best[0]):
                best = (match.start(), match.end(), index)
        for match in self.prompts.finditer(self.pending):
            if best is not None and match.start() >= best[0]:
                break
            if number is None or int(match.group(1)) == number:
                best = (match.start(), match.end(), (int(match.group(1)), int(match.group(2))))
                break
        if best is None:
            return None
        start, end, what = best
        before, self.pending = self.pending[:start], self.pending[end:]
        return self.prompts.sub("", before), what

    async def close(self) -> None:
        if self.pty is not None:
            pty, self.pty = self.pty, None
            try:
                await self.sandbox.pty_close_async(pty)
            except DaemonError:  # closed already
                pass


def _ansi_c(text: str) -> str:
    """``text`` as one bash word on one line: ``$'...'`` with every control character
    escaped (a NUL cannot be in a bash string: it is dropped)."""
    out = ["$'"]
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif char == "'":
            out.append("\\'")
        elif char == "\n":
            out.append("\\n")
        elif char == "\0":
            continue
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append("\\x%02x" % ord(char))
        else:
            out.append(char)
    out.append("'")
    return "".join(out)


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _clean(text: str) -> str:
    """Terminal output as SWE-ReX gives it: control sequences removed, ``\\r\\n`` as
    ``\\n``."""
    return _CONTROL.sub("", text).replace("\r\n", "\n")


def _retrieved(future: "asyncio.Future") -> None:
    if not future.cancelled():
        future.exception()


def _matched(action, found) -> str:
    return action.expect[found] if isinstance(found, int) else PROMPT


def as_text(data: bytes) -> str:
    """Output as SWE-ReX gives it: UTF-8, undecodable bytes as escapes."""
    return data.decode("utf-8", "backslashreplace")
