"""The daemon's commands: one-shot runs (streamed or not), persistent shell sessions,
the daemon's own state and its renewal (a mixin of ``operations._Operations``)."""

from typing import Callable, Dict, Optional

from sandman_ray.client.plans import (
    Command, OnOutput, _Transport, _present, _reply_timeout)
from sandman_ray.results import ExecResult


class _Commands(_Transport):
    """See the module's docstring."""

    def ping(self):
        """Ask the daemon whether it answers; it does nothing else.

        Returns:
            (None): nothing, once the daemon has answered.
        """
        return self._call("ping", {}, timeout=self.default_timeout)

    def info(self):
        """pid, uptime, python, os_release, limits ... of the daemon (a dict).

        Returns:
            (dict): the daemon's answer: ``pid``, ``pid1`` (whether it runs as PID 1),
                ``uptime_s``, ``python`` (its version), ``os_release`` (the image's
                /etc/os-release as a dict), ``hostname``, ``uid``, ``gid``, ``workdir``,
                ``cpu_count``, ``limits`` (``rlimits``: ``{name: [soft, hard]}``, None being
                unlimited; ``cgroup``: those of memory_max, pids_max, cpu_max or cpu_quota_us
                that are readable), ``sessions`` (the names of the shell sessions),
                ``processes`` (how many background processes run) and ``protocol`` (the
                wire protocol's version).
        """
        return self._call("info", {}, timeout=self.default_timeout)

    def exec(self, cmd: Command, *, timeout: Optional[float] = None, cwd: Optional[str] = None,
             env: Optional[Dict[str, Optional[str]]] = None, stdin: Optional[bytes] = None,
             max_output: Optional[int] = None, kill_grace_s: Optional[float] = None,
             command_id: Optional[str] = None, on_output: Optional[OnOutput] = None):
        """Run a command once (a shell string, or an argv list run without a shell).
        With ``on_output`` the output is streamed to it as ``(stream, bytes)`` and the
        result's stdout/stderr are empty. ``command_id``: run it once per lease; a
        retry with the same id gets the first run's result (waiting while it runs).

        Args:
            cmd: a shell string, run by ``/bin/sh -c``, or an argv list, run directly (its
                program looked up on ``PATH``).
            timeout: seconds the command may run; then its process group and every
                descendant get SIGTERM, and SIGKILL after ``kill_grace_s``, and the result
                says ``timed_out``. None: no limit. The client waits for the reply up to
                ``timeout`` plus REPLY_SLACK_S (30 s), or ``default_timeout`` if that is
                longer; with None, as long as the command runs.
            cwd: the working directory; None: the daemon's workdir.
            env: variables merged over the sandbox's environment; a value of None removes
                that variable.
            stdin: bytes written to the command's stdin, which is then closed; None: its
                stdin is ``/dev/null``.
            max_output: bytes of each stream kept in the result, 0 to 16 MiB; the rest is
                read and dropped (``truncated``). None: the daemon's default, 4 MiB (its
                ``--max-output``). With ``on_output``: the bytes sent per stream, and None
                is no limit.
            kill_grace_s: seconds from the SIGTERM of a timeout to the SIGKILL, 0 to 60;
                None: 2 s.
            command_id: a name chosen by the caller (1 to 256 characters) that makes the
                command run once per lease: a later call with the same id, on any
                connection of the lease, runs nothing and gets the first run's result. The
                same id with other arguments is refused (``BadRequest``).
            on_output: called with ``(stream, bytes)`` (stream "stdout" or "stderr") for
                the output as it comes; None: the output comes in the result.

        Returns:
            (ExecResult): how the command ended and, unless streamed, what it printed.

        Raises:
            DaemonError: ``FileNotFoundError`` when an argv's program is not found (a shell
                string's gives exit code 127 instead); ``CommandForgotten`` for a
                ``command_id`` whose answer is no longer kept (it is not run again).
        """
        fields = {"cmd": cmd if isinstance(cmd, str) else list(cmd)}
        if timeout is not None or cwd or env or stdin or max_output is not None \
                or kill_grace_s is not None or on_output or command_id is not None:
            fields.update(_present({"timeout": timeout, "cwd": cwd, "env": env, "stdin": stdin,
                                    "max_output": max_output, "kill_grace_s": kill_grace_s,
                                    "command_id": command_id,
                                    "stream": True if on_output else None}))
        return self._call("exec", fields, ExecResult.from_wire,
                          _reply_timeout(timeout, self.default_timeout), on_output)

    def exec_stream(self, cmd: Command, *, timeout: Optional[float] = None,
                    cwd: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None,
                    stdin: Optional[bytes] = None, max_output: Optional[int] = None,
                    kill_grace_s: Optional[float] = None, command_id: Optional[str] = None,
                    stop: Optional[Callable[[], bool]] = None):
        """Run a command, its output streamed: an iterator of ``(stream, bytes)``
        chunks as they arrive ("stdout" or "stderr"), then the ExecResult (its stdout
        and stderr empty), also kept as the iterator's ``result``. The daemon sends
        what the reader takes (a reader that lags slows the command's writes, and
        nothing piles up); a reader that stops, closes the iterator or is cancelled
        kills the command. No cap unless ``max_output`` is given. ``stop``: asked
        every STOP_POLL_S while no output comes (blocking client); True gives the
        stream up, as closing it does.

        Args:
            cmd: a shell string, run by ``/bin/sh -c``, or an argv list, run directly (its
                program looked up on ``PATH``).
            timeout: seconds the command may run; then its process group and every
                descendant get SIGTERM, and SIGKILL after ``kill_grace_s``. None: no
                limit. The client waits for the end up to ``timeout`` plus REPLY_SLACK_S
                (30 s), or ``default_timeout`` if that is longer; with None, as long as
                the command runs.
            cwd: the working directory; None: the daemon's workdir.
            env: variables merged over the sandbox's environment; a value of None removes
                that variable.
            stdin: bytes written to the command's stdin, which is then closed; None: its
                stdin is ``/dev/null``.
            max_output: the most bytes sent per stream, the rest read and dropped; None:
                no limit.
            kill_grace_s: seconds from the SIGTERM of a timeout to the SIGKILL, 0 to 60;
                None: 2 s.
            command_id: as for ``exec``: the command runs once per lease, and a later call
                with the same id gets the first run's result.
            stop: a function of no arguments asked every STOP_POLL_S (0.2 s) while no
                output comes, by the blocking client only (the asyncio client ignores it);
                True gives the stream up. None: never asked.

        Returns:
            (ExecStream): on the blocking client, the iterator of ``(stream, bytes)``
                chunks ending with the ExecResult; the asyncio client gives an async
                iterator of the same items.

        Raises:
            DaemonError: from the iterator, as for ``exec``: ``FileNotFoundError`` when an
                argv's program is not found, ``CommandForgotten`` for a ``command_id``
                whose answer is no longer kept.
        """
        fields = _present({"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout,
                           "cwd": cwd, "env": env, "stdin": stdin, "max_output": max_output,
                           "kill_grace_s": kill_grace_s, "command_id": command_id,
                           "stream": True})
        return self._stream("exec", fields, ExecResult.from_wire,
                            _reply_timeout(timeout, self.default_timeout), stop)

    def cancel(self, target: int):
        """Give up request ``target`` in flight on this connection (its command is
        killed); whether it was in flight.

        Args:
            target: the id of a request in flight on this connection. A retry waiting on
                a ``command_id`` stops waiting; a queued session run is dropped.

        Returns:
            (bool): True if it was given up; False when it was no longer in flight, or
                cannot be given up (a session run under way goes on to its end or its
                timeout, and so do requests answered at once).
        """
        return self._call("cancel", {"target": target}, lambda r: r["cancelled"],
                          self.default_timeout)

    # sessions
    def session_open(self, session: str = "default", *, shell: Optional[str] = None,
                     cwd: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None):
        """Start a persistent shell session named ``session``, for ``run``.

        Args:
            session: the session's name.
            shell: the shell to start; None: ``bash`` if it is on ``PATH``, else
                ``/bin/sh``.
            cwd: the shell's working directory; None: the daemon's workdir.
            env: variables merged over the sandbox's environment; a value of None removes
                that variable.

        Returns:
            (dict): the daemon's answer: ``session`` (the name), ``shell`` and ``pid`` (the
                shell's pid).

        Raises:
            DaemonError: ``SessionExists`` if a session of that name is open.
        """
        return self._call("session_open", _present({"session": session, "shell": shell,
                                                  "cwd": cwd, "env": env}),
                                 timeout=self.default_timeout)

    def run(self, cmd: str, *, session: str = "default", timeout: Optional[float] = None,
            max_output: Optional[int] = None, kill_grace_s: Optional[float] = None,
            command_id: Optional[str] = None):
        """Run ``cmd`` in a persistent shell session (opened on first use for
        ``default``): cwd, variables and functions carry over to the next run.
        ``command_id``: as for ``exec``, once per lease.

        Args:
            cmd: shell text, run by the session's shell itself; its stdin is
                ``/dev/null``. Runs on one session are served one at a time, in arrival
                order.
            session: the session's name; ``default`` is opened on first use, another
                name must have been opened with ``session_open``.
            timeout: seconds the command may run; then every descendant of the shell gets
                SIGTERM, then SIGKILL, the daemon waiting ``kill_grace_s`` after each, and
                the session survives (unless the shell itself is busy, in a builtin loop:
                then the session is killed). None: no limit. The client waits for the
                reply up to ``timeout`` plus REPLY_SLACK_S (30 s), or ``default_timeout``
                if that is longer; with None, as long as the command runs.
            max_output: bytes of each stream kept in the result, 0 to 16 MiB; the rest is
                read and dropped. None: the daemon's default, 4 MiB.
            kill_grace_s: seconds waited after each signal of a timeout, 0 to 60; None:
                2 s.
            command_id: as for ``exec``: the command runs once per lease, and a later call
                with the same id gets the first run's result.

        Returns:
            (ExecResult): as for ``exec``, with ``session_alive`` False when the command
                exited the shell or the shell was killed on a timeout (``exit_code`` then
                None).

        Raises:
            DaemonError: ``SessionNotFound`` for a session other than ``default`` that is
                not open; ``SessionClosed`` once the session's shell has exited;
                ``CommandForgotten`` as for ``exec``.
        """
        fields = _present({"session": session, "cmd": cmd, "timeout": timeout,
                           "max_output": max_output, "kill_grace_s": kill_grace_s,
                           "command_id": command_id})
        return self._call("run", fields, ExecResult.from_wire,
                                 _reply_timeout(timeout, self.default_timeout))

    def session_close(self, session: str = "default", *, kill_grace_s: Optional[float] = None):
        """Stop the session's shell and everything it started (TERM, then KILL after
        ``kill_grace_s``).

        Args:
            session: the session's name.
            kill_grace_s: seconds from the TERM to the KILL, 0 to 60; None: 2 s.

        Returns:
            (dict): the daemon's answer: ``session`` (the name) and ``exit_code`` (the
                shell's).

        Raises:
            DaemonError: ``SessionNotFound`` if no session has that name.
        """
        return self._call("session_close", _present({"session": session,
                                                     "kill_grace_s": kill_grace_s}),
                          timeout=self.default_timeout)

    def session_list(self):
        """The shell sessions of the sandbox: those opened and not yet closed.

        Returns:
            (list): a dict for each: ``session`` (its name), ``pid`` and ``shell`` (its
                shell's), and ``alive`` (whether the shell still runs).
        """
        return self._call("session_list", {}, timeout=self.default_timeout)

    # the daemon itself
    def shutdown(self, kill_grace_s: Optional[float] = None):
        """Stop every process of the sandbox and the daemon itself.

        Args:
            kill_grace_s: seconds from the SIGTERM to the SIGKILL that every session,
                background process and running command gets, 0 to 60; None: 2 s.

        Returns:
            (None): nothing: the daemon answers, then stops.
        """
        return self._call("shutdown", _present({"kill_grace_s": kill_grace_s}),
                                 timeout=self.default_timeout)

    def bind(self, env: Optional[Dict[str, str]] = None, workdir: Optional[str] = None):
        """The lease's own environment (over the sandbox's) and working directory (made
        when missing) for every command started from now on; the pool's, as it lends
        a warm sandbox to a spec that sets them (see the protocol doc).

        Returns:
            (dict): ``workdir``, the working directory now.
        """
        return self._call("bind", _present({"env": env, "workdir": workdir}),
                          timeout=self.default_timeout)

    def renew(self, phase: str, root: Optional[str] = None, token: Optional[str] = None,
              admin: Optional[str] = None):
        """The launcher's: ready the sandbox for its next lease (see the protocol doc);
        needs a connection made with the admin token."""
        return self._call("renew", _present({"phase": phase, "root": root, "token": token,
                                             "admin": admin}),
                          timeout=self.default_timeout)
