"""The least a daemon process can do for ``exec``: a yardstick for the benchmarks.

It speaks just enough of the protocol for ``DaemonClient.exec``: per connection, a
blocking loop reads a frame, spawns the command as every daemon must (whitespace-split,
no shell; a new session, default SIGPIPE and SIGXFSZ, stdin /dev/null, stdout and
stderr through pipes: what ``captured spawn`` in bench/noop.py does), reads its output,
waits for it, and sends its exit code and output. No token check, validation, limits,
timeouts, sessions, streaming or requests side by side; stdout is read to its end
before stderr, so a command that fills the stderr pipe first would hang it. Whatever any daemon must add to a bare spawn is a socket round trip and
this, so ``bench/noop.py`` and ``bench/run_all.py`` time it beside sandmand: it shows
how much of sandmand's cost over the floor the round trip alone takes on the machine.
Never use it to run anything else: it trusts its socket.

    python bench/minimal_daemon.py SOCKET_PATH     (prints "ready" once listening)
"""

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sandman_ray.daemon.sandmand.wire import (  # noqa: E402
    PROTOCOL_VERSION, FrameReader, encode_frame, unpack)

ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "HOME": "/root", "LANG": "C.UTF-8"}
DEVNULL = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)


def run(cmd: str) -> dict:
    argv = cmd.split()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.posix_spawnp(argv[0], argv, ENV, setsid=True,
                              setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
                              file_actions=[(os.POSIX_SPAWN_DUP2, DEVNULL, 0),
                                            (os.POSIX_SPAWN_DUP2, out_w, 1),
                                            (os.POSIX_SPAWN_DUP2, err_w, 2)])
    finally:
        os.close(out_w)
        os.close(err_w)
    out, err = _read_all(out_r), _read_all(err_r)
    _, status = os.waitpid(pid, 0)
    return {"exit_code": os.waitstatus_to_exitcode(status), "signal": None,
            "timed_out": False, "duration_s": 0.0, "stdout": out, "stderr": err,
            "truncated": False}


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            os.close(fd)
            return b"".join(chunks)
        chunks.append(chunk)


def serve(conn: socket.socket) -> None:
    reader = FrameReader()
    buf = bytearray(65536)
    with conn:
        while True:
            n = conn.recv_into(buf)
            if not n:
                return
            for body in reader.feed(bytes(buf[:n])):
                req = unpack(body)
                if req.get("op") == "exec":
                    result = run(req["cmd"])
                else:  # hello, and anything else: a bare acknowledgement
                    result = {"version": PROTOCOL_VERSION}
                conn.sendall(encode_frame({"id": req.get("id"), "ok": True, "result": result}))


def start(path: Path) -> subprocess.Popen:
    """Start it on the unix socket ``path`` (for the benchmarks); returns once it
    listens, and stops it if it does not."""
    proc = subprocess.Popen([sys.executable, __file__, str(path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        ready = proc.stdout.readline().strip() == "ready"
    finally:
        proc.stdout.close()
    if not ready:
        proc.kill()
        proc.wait()
        raise SystemExit("bench/minimal_daemon.py did not start")
    return proc


def main() -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
