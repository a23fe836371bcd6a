"""A sandbox's background processes and terminals (a mixin of
``operations._Operations``)."""

from typing import Callable, Dict, Optional, Union

from sandman_ray.client.plans import (
    Command, _Transport, _present, _reply_timeout)
from sandman_ray.results import ProcessOutput, ProcessStatus


class _Processes(_Transport):
    """See the module's docstring."""

    # background processes
    def spawn(self, cmd: Command, *, cwd: Optional[str] = None,
              env: Optional[Dict[str, Optional[str]]] = None, stdin: Optional[bytes] = None,
              buffer_bytes: Optional[int] = None, command_id: Optional[str] = None,
              stdin_open: Optional[bool] = None):
        """Start a background process; returns its pid. ``command_id``: started once
        per lease; a retry with the same id gets the same pid. ``stdin_open``: its stdin
        stays open for ``proc_stdin`` (else it reads ``stdin``, then end of file).

        Args:
            cmd: a shell string, run by ``/bin/sh -c``, or an argv list, run directly, as
                for ``exec``.
            cwd: the working directory; None: the daemon's workdir.
            env: variables merged over the sandbox's environment; a value of None removes
                that variable.
            stdin: bytes written to the process's stdin, which is then closed; not with
                ``stdin_open``.
            buffer_bytes: the size in bytes of each stream's ring buffer, which keeps the
                latest output for ``proc_output`` and ``proc_follow``, 1 byte to 16 MiB;
                None: 1 MiB.
            command_id: a name chosen by the caller (1 to 256 characters): the process is
                started once per lease, and a later call with the same id gets its pid.
            stdin_open: True keeps the process's stdin a pipe that ``proc_stdin`` writes
                to and closes; None or False: it reads ``stdin``, then end of file.

        Returns:
            (int): the process's pid inside the sandbox, which names it in the ``proc_*``
                operations of any connection of the lease.

        Raises:
            DaemonError: ``LimitExceeded`` when 4,096 background processes are running;
                ``BadRequest`` when both ``stdin`` and ``stdin_open`` are given.
        """
        fields = _present({"cmd": cmd if isinstance(cmd, str) else list(cmd), "cwd": cwd,
                           "env": env, "stdin": stdin, "buffer_bytes": buffer_bytes,
                           "stdin_open": stdin_open,
                           "command_id": command_id})
        return self._call("spawn", fields, lambda r: r["pid"], self.default_timeout)

    def proc_status(self, pid: int):
        """The status of background process ``pid``: running or how it ended, and
        how much it has written.

        Args:
            pid: the process's pid, as ``spawn`` returned it.

        Returns:
            (ProcessStatus): its status (times are the daemon's wall clock).

        Raises:
            DaemonError: ``ProcessNotFound`` if no background process has that pid (the
                daemon remembers the 256 that exited last).
        """
        return self._call("proc_status", _present({"pid": pid}), ProcessStatus.from_wire,
                                 self.default_timeout)

    def proc_list(self):
        """The status of every background process the daemon knows: those running and
        the 256 that exited last.

        Returns:
            (list[ProcessStatus]): one for each process.
        """
        return self._call("proc_list", {}, lambda rs: [ProcessStatus.from_wire(r) for r in rs],
                                 self.default_timeout)

    def proc_output(self, pid: int, stream: str = "stdout", cursor: int = 0,
                    max_bytes: Optional[int] = None):
        """A slice of a background process's output, read by cursor from the ring
        buffer that keeps its latest ``buffer_bytes`` of each stream.

        Args:
            pid: the process's pid, as ``spawn`` returned it.
            stream: ``"stdout"`` or ``"stderr"``.
            cursor: the byte offset in the stream to read from: 0 for its start, then the
                ``cursor`` of the last answer to go on.
            max_bytes: the most bytes to return, 0 to 16 MiB; None: 16 MiB.

        Returns:
            (ProcessOutput): the bytes from ``cursor``, where to continue, the bytes
                dropped before the oldest one the ring still holds, and ``eof`` once the
                process has exited and everything was read.

        Raises:
            DaemonError: ``ProcessNotFound`` if no background process has that pid.
        """
        fields = _present({"pid": pid, "stream": stream, "cursor": cursor, "max_bytes": max_bytes})
        return self._call("proc_output", fields, ProcessOutput.from_wire,
                                 self.default_timeout)

    def proc_wait(self, pid: int, timeout: Optional[float] = None):
        """Wait for background process ``pid`` to exit, at most ``timeout`` seconds.

        Args:
            pid: the process's pid, as ``spawn`` returned it.
            timeout: seconds to wait; None: until it exits. The client waits for the
                reply up to ``timeout`` plus REPLY_SLACK_S (30 s), or ``default_timeout``
                if that is longer; with None, as long as the process runs.

        Returns:
            (ProcessStatus): its status, whose ``timed_out`` is True if it still runs.

        Raises:
            DaemonError: ``ProcessNotFound`` if no background process has that pid.
        """
        return self._call("proc_wait", _present({"pid": pid, "timeout": timeout}),
                                 ProcessStatus.from_wire,
                                 _reply_timeout(timeout, self.default_timeout))

    def proc_follow(self, pid: int, stdout_cursor: int = 0, stderr_cursor: int = 0, *,
                    stop: Optional[Callable[[], bool]] = None):
        """A background process's output as it comes, from the cursors on: an iterator
        of ``(stream, bytes)`` chunks, then its status (a dict with ``exit_code``,
        ``stdout_cursor``, ``stderr_cursor`` and ``dropped``, the bytes its ring
        buffers had let go before they were sent) once it exits, also kept as the
        iterator's ``result``. Closing the iterator stops following; the process goes
        on.

        Args:
            pid: the process's pid, as ``spawn`` returned it.
            stdout_cursor: the byte offset in its stdout to follow from: 0 for the start,
                or the ``stdout_cursor`` of an earlier follow's status to go on.
            stderr_cursor: the same for its stderr.
            stop: a function of no arguments asked every STOP_POLL_S (0.2 s) while no
                output comes, by the blocking client only (the asyncio client ignores it);
                True stops following. None: never asked.

        Returns:
            (ExecStream): on the blocking client, the iterator of ``(stream, bytes)``
                chunks (each at most 1 MiB) ending with the status: the keys of
                ``proc_status`` (``pid``, ``cmd``, ``running``, ``exit_code``, ``signal``,
                ``started_at``, ``ended_at``, ``stdout_bytes``, ``stderr_bytes``) plus
                ``stdout_cursor``, ``stderr_cursor`` (where to follow from again) and
                ``dropped``. The asyncio client gives an async iterator of the same items.
                The client sets no time limit on it.

        Raises:
            DaemonError: ``ProcessNotFound`` if no background process has that pid.
        """
        return self._stream("proc_follow", {"pid": pid, "stdout_cursor": stdout_cursor,
                                            "stderr_cursor": stderr_cursor},
                            lambda r: r, None, stop)

    def proc_stdin(self, pid: int, data: Union[bytes, str] = b"", close: bool = False):
        """Write to the stdin of a process spawned with ``stdin_open`` (then close it if
        ``close``); the bytes written.

        Args:
            pid: the process's pid, as ``spawn`` returned it.
            data: what to write: bytes, or a str written as UTF-8. The call waits while
                the pipe is full.
            close: close the stdin after the write (the process then reads end of file).

        Returns:
            (int): the number of bytes written.

        Raises:
            DaemonError: ``StdinClosed`` if the process's stdin is not open (spawned
                without ``stdin_open``, or closed) or it stopped reading it;
                ``ProcessNotFound`` if no background process has that pid.
        """
        return self._call("proc_stdin", _present({"pid": pid, "data": data, "close": close}),
                          lambda r: r["written"], self.default_timeout)

    def proc_signal(self, pid: int, signal: Union[int, str] = "TERM", group: bool = True):
        """Send a signal to background process ``pid`` (by default to its process group
        and every descendant too); nothing is sent once it has exited.

        Args:
            pid: the process's pid, as ``spawn`` returned it.
            signal: a name such as ``"TERM"`` or ``"SIGKILL"``, or a number (1 to 64).
            group: True: the whole process group and every descendant; False: the
                process alone.

        Returns:
            (ProcessStatus): its status once the signal was sent.

        Raises:
            DaemonError: ``ProcessNotFound`` if no background process has that pid;
                ``BadRequest`` for an unknown signal.
        """
        return self._call("proc_signal", _present({"pid": pid, "signal": signal, "group": group}),
                                 ProcessStatus.from_wire, self.default_timeout)

    # terminals
    def pty_open(self, cmd: Optional[Command] = None, *, cols: int = 80, rows: int = 24,
                 cwd: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None,
                 stdin: Optional[bytes] = None, buffer_bytes: Optional[int] = None):
        """Start ``cmd`` (default: the sandbox's shell) on a new terminal of ``cols``
        by ``rows``; returns ``{"pty": id, "pid": pid}``. Its output is kept in a ring
        of ``buffer_bytes`` (1 MiB) for ``pty_read``.

        Args:
            cmd: a shell string, run by ``/bin/sh -c``, or an argv list, as for ``exec``;
                None: ``bash`` if it is on ``PATH``, else ``/bin/sh``.
            cols: the terminal's width in columns, 1 to 10,000.
            rows: its height in rows, 1 to 10,000.
            cwd: the working directory; None: the daemon's workdir.
            env: variables merged over the sandbox's environment, a value of None removing
                that variable; ``TERM`` is ``xterm-256color`` unless given.
            stdin: keys typed into the terminal at once.
            buffer_bytes: the size in bytes of the ring that keeps the terminal's latest
                output, 1 byte to 16 MiB; None: 1 MiB.

        Returns:
            (dict): ``{"pty": id, "pid": pid}``: the terminal's id, which names it in the
                other ``pty_*`` operations, and its command's pid.

        Raises:
            DaemonError: ``LimitExceeded`` when 64 terminals are open.
        """
        fields = _present({"cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd),
                           "cols": cols, "rows": rows, "cwd": cwd, "env": env, "stdin": stdin,
                           "buffer_bytes": buffer_bytes})
        return self._call("pty_open", fields, timeout=self.default_timeout)

    def pty_write(self, pty: int, data: Union[bytes, str]):
        """Type ``data`` into the terminal (keys: ``"\\x03"`` is Ctrl-C).

        Args:
            pty: the terminal's id, as ``pty_open`` returned it.
            data: the keys, as bytes or a str written as UTF-8. Writes to one terminal go
                one at a time, in arrival order.

        Returns:
            (None): nothing, once the terminal took all of ``data``.

        Raises:
            DaemonError: ``TerminalNotFound`` if no terminal has that id;
                ``TerminalClosed`` once the terminal is closed (a write waiting for room
                ends so) or no process holds it.
        """
        return self._call("pty_write", {"pty": pty, "data": data}, timeout=self.default_timeout)

    def pty_read(self, pty: int, cursor: int = 0, *, max_bytes: Optional[int] = None,
                 timeout: Optional[float] = None):
        """The terminal's output from byte ``cursor``, waiting up to ``timeout`` s for
        some when there is none yet: ``{"data", "cursor" (where to go on), "dropped",
        "eof", "running", "exit_code", ...}``.

        Args:
            pty: the terminal's id, as ``pty_open`` returned it.
            cursor: the byte offset in the terminal's output to read from: 0 for its
                start, then the ``cursor`` of the last answer to go on.
            max_bytes: the most bytes to return, 0 to 16 MiB; None: 1 MiB.
            timeout: seconds to wait for output past ``cursor`` when there is none yet,
                0 to 3,600; None: 0, no waiting. The client waits for the reply up to
                ``timeout`` plus REPLY_SLACK_S (30 s), or ``default_timeout`` if that is
                longer.

        Returns:
            (dict): the daemon's answer: ``data`` (bytes), ``cursor`` (where to go on),
                ``dropped`` (bytes between ``cursor`` and the oldest byte the ring still
                holds, lost) and ``eof`` (the output has ended and everything was read),
                plus the terminal's status, as ``pty_list`` gives it.

        Raises:
            DaemonError: ``TerminalNotFound`` if no terminal has that id.
        """
        fields = _present({"pty": pty, "cursor": cursor, "max_bytes": max_bytes,
                           "timeout": timeout})
        return self._call("pty_read", fields, timeout=_reply_timeout(timeout, self.default_timeout))

    def pty_resize(self, pty: int, cols: int, rows: int):
        """Give the terminal a new size; the kernel tells its foreground process group
        (SIGWINCH).

        Args:
            pty: the terminal's id, as ``pty_open`` returned it.
            cols: its width in columns, 1 to 10,000.
            rows: its height in rows, 1 to 10,000.

        Returns:
            (dict): the terminal's status, as ``pty_list`` gives it.

        Raises:
            DaemonError: ``TerminalNotFound`` if no terminal has that id;
                ``TerminalClosed`` if it is closed.
        """
        return self._call("pty_resize", {"pty": pty, "cols": cols, "rows": rows},
                          timeout=self.default_timeout)

    def pty_close(self, pty: int, *, kill_grace_s: Optional[float] = None):
        """End the terminal, its command and everything it started.

        Args:
            pty: the terminal's id, as ``pty_open`` returned it.
            kill_grace_s: seconds from the SIGTERM to the SIGKILL, 0 to 60; None: 0.5 s.
                Before them, the command and the processes on the terminal get SIGHUP,
                as when a terminal goes away.

        Returns:
            (dict): the terminal's status, as ``pty_list`` gives it. The last 16 closed
                terminals are kept, with their output, for ``pty_read`` and ``pty_list``.

        Raises:
            DaemonError: ``TerminalNotFound`` if no terminal has that id.
        """
        return self._call("pty_close", _present({"pty": pty, "kill_grace_s": kill_grace_s}),
                          timeout=self.default_timeout)

    def pty_list(self):
        """The status of every terminal of the sandbox: those open and the last 16
        closed.

        Returns:
            (list): a dict for each: ``pty`` (its id), ``pid``, ``cmd`` (the argv),
                ``running``, ``open``, ``exit_code``, ``signal``, ``cols``, ``rows`` and
                ``output_bytes`` (the bytes of output so far).
        """
        return self._call("pty_list", {}, timeout=self.default_timeout)
