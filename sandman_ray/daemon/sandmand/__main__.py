"""sandmand: the daemon that runs inside a sandbox.

Usage::

    python -m sandmand | python sandman_ray/daemon/sandmand | python sandmand.pyz
                --listen unix:/run/sandman/sock | tcp:HOST:PORT | fd:N
                [--token-file FILE | --token-fd N]   (else the SANDMAN_TOKEN variable;
                                                      the file is removed once read)
                [--admin-token-fd N]    (the launcher's token, for renew)
                [--env-fd N]            (the sandbox's environment, NUL-separated
                                         KEY=VALUE entries, for the commands the
                                         daemon starts; the daemon's own environment
                                         stays the launcher's minimal one. With N the
                                         token's descriptor, they follow the token's
                                         first line)
                [--env-file FILE]       (FILE the --token-file: the sandbox's
                                         environment follows the token's first line)
                [--root DIR]            (run in DIR, a path of the root it starts in,
                                         which renew moves it out of)
                [--workdir DIR] [--ready-fd N] [--max-output BYTES]
                [--hello-timeout SECONDS] [--user UID[:GID]] [--limits K=V,...]
                [--socket-mode OCTAL]   (a unix socket's mode, default 0600)
                [--oom-counter FILE]    (the sandbox's cgroup OOM kill count: v2
                                         memory.events or v1 memory.oom_control; else
                                         the first of OOM_COUNTERS that can be read)

--user drops to that uid/gid once listening (the socket is handed to it too); --root
needs root's CAP_SYS_CHROOT (not with --user);
--limits records the limits the launcher applied, reported by ``info``.
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # run as a directory (python sandman_ray/daemon/sandmand): the package is imported from the
    # directory above, and this file's relative imports resolve in it (PEP 366; no
    # spec: it would name another package)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__, __spec__ = "sandmand", None

from .attrs import drop_bounding_set  # noqa: E402
from .daemon import OOM_COUNTERS, Daemon, OomCounter, decode_environ, oom_kills  # noqa: E402
from .wire import DEFAULT_OUTPUT_CAP, HELLO_TIMEOUT_S  # noqa: E402


def parse_args(argv):
    opts = {"listen": None, "token_file": None, "token_fd": None, "workdir": None,
            "ready_fd": None,
            "max_output": DEFAULT_OUTPUT_CAP, "hello_timeout": HELLO_TIMEOUT_S,
            "user": None, "limits": "", "socket_mode": "0600", "oom_counter": None,
            "admin_token_fd": None, "root": None, "env_fd": None, "env_file": None}
    it = iter(argv)
    for arg in it:
        key, sep, value = arg.partition("=")
        name = key.lstrip("-").replace("-", "_")
        if not key.startswith("--") or name not in opts:
            raise SystemExit("sandmand: unknown argument %r\n%s" % (arg, __doc__))
        if not sep:
            value = next(it, None)
            if value is None:
                raise SystemExit("sandmand: %s needs a value" % key)
        opts[name] = value
    if opts["listen"] is None:
        raise SystemExit("sandmand: --listen is required\n%s" % __doc__)
    return opts


def main(argv=None):
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    rest = b""  # what follows the token's first line in its file or descriptor
    if opts["token_file"]:  # read once, then removed: nothing started later finds it
        first, _, rest = _read_all(open(opts["token_file"], "rb"),
                                   "--token-file").partition(b"\n")
        try:
            os.unlink(opts["token_file"])
        except OSError:
            pass  # a read-only mount (a secret volume): the launcher keeps it from others
        token = first.decode("ascii", "replace").strip()
    elif opts["token_fd"] is not None:  # a pipe: the token is in no file and no environment
        first, _, rest = _read_all(int(opts["token_fd"]), "--token-fd").partition(b"\n")
        token = first.decode("ascii", "replace").strip()
    else:
        token = os.environ.get("SANDMAN_TOKEN", "")
    launch_data = opts["token_file"] or opts["token_fd"]  # where the token's line was read
    env_at = opts["env_file"] or opts["env_fd"]
    if env_at is None:
        env = None
    elif env_at == launch_data:  # the environment follows that first line
        env = decode_environ(rest)
    elif opts["env_file"] is None:
        env = decode_environ(_read_all(int(env_at), "--env-fd"))
    else:
        raise SystemExit("sandmand: --env-file must name the --token-file")
    admin_token = None
    if opts["admin_token_fd"] is not None:
        with os.fdopen(int(opts["admin_token_fd"]), "rb") as fh:
            admin_token = fh.read(4096).decode("ascii", "replace").strip() or None
    for key in [k for k in os.environ if k.startswith("SANDMAN_")]:
        del os.environ[key]
    if not token:
        raise SystemExit("sandmand: no token (give --token-file or SANDMAN_TOKEN)")
    ready_fd = int(opts["ready_fd"]) if opts["ready_fd"] is not None else None
    listen_fd = int(opts["listen"][3:]) if opts["listen"].startswith("fd:") else None
    _close_inherited(keep=(ready_fd, listen_fd))
    skeleton = None
    if opts["root"]:
        if opts["user"]:
            raise SystemExit("sandmand: --root and --user exclude each other")
        skeleton = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.chroot(opts["root"])
    workdir = opts["workdir"] or os.getcwd()
    os.makedirs(workdir, exist_ok=True)  # as a container's WORKDIR is made
    os.chdir(workdir)
    drop_bounding_set()  # before the Daemon notes its settings
    daemon = Daemon(token, os.getcwd(), int(opts["max_output"]), float(opts["hello_timeout"]),
                    env=env)
    daemon.admin_token, daemon.skeleton = admin_token, skeleton
    daemon.applied_limits = dict(item.partition("=")[::2] for item in opts["limits"].split(",")
                                 if item)
    try:
        daemon.socket_mode = int(opts["socket_mode"], 8) & 0o777
    except ValueError:
        raise SystemExit("sandmand: --socket-mode must be octal, got %r" % opts["socket_mode"])
    if opts["user"]:
        uid, _, gid = opts["user"].partition(":")
        daemon.user = (int(uid), int(gid or uid))
    counters = [opts["oom_counter"]] if opts["oom_counter"] else OOM_COUNTERS
    counter = next((c for c in counters if oom_kills(c) is not None), None)
    daemon.oom_counter = None if counter is None else OomCounter(counter)
    daemon.run(opts["listen"], ready_fd)


# the most the launcher hands over on a descriptor (a token, an environment)
LAUNCH_DATA_MAX = 16 * 2 ** 20


def _read_all(source, option):
    """Everything in ``source``, a descriptor or a binary file (to its end, at most
    LAUNCH_DATA_MAX), which is closed."""
    with os.fdopen(source, "rb") if isinstance(source, int) else source as fh:
        data = fh.read(LAUNCH_DATA_MAX + 1)
    if len(data) > LAUNCH_DATA_MAX:
        raise SystemExit("sandmand: %s holds more than %d bytes" % (option, LAUNCH_DATA_MAX))
    return data


def _close_inherited(keep):
    """Close every descriptor the launcher left open (beyond stdio and those in
    ``keep``): the daemon holds nothing it did not open itself."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed meanwhile


if __name__ == "__main__":
    main()
